"""compile(): model -> traced graph -> passes -> target launch data -> CompiledModel; or a traced
graph -> CompiledGraph."""
from __future__ import annotations

from tqdm import tqdm

from .codegen import get_target
from .codegen.artifact import CompiledModel
from .errors import DeepfuseError
from .frontend import trace
from .ir import DTYPES, Graph
from .models import build_model, load_model, step_specs
from .models.family import Model
from .passes import PassManager, cleanup_passes, fusion_passes
from .runtime.tokenizer import Tokenizer


def trace_model(model, dtype: str = "f32", kv_cache_dtype: str | None = None):
    """The model's step graph with weights cast to `dtype` (and caches of kv_cache_dtype, see step_specs)."""
    if dtype not in ("f32", "bf16", "f16"):
        raise DeepfuseError(f"unsupported dtype {dtype!r} (use f32, bf16 or f16)")
    weights = {k: v.to(DTYPES[dtype]) for k, v in model.weights.items()}
    cast = build_model(model.config, weights)
    return trace(cast.step, *step_specs(model.config, dtype, kv_cache_dtype), weights=weights, name=model.config.family)


def check_host_steps(plan: dict, target: str, allow_host_steps: bool) -> None:
    """ascend950 refuses a build whose ops would run as references on the host, unless allowed."""
    steps = plan["host_steps"]
    if target == "ascend950" and steps and not allow_host_steps:
        listed = "; ".join(f"{s['node']}: {s['why']}" for s in steps[:8]) + (" ..." if len(steps) > 8 else "")
        raise DeepfuseError(f"{len(steps)} op(s) would run on the host, not as ascend950 kernels: {listed} "
                            "(compile(..., allow_host_steps=True) builds it anyway, listing them in the manifest)")


def compile_graph(graph: Graph, target: str = "cpu", fuse: bool = True, dump_dir: str | None = None,
                  allow_host_steps: bool = False):
    """Compiles a traced graph (deepfuse.trace) for `target` -> CompiledGraph, callable here."""
    from .compiled_graph import CompiledGraph

    tgt = get_target(target)
    passes = cleanup_passes() + (fusion_passes() if fuse else []) + tgt.codegen_passes()
    weights = dict(graph.weights)
    graph = graph.copy()
    graph.weights = weights
    graph, reports = PassManager(passes).run(graph, dump_dir)
    plan = tgt.lower(graph)
    check_host_steps(plan, target, allow_host_steps)
    files = tgt.binaries(plan)
    return CompiledGraph(graph, plan, target, tgt.make_runner(plan, graph.weights, files), [vars(r) for r in reports])


def compile(model: str | Model | Graph, target: str = "cpu", dtype: str = "f32", fuse: bool = True,
            dump_dir: str | None = None, tokenizer: Tokenizer | None = None, quant: str | None = None,
            batch_invariant: bool = False, kv_cache_dtype: str | None = None, allow_host_steps: bool = False):
    """Compiles `model` (a name/path that load_model accepts, or a model of a registered family) for
    `target`; a traced ir.Graph instead gives a CompiledGraph (compile_graph).
    allow_host_steps (ascend950): build even where an op would run its reference on the host
        (the plan's and manifest's host_steps list them); without it such a build is refused.
    quant: None, "int4" (weight-only, 4-bit groups of 32; the LM head stays dense), "int4-head"
        (the LM head int4 too), "int4-head8" (the LM head W8A8), "int4-a8" (int4 weights times
        int8 activations per group of 32, the LM head W8A8) or "w8a8" (int8 weights, int8
        activations per row and group of 64;
        see passes/quantize.py).
    kv_cache_dtype: None (the caches hold `dtype`) or "int8" (cpu: each cached k and v row as int8
        with an f32 scale, half the bytes of bf16 for attention to read; docs/quantization.md).
    batch_invariant (cpu, sm90, sm100): one kernel per op for every batch shape, so a request's
    tokens never depend on what shares its steps or how its prompt was chunked (cpu: slower small
    steps, see codegen/cpu/executor.check_batch_invariant for where it is available; sm90/sm100:
    every GEMM in the decode kernels' fixed split-K form and attention in the one-pass kernel,
    codegen/triton/emit.py)."""
    if isinstance(model, Graph):
        return compile_graph(model, target, fuse, dump_dir, allow_host_steps)
    tgt = get_target(target)
    if batch_invariant:
        tgt.check_invariant()
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
        plan = tgt.lower(graph, batch_invariant)
        check_host_steps(plan, target, allow_host_steps)
        files = tgt.binaries(plan)
        bar.update()
    passes = [vars(r) for r in reports]
    return CompiledModel(graph, plan, target, dtype, model.config, tokenizer, tgt.make_runner(plan, graph.weights, files), passes,
                         quant, files)
