"""SPMD partitioning: a step graph and a sharding per weight and input -> one rank's graph with
explicit collective ops.

A sharding says how a value lies over the `world` ranks of a one-axis mesh:
    R     replicated: every rank holds all of it
    S(d)  split along dim d: rank r holds the r-th of `world` equal slices
    P     partial: every rank holds a summand, the value is their sum
Propagation runs forward over the nodes, as GSPMD's does. Each op's rule sees its inputs'
shardings and answers which shardings it takes, which its outputs get, and the local op to run
(a vocabulary slice of the embedding, the rank's experts of an MoE) or a function that emits
several nodes for it (an MoE dispatched by all_to_all); an op without a rule, or a rule that
declines, runs replicated. An input whose sharding differs from the one asked for is
resharded: P -> R by all_reduce, S(d) -> R by all_gather, R -> S(d) by take_shard (local); a
partial sum reduced once is replicated for its later users (so a residual add after a partial
projection reduces the projection, as in Megatron, and the add meets the norm that follows it).
Graph outputs are made replicated. Params are sliced to the rank's shard (only the shard is kept);
inputs sharded by the spec (the kv caches) get their local types. An MoE dispatched by all_to_all
adds one input, `ep_rows` (the rank's token rows, ir/opdefs_ep.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import DeepfuseError
from ..ir import OPS, Graph, Node, TensorType, Value
from ..ir.opdefs_collective import shard_bounds
from .manager import Pass


@dataclass(frozen=True)
class Sharding:
    kind: str  # "R", "S" or "P"
    dim: int = -1  # the split dim of "S"
    units: int = 0  # "S": the dim is this many equal blocks (heads, say), dealt out in contiguous runs
    #                 (ir.opdefs_collective.shard_bounds; uneven when world does not divide them); 0: world blocks

    def __str__(self) -> str:
        return f"S({self.dim}{f', {self.units} blocks' if self.units else ''})" if self.kind == "S" else self.kind

    def split(self, dim: int) -> bool:
        return self.kind == "S" and self.dim == dim

    def on(self, dim: int) -> Sharding:
        """The same split of blocks along another dim (a linear's output columns from its weight's rows)."""
        return Sharding("S", dim, self.units)


R, P = Sharding("R"), Sharding("P")


def S(dim: int, units: int = 0) -> Sharding:  # noqa: N802  (reads like the notation)
    return Sharding("S", dim, units)


MOE_DISPATCH = ("all_reduce", "all_to_all")


@dataclass
class ShardingSpec:
    """How a model's weights and step inputs lie over `world` ranks; names not listed are replicated."""

    world: int
    params: dict[str, Sharding] = field(default_factory=dict)
    inputs: dict[str, Sharding] = field(default_factory=dict)
    # expert-parallel moe: "all_reduce" (every rank's experts on every token, the partial sums
    # all-reduced) or "all_to_all" (each rank's token rows sent to their experts' ranks and back)
    moe_dispatch: str = "all_reduce"

    def __post_init__(self) -> None:
        if self.moe_dispatch not in MOE_DISPATCH:
            raise DeepfuseError(f"moe_dispatch must be one of {', '.join(MOE_DISPATCH)}, got {self.moe_dispatch!r}")


# rule(input shardings, node, partitioner) -> (wanted input shardings, output shardings, op, attrs) or
# None; op: the local op's name, or a function (partitioner, local inputs, attrs) -> local outputs that
# emits several nodes for it (partitioner.emit)
Plan = tuple[list[Sharding], list[Sharding], "str | Callable", dict]
RULES: dict[str, Callable[[list[Sharding], Node, _Partitioner], Plan | None]] = {}


def rule(*ops: str) -> Callable:
    def wrap(fn):
        for op in ops:
            RULES[op] = fn
        return fn
    return wrap


@rule("linear")
def _linear(ins, n, part):
    w = ins[1]
    if w.split(0):  # split by output features: a column slice of y
        return [R, w], [w.on(1)], n.op, n.attrs
    if w.split(1):  # split by input features: y is a partial sum
        return [w, w], [P], n.op, n.attrs
    return None


@rule("add_bias")
def _add_bias(ins, n, part):
    return ([ins[1].on(1), ins[1]], [ins[1].on(1)], n.op, n.attrs) if ins[1].split(0) else None


