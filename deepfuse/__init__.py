"""deepfuse: a compiler-driven LLM inference engine.

    graph = deepfuse.trace(fn, *specs)
    art = deepfuse.compile("smollm2", target="cpu"); art.save("out/smollm2-cpu")
    art = deepfuse.load("out/smollm2-cpu")
    LLM("smollm2").generate(["Hello"], SamplingParams(temperature=0))
"""
__version__ = "0.1.0"

from .compiler import compile  # noqa: E402
from .errors import DeepfuseError  # noqa: E402
from .frontend import Spec, trace  # noqa: E402
from .runtime.engine import RequestOutput, SamplingParams  # noqa: E402
from .runtime.llm import LLM  # noqa: E402
from .runtime.loader import load  # noqa: E402

__all__ = ["compile", "load", "trace", "Spec", "LLM", "SamplingParams", "RequestOutput", "DeepfuseError"]
