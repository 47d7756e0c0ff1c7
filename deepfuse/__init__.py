"""deepfuse: a compiler-driven LLM inference engine.

    graph = deepfuse.trace(fn, *specs)
    art = deepfuse.compile("smollm2", target="cpu"); art.save("out/smollm2-cpu")
    art = deepfuse.load("out/smollm2-cpu")
    LLM("smollm2").generate(["Hello"], SamplingParams(temperature=0))
"""
__version__ = "0.1.0"

from .compiler import compile
from .errors import DeepfuseError
from .frontend import Spec, trace
from .runtime.engine import SamplingParams
from .runtime.llm import LLM
from .runtime.loader import load
from .runtime.outputs import CompletionOutput, RequestOutput
from .runtime.spec import SpecConfig
from .runtime.structured import StructuredOutputsParams

__all__ = ["LLM", "CompletionOutput", "DeepfuseError", "RequestOutput", "SamplingParams", "Spec", "SpecConfig",
           "StructuredOutputsParams", "compile", "load", "trace"]