@rule("add", "mul", "silu", "cast")
def _pointwise(ins, n, part):
    if ins[0].kind == "S" and all(s == ins[0] for s in ins):
        return ins, [ins[0]], n.op, n.attrs
    if n.op == "add" and all(s == P for s in ins):
        return ins, [P], n.op, n.attrs
    return None


@rule("rope", "head_rms_norm")
def _per_head(ins, n, part):  # heads are whole within a column slice (the spec splits by heads)
    return ([ins[0]] + [R] * (len(ins) - 1), [ins[0]], n.op, n.attrs) if ins[0].split(1) else None


@rule("attention")
def _attention(ins, n, part):
    cache = ins[3]
    if not cache.split(3):  # the kv cache's heads decide
        return None
    h, hkv = n.attrs["num_heads"], n.attrs["num_kv_heads"]
    lo, hi = shard_bounds(hkv, cache.units, part.world, part.rank)
    heads = cache.on(1)
    want = [heads, heads, heads, cache, R, R, R, R] + [cache.on(0)] * (len(ins) - 8)  # sinks: one per head
    return want, [heads], n.op, {**n.attrs, "num_heads": (hi - lo) * (h // hkv), "num_kv_heads": hi - lo}


@rule("embedding")
def _embedding(ins, n, part):
    if not ins[0].split(0):
        return None
    start, _ = shard_bounds(n.inputs[0].type.shape[0], ins[0].units, part.world, part.rank)
    return [ins[0], R], [P], "vocab_embedding", {"start": start}


@rule("logits")
def _logits(ins, n, part):
    return ([R, ins[1], R], [ins[1].on(1)], n.op, n.attrs) if ins[1].split(0) else None


@rule("moe")
def _moe(ins, n, part):
    if not ins[2].split(0) or ins[3] != ins[2] or n.attrs.get("num_shared", 0):
        return None
    rest = [R] * (len(ins) - 4)
    if part.spec.moe_dispatch == "all_to_all":
        return [R, R, ins[2], ins[2]] + rest, [R], _moe_all_to_all, n.attrs
    first, _ = shard_bounds(n.inputs[2].type.shape[0], ins[2].units, part.world, part.rank)
    return [R, R, ins[2], ins[2]] + rest, [P], "moe_experts", {**n.attrs, "first_expert": first}


def _moe_all_to_all(part: _Partitioner, args: list[Value], attrs: dict) -> list[Value]:
    """moe over the rank's token rows: route, all_to_all to the experts' ranks and back, combine,
    all_gather the rows (ir/opdefs_ep.py). x and the router logits come in replicated."""
    x, logits, w13, w2, *bias = args
    rows, world = part.token_rows(), part.world
    mine = part.emit("gather_rows", [x, rows], {})[0]
    scores = part.emit("gather_rows", [logits, rows], {})[0]
    send, weights, ids, slots = part.emit("moe_dispatch", [mine, scores, rows, *bias], {**attrs, "world": world})
    sent = [part.emit("all_to_all", [v], {"world": world})[0] for v in (send, weights, ids)]
    done = part.emit("moe_local_experts", [*sent, w13, w2], {})[0]
    back = part.emit("all_to_all", [done], {"world": world})[0]
    own = part.emit("moe_combine", [back, slots], {})[0]
    every = part.emit("all_gather", [own], {"dim": 0, "world": world})[0]
    return part.emit("rows_to_tokens", [every, x], {})


class _Partitioner:
    def __init__(self, g: Graph, spec: ShardingSpec, rank: int):
        self.g, self.spec, self.world, self.rank = g, spec, spec.world, rank
        self.out = Graph(g.name, [], [], [], [])
        self.env: dict[Value, tuple[Value, Sharding]] = {}
        self.resharded: dict[tuple[Value, Sharding], Value] = {}

    def run(self) -> Graph:
        for v in self.g.inputs:
            s = self.spec.inputs.get(v.name, R)
            local = Value(v.name, v.type.with_shape(*self._local_shape(v, s)))
            self.out.inputs.append(local)
            self.env[v] = (local, s)
        for p in self.g.params:
            s = self.spec.params.get(p.name, R)
            w = self.g.weights[p.name]
            if s.kind == "S":
                lo, hi = self._bounds(p, s)
                w = w.narrow(s.dim, lo, hi - lo).contiguous()
            self.env[p] = (self.out.add_param(p.name, w), s)
        for n in self.g.nodes:
            self._node(n)
        self.out.outputs = [self._reshard(v, R) for v in self.g.outputs]
        return self.out

    def token_rows(self) -> Value:
        """The rank graph's input `ep_rows` i64[Tr]: the step's token rows this rank owns
        (ir.opdefs_ep.ep_rows; the compiled model fills it), added on first use."""
        rows = next((v for v in self.out.inputs if v.name == "ep_rows"), None)
        if rows is None:
            rows = Value("ep_rows", TensorType("i64", ("Tr",)))
            self.out.inputs.append(rows)
        return rows

    def _bounds(self, v: Value, s: Sharding) -> tuple[int, int]:
        size = v.type.shape[s.dim] if 0 <= s.dim < v.type.rank else None
        try:
            if not isinstance(size, int):
                raise ValueError(f"dim {s.dim} is not a fixed dim")
            return shard_bounds(size, s.units, self.world, self.rank)
        except ValueError as e:
            raise DeepfuseError(f"%{v.name} {v.type} cannot be split as {s} over {self.world} ranks: {e}") from None

    def _local_shape(self, v: Value, s: Sharding) -> tuple:
        shape = list(v.type.shape)
        if s.kind == "S":
            lo, hi = self._bounds(v, s)
            shape[s.dim] = hi - lo
        return tuple(shape)

    def _node(self, n: Node) -> None:
        for v in n.inputs:  # a partial sum already reduced for another user is replicated from here on
            if self.env[v][1] == P and (v, R) in self.resharded:
                self.env[v] = (self.resharded[(v, R)], R)
        ins = [self.env[v][1] for v in n.inputs]
        plan = RULES[n.op](ins, n, self) if n.op in RULES else None
        want, outs, op, attrs = plan or ([R] * len(ins), [R] * len(n.outputs), n.op, n.attrs)
        args = [self._reshard(v, s) for v, s in zip(n.inputs, want)]
        new = op(self, args, attrs) if callable(op) else self.emit(op, args, attrs)
        for v, local, s in zip(n.outputs, new, outs):
            self.env[v] = (local, s)

    def emit(self, op: str, args: list[Value], attrs: dict) -> list[Value]:
        """Appends a node of the rank's graph; returns its outputs."""
        types = OPS[op].infer([a.type for a in args], attrs)
        outs = [self.out.fresh(t) for t in types]
        self.out.nodes.append(Node(op, args, outs, dict(attrs)))
        return outs

    def _reshard(self, v: Value, want: Sharding) -> Value:
        local, have = self.env[v]
        if have == want:
            return local
        key = (v, want)
        if key not in self.resharded:
            full = local
            if have == P:
                full = self.emit("all_reduce", [local], {"world": self.world})[0]
            elif have.kind == "S":
                if have.units % self.world:
                    raise DeepfuseError(f"%{v.name} {v.type} is split unevenly ({have}); all_gather needs equal slices")
                full = self.emit("all_gather", [local], {"dim": have.dim, "world": self.world})[0]
            self.resharded[key] = full if want == R else self.emit(
                "take_shard", [full], {"dim": want.dim, "world": self.world, "rank": self.rank, "units": want.units})[0]
        return self.resharded[key]


def partition(g: Graph, spec: ShardingSpec, rank: int) -> Graph:
    """Rank `rank`'s graph of g under `spec`: local shapes, local weights, collectives where the
    shardings meet. Every rank's graph has the same nodes in the same order (SPMD)."""
    if not 0 <= rank < spec.world:
        raise DeepfuseError(f"rank {rank} not in [0, {spec.world})")
    return _Partitioner(g, spec, rank).run()


def shard_pass(spec: ShardingSpec, rank: int) -> Pass:
    """The partitioning as a pass (run it before the fusions; they see a normal, smaller graph)."""
    def shard(g: Graph) -> Graph:
        return partition(g, spec, rank)

    return Pass(f"shard_tp{spec.world}_rank{rank}", shard)
