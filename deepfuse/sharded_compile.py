"""compile_rank(): one rank's CompiledModel of a tensor/expert-parallel model.

The step graph is partitioned first (passes/shard.py, shardings from models/sharding.py), then
runs the target's normal pipeline: the fusions see an ordinary graph of the rank's shapes with
all_reduce / all_gather nodes in it. On cpu, sm90 and sm100 they run as host steps calling the
process's communicator (runtime/distributed.py): gloo on the CPU target, NCCL for sm90/sm100 on GPUs
(one per rank), gloo for sm90/sm100 in Triton's CPU interpreter. On ascend950 they are HCCL calls of
the generated host code (codegen/ascendc/collective.py), which the AscendC emulator hands to gloo.
The rank's config is its local view of the model: num_heads and num_kv_heads those of this rank (so
its engine sizes a kv cache of its own kv heads).
"""
from __future__ import annotations

import dataclasses

from .codegen import get_target
from .codegen.artifact import CompiledModel
from .compiler import trace_model
from .errors import DeepfuseError
from .models.sharding import llama_sharding
from .passes import PassManager
from .passes.shard import ShardingSpec, shard_pass
from .runtime.tokenizer import Tokenizer


def compile_rank(model, world: int, rank: int, target: str = "cpu", dtype: str = "f32", tokenizer: Tokenizer | None = None,
                 dump_dir: str | None = None, spec: ShardingSpec | None = None,
                 moe_dispatch: str | None = None) -> CompiledModel:
    """model: a Llama-family model (all its weights; the result keeps only rank `rank`'s shards).
    spec: the shardings (default: llama_sharding(model.config, world, moe_dispatch)); moe_dispatch:
    "all_reduce" or "all_to_all" (None: the spec's, else "all_reduce"). A rank graph
    that takes `ep_rows` (MoE by all_to_all) gets it from the compiled model, which knows its
    rank (plan["ep_rows"] = [world, rank])."""
    tgt = get_target(target)  # every target runs the collectives (cpu, sm90, sm100: gloo / NCCL; ascend950: HCCL)
    spec = spec or llama_sharding(model.config, world, moe_dispatch or "all_reduce")
    if spec.world != world:
        raise DeepfuseError(f"the sharding spec is for {spec.world} ranks, not {world}")
    if moe_dispatch not in (None, spec.moe_dispatch):
        raise DeepfuseError(f"the sharding spec dispatches MoE by {spec.moe_dispatch}, moe_dispatch says {moe_dispatch}")
    check_dispatch_target(model.config, target, spec.moe_dispatch)
    graph = trace_model(model, dtype)
    graph, reports = PassManager([shard_pass(spec, rank), *tgt.pipeline()]).run(graph, dump_dir)
    plan = tgt.lower(graph)
    if any(v.name == "ep_rows" for v in graph.inputs):
        plan["ep_rows"] = [world, rank]
    files = tgt.binaries(plan)
    c = model.config
    kv_heads = next(v.type.shape[3] for v in graph.inputs if v.name.startswith("kv_cache."))  # uneven splits differ
    local = dataclasses.replace(c, num_heads=kv_heads * (c.num_heads // c.num_kv_heads), num_kv_heads=kv_heads)
    return CompiledModel(graph, plan, target, dtype, local, tokenizer, tgt.make_runner(plan, graph.weights, files),
                         [vars(r) for r in reports], None, files)


def check_dispatch_target(config, target: str, moe_dispatch: str) -> None:
    """Refuses the all_to_all MoE form on a target without its kernels (before any compiling)."""
    if moe_dispatch == "all_to_all" and target != "cpu" and getattr(config, "num_experts", 0):
        raise DeepfuseError(f"moe_dispatch='all_to_all' runs on the cpu target; {target} dispatches expert-"
                            "parallel MoE by all_reduce (moe_dispatch='all_reduce')")


def save_sharded(ranks: list[CompiledModel], directory: str) -> str:
    """Writes a tensor-parallel artifact: rank{r}/, each rank's artifact (CompiledModel.save), and a
    manifest.json naming the world size and the sha256 of every rank's manifest, so that the
    digest of the top manifest (artifact_digest) pins every rank's files. Returns directory."""
    import json
    import os

    from . import __version__
    from .codegen.artifact import FORMAT_VERSION, sha256_file

    os.makedirs(directory, exist_ok=True)
    for r, art in enumerate(ranks):
        art.save(os.path.join(directory, f"rank{r}"))
    first = ranks[0]
    manifest = {"format_version": FORMAT_VERSION, "deepfuse_version": __version__, "target": first.target,
                "dtype": first.dtype, "quant": first.quant, "tensor_parallel": len(ranks),
                "model": {"family": first.config.family},
                "ranks": {f"rank{r}": sha256_file(os.path.join(directory, f"rank{r}", "manifest.json"))
                          for r in range(len(ranks))}}
    with open(os.path.join(directory, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return directory


def compile_sharded(model, world: int, directory: str, target: str = "cpu", dtype: str = "f32",
                    tokenizer: Tokenizer | None = None, moe_dispatch: str = "all_reduce") -> str:
    """Compiles every rank of `model` (one after another, in this process) and writes them as one
    tensor-parallel artifact (save_sharded). The tokenizer goes with rank 0."""
    llama_sharding(model.config, world, moe_dispatch)  # refuse a model that does not split before compiling
    check_dispatch_target(model.config, target, moe_dispatch)
    return save_sharded([compile_rank(model, world, r, target, dtype, tokenizer if r == 0 else None,
                                      moe_dispatch=moe_dispatch)
                         for r in range(world)], directory)
