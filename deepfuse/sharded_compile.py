"""compile_rank(): one rank's CompiledModel of a tensor/expert-parallel model.

The step graph is partitioned first (passes/shard.py, shardings from models/sharding.py), then
runs the target's normal pipeline: the fusions see an ordinary graph of the rank's shapes with
all_reduce / all_gather nodes in it, which run as host steps calling the process's communicator
(runtime/distributed.py). The rank's config is its local view of the model: num_heads and
num_kv_heads those of this rank (so its engine sizes a kv cache of its own kv heads).
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
                 dump_dir: str | None = None, spec: ShardingSpec | None = None) -> CompiledModel:
    """model: a Llama-family model (all its weights; the result keeps only rank `rank`'s shards).
    spec: the shardings (default: llama_sharding(model.config, world))."""
    if target != "cpu":
        raise DeepfuseError(f"tensor parallelism runs on the cpu target (gloo collectives); {target!r} is not done yet")
    spec = spec or llama_sharding(model.config, world)
    if spec.world != world:
        raise DeepfuseError(f"the sharding spec is for {spec.world} ranks, not {world}")
    tgt = get_target(target)
    graph = trace_model(model, dtype)
    graph, reports = PassManager([shard_pass(spec, rank), *tgt.pipeline()]).run(graph, dump_dir)
    plan = tgt.lower(graph)
    files = tgt.binaries(plan)
    c = model.config
    kv_heads = next(v.type.shape[3] for v in graph.inputs if v.name.startswith("kv_cache."))  # uneven splits differ
    local = dataclasses.replace(c, num_heads=kv_heads * (c.num_heads // c.num_kv_heads), num_kv_heads=kv_heads)
    return CompiledModel(graph, plan, target, dtype, local, tokenizer, tgt.make_runner(plan, graph.weights, files),
                         [vars(r) for r in reports], None, files)
