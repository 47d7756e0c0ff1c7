"""Runs the per-rank graphs of a partitioned program in one process, the collectives simulated.

Every rank's graph has the same nodes in the same order (passes/shard.py), so the ranks advance
in lockstep: an ordinary node runs its reference on each rank's values, a collective node calls
its COMBINE entry (ir/opdefs_collective.py) on all ranks' inputs at once. Numerics checks of the
partitioning need no processes this way.
"""
from __future__ import annotations

import torch

from .graph import Graph, Value
from .interpret import check_inputs
from .opdefs_collective import COMBINE
from .opdefs_ep import with_ep_rows
from .ops import OPS


def interpret_ranks(graphs: list[Graph], inputs: list[dict[str, torch.Tensor]]) -> list[list[torch.Tensor]]:
    """graphs[r], inputs[r]: rank r's graph and step inputs (its kv cache shards, written in place).
    Returns each rank's graph outputs."""
    ops = [[n.op for n in g.nodes] for g in graphs]
    if any(o != ops[0] for o in ops):
        raise ValueError("the ranks' graphs differ in their nodes; they are not one SPMD program")
    envs: list[dict[Value, torch.Tensor]] = []
    for g, ins in zip(graphs, inputs):
        check_inputs(g, ins)
        env = {v: ins[v.name] for v in g.inputs}
        env.update({p: g.weights[p.name] for p in g.params})
        envs.append(env)
    for nodes in zip(*(g.nodes for g in graphs)):
        if nodes[0].op in COMBINE:
            outs = COMBINE[nodes[0].op]([env[n.inputs[0]] for env, n in zip(envs, nodes)], nodes[0].attrs)
            for env, n, t in zip(envs, nodes, outs):
                env[n.outputs[0]] = t
            continue
        for env, n in zip(envs, nodes):
            res = OPS[n.op].reference(*[env[v] for v in n.inputs], **n.attrs)
            for v, t in zip(n.outputs, res if isinstance(res, tuple) else (res,)):
                env[v] = t
    return [[env[v] for v in g.outputs] for env, g in zip(envs, graphs)]


class SimulatedRanks:
    """A step function over all ranks in one process: takes the unpartitioned step's inputs
    (whose kv caches it ignores), keeps each rank's own kv cache shards (and gives a rank graph
    that takes `ep_rows` its token rows, ir/opdefs_ep.py), returns rank 0's outputs
    (all ranks' outputs are replicated). graphs: the per-rank graphs of one partitioning."""

    def __init__(self, graphs: list[Graph]):
        self.graphs = graphs
        self.caches: list[dict[str, torch.Tensor]] | None = None
        self.last: list[list[torch.Tensor]] = []

    def __call__(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if self.caches is None:  # zeros, as an unwritten cache; attention reads only written slots
            self.caches = [{v.name: torch.zeros(self._shape(v, inputs), dtype=inputs[v.name].dtype)
                            for v in g.inputs if v.name.startswith("kv_cache.")} for g in self.graphs]
        world = len(self.graphs)
        per_rank = [with_ep_rows({**inputs, **c}, world, r) if any(v.name == "ep_rows" for v in g.inputs)
                    else {**inputs, **c} for r, (g, c) in enumerate(zip(self.graphs, self.caches))]
        self.last = interpret_ranks(self.graphs, per_rank)
        return self.last[0]

    @staticmethod
    def _shape(v: Value, inputs: dict[str, torch.Tensor]) -> tuple[int, ...]:
        full = inputs[v.name].shape
        return tuple(d if isinstance(d, int) else full[i] for i, d in enumerate(v.type.shape))
