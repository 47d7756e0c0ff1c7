"""compile(): model -> traced graph -> passes -> target launch data -> CompiledModel."""
from __future__ import annotations

from tqdm import tqdm

from .codegen import get_target
from .codegen.artifact import CompiledModel
from .errors import DeepfuseError
from .frontend import trace
from .ir import DTYPES
from .models import Llama, load_model, step_specs
from .passes import PassManager
from .runtime.tokenizer import Tokenizer


def trace_model(model: Llama, dtype: str = "f32", kv_cache_dtype: str | None = None):
    """The model's step graph with weights cast to `dtype` (and caches of kv_cache_dtype, see step_specs)."""
    if dtype not in ("f32", "bf16", "f16"):
        raise DeepfuseError(f"unsupported dtype {dtype!r} (use f32, bf16 or f16)")
    weights = {k: v.to(DTYPES[dtype]) for k, v in model.weights.items()}
    cast = Llama(model.config, weights)
    return trace(cast.step, *step_specs(model.config, dtype, kv_cache_dtype), weights=weights, name=model.config.family)


def compile(model: str | Llama, target: str = "cpu", dtype: str = "f32", fuse: bool = True,
            dump_dir: str | None = None, tokenizer: Tokenizer | None = None, quant: str | None = None,
            batch_invariant: bool = False, kv_cache_dtype: str | None = None) -> CompiledModel:
    """Compiles `model` (a name/path that load_model accepts, or a Llama) for `target`.
    quant: None, "int4" (weight-only, 4-bit groups of 32) or "w8a8" (int8 weights, int8
        activations per row and group of 64; see passes/quantize.py).
    kv_cache_dtype: None (the caches hold `dtype`) or "int8" (cpu: each cached k and v row as int8
        with an f32 scale, half the bytes of bf16 for attention to read; docs/quantization.md).
    batch_invariant (cpu): one kernel per op for every batch shape, so a request's tokens never
    depend on what shares its steps or how its prompt was chunked (slower small steps; see
    codegen/cpu/executor.check_batch_invariant for where it is available)."""
    tgt = get_target(target)
    if batch_invariant and target != "cpu":
        raise DeepfuseError(f"batch_invariant is implemented for the cpu target, not {target!r}")
    if kv_cache_dtype is not None and target != "cpu":
        raise DeepfuseError(f"kv_cache_dtype {kv_cache_dtype!r} is implemented for the cpu target, not {target!r}")
    pipeline = tgt.pipeline(fuse, quant)
    if isinstance(model, str):
        model, tokenizer = load_model(model)
    with tqdm(total=3, desc=f"compiling for {target}", leave=False) as bar:
        graph = trace_model(model, dtype, kv_cache_dtype)
        bar.update()
        graph, reports = PassManager(pipeline).run(graph, dump_dir)
        bar.update()
        plan = tgt.build(graph)
        if batch_invariant:
            plan["batch_invariant"] = True
        files = tgt.binaries(plan)
        bar.update()
    passes = [vars(r) for r in reports]
    return CompiledModel(graph, plan, target, dtype, model.config, tokenizer, tgt.make_runner(plan, graph.weights, files), passes,
                         quant, files)
