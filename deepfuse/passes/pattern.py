"""Pattern language: match trees of IR ops and rewrite them, to a fixed point.

    from deepfuse.frontend import ops
    from deepfuse.passes.pattern import Op, Rule, Var, rule_pass

    x, res, w = Var("x"), Var("res"), Var("w")
    ADD_NORM = Rule("add_rms_norm",
                    Op("rms_norm", Op("add", x, res, name="sum"), w, name="norm"),
                    lambda m: ops.add_rms_norm(m["x"], m["res"], m["w"], eps=m.attrs("norm")["eps"]),
                    replaces=("sum", "norm"))
    fuse = rule_pass("fuse_add_rms_norm", [ADD_NORM])      # a Pass; reports how often each rule fired

Patterns:
- `Var("x")` matches any value and captures it; the same name twice must be the same value.
  `Var()` is a wildcard that captures nothing.
- `Op(op, *args, name=, out=, attrs=)` matches output `out` (default 0) of a node running `op`
  whose inputs match `args` and whose attributes include `attrs`. `name` captures the node;
  the same name twice must be the same node (two outputs of one split, say). `add` and
  `mul` match their operands in either order.
Rules:
- `when(m)` is a guard over the match (captured values, nodes, their attributes, m.graph).
- `replace(m)` is written against deepfuse.frontend.ops, with m["x"] standing for the
  captured values; it returns the new value(s) for the root node (`replaces=None`), or for
  each output of each named node in `replaces`, in that order. None for an output means
  "not produced any more": the match is then skipped if anything outside it reads that
  output. A replaced side-effecting node (a cache write) is removed like any other.
- A match whose inner nodes are read outside it is skipped unless those nodes are replaced
  too, so a rewrite never computes anything twice.
"""
from __future__ import annotations

import heapq
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..ir import OPS, Graph, Node, Value

COMMUTATIVE = frozenset({"add", "mul"})
MAX_REWRITES = 100_000


@dataclass(frozen=True)
class Var:
    name: str | None = None


@dataclass(frozen=True)
class Op:
    op: str
    args: tuple
    name: str | None = None
    out: int = 0
    attrs: tuple = ()

    def __init__(self, op: str, *args: Op | Var, name: str | None = None, out: int = 0,
                 attrs: dict[str, Any] | None = None):
        object.__setattr__(self, "op", op)
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "out", out)
        object.__setattr__(self, "attrs", tuple(sorted((attrs or {}).items())))


@dataclass
class Match:
    graph: Graph
    values: dict[str, Any] = field(default_factory=dict)  # Values while matching, tracers in replace()
    nodes: dict[str, Node] = field(default_factory=dict)
    matched: list[Node] = field(default_factory=list)  # every node the pattern covered, root last

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def node(self, name: str) -> Node:
        return self.nodes[name]

    def attrs(self, name: str) -> dict[str, Any]:
        return self.nodes[name].attrs

    def is_param(self, name: str) -> bool:
        """True if the captured value is a graph parameter (a weight)."""
        return any(self.values[name] is p for p in self.graph.params)


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Op
    replace: Callable[[Match], Any]
    when: Callable[[Match], bool] | None = None
    replaces: tuple[str, ...] | None = None


def _match(p: Op | Var, v: Value, producers: dict[Value, Node], m: Match) -> bool:
    if isinstance(p, Var):
        if p.name is None:
            return True
        if p.name in m.values:
            return m.values[p.name] is v
        m.values[p.name] = v
        return True
    node = producers.get(v)
    if node is None or node.op != p.op or len(node.outputs) <= p.out or node.outputs[p.out] is not v:
        return False
    if any(node.attrs.get(k) != want for k, want in p.attrs):
        return False
    if p.name is not None:
        if p.name in m.nodes:
            return m.nodes[p.name] is node  # same name, same node: its inputs already matched
        m.nodes[p.name] = node
    if len(node.inputs) != len(p.args):
        return False
    orders = [list(node.inputs)]
    if p.op in COMMUTATIVE and len(p.args) == 2:
        orders.append(list(reversed(node.inputs)))
    for ins in orders:
        trial = Match(m.graph, dict(m.values), dict(m.nodes), list(m.matched))
        if all(_match(a, x, producers, trial) for a, x in zip(p.args, ins)):
            m.values, m.nodes, m.matched = trial.values, trial.nodes, trial.matched
            if node not in m.matched:
                m.matched.append(node)
            return True
    return False


def match(pattern: Op, root: Node, graph: Graph, producers: dict[Value, Node]) -> Match | None:
    """The match of `pattern` rooted at node `root`, or None."""
    if pattern.out >= len(root.outputs):
        return None
    m = Match(graph)
    return m if _match(pattern, root.outputs[pattern.out], producers, m) else None


def _self_contained(rule: Rule, m: Match, users: dict[Value, list[Node]], outputs: set[Value]) -> bool:
    """Inner matched nodes must not be read outside the match unless the rule replaces them."""
    replaced = {id(m.nodes[n]) for n in (rule.replaces or ())}
    inside = {id(n) for n in m.matched}
    root = m.matched[-1]
    for node in m.matched:
        if node is root or id(node) in replaced:
            continue
        for v in node.outputs:
            if v in outputs or any(id(u) not in inside for u in users.get(v, [])):
                return False
    return True


def toposort(g: Graph) -> None:
    """Orders g.nodes so every input is defined first, keeping the existing order wherever it
    can; side-effecting nodes (cache writes) keep their relative order."""
    order = {id(n): i for i, n in enumerate(g.nodes)}
    producers = g.producers()
    waiting: dict[int, int] = {}
    dependents: dict[int, list[Node]] = {id(n): [] for n in g.nodes}
    last_effect = None
    for n in g.nodes:
        deps = {id(producers[v]) for v in n.inputs if v in producers}
        if _side_effect(n):
            if last_effect is not None:
                deps.add(id(last_effect))
            last_effect = n
        waiting[id(n)] = len(deps)
        for d in deps:
            dependents[d].append(n)
    ready = [(order[id(n)], n) for n in g.nodes if waiting[id(n)] == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for d in dependents[id(n)]:
            waiting[id(d)] -= 1
            if waiting[id(d)] == 0:
                heapq.heappush(ready, (order[id(d)], d))
    if len(out) != len(g.nodes):
        raise ValueError("graph has a cycle")
    g.nodes = out


def _side_effect(n: Node) -> bool:
    return OPS[n.op].side_effect


def _apply(g: Graph, rule: Rule, m: Match, users: dict[Value, list[Node]], outputs: set[Value]) -> bool:
    """Inserts the replacement; False (graph unchanged) if an output replaced by None is
    still read outside the match."""
    from ..frontend import trace_into

    names = sorted(m.values)
    inputs = [m.values[k] for k in names]
    given: list[bool] = []

    def build(*tracers):
        view = Match(g, dict(zip(names, tracers)), m.nodes, m.matched)
        res = rule.replace(view)
        res = tuple(res) if isinstance(res, (tuple, list)) else (res,)
        given[:] = [r is not None for r in res]
        return tuple(r for r in res if r is not None)

    nodes, produced = trace_into(g, build, inputs, {})
    targets = [m.nodes[n] for n in rule.replaces] if rule.replaces else [m.matched[-1]]
    olds = [v for t in targets for v in t.outputs]
    if len(olds) != len(given):
        raise ValueError(f"rule {rule.name}: replace() gave {len(given)} values for {len(olds)} outputs")
    it = iter(produced)
    results = [next(it) if ok else None for ok in given]
    inside = {id(n) for n in m.matched}
    for old, new in zip(olds, results):
        if new is None:
            if old in outputs or any(id(u) not in inside for u in users.get(old, [])):
                return False  # the dropped value is still needed
        elif old.type != new.type:
            raise ValueError(f"rule {rule.name}: replacement {new} does not have the type of {old}")
    root = m.matched[-1]
    at = g.nodes.index(root)
    g.nodes[at:at] = nodes
    for old, new in zip(olds, results):
        if new is not None:
            g.replace_uses(old, new)
    replaced = {id(t) for t in targets}
    users, outputs = g.users(), set(g.outputs)
    dead: set[int] = set()
    for n in reversed(m.matched):  # root first, so a node read only by dead ones dies too
        if (not _side_effect(n) or id(n) in replaced) and not any(v in outputs for v in n.outputs) and \
                all(id(u) in dead for v in n.outputs for u in users.get(v, [])):
            dead.add(id(n))
    g.nodes = [n for n in g.nodes if id(n) not in dead]
    toposort(g)
    return True


def _rewrite_once(g: Graph, rules: Sequence[Rule]) -> Rule | None:
    """Applies the first rule that matches anywhere (in graph order); returns it, or None."""
    producers, users, outputs = g.producers(), g.users(), set(g.outputs)
    for node in list(g.nodes):
        for rule in rules:
            if node.op != rule.pattern.op:
                continue
            m = match(rule.pattern, node, g, producers)
            if (m is not None and _self_contained(rule, m, users, outputs) and (rule.when is None or rule.when(m))
                    and _apply(g, rule, m, users, outputs)):
                return rule
    return None


def rewrite(g: Graph, rules: Sequence[Rule]) -> dict[str, int]:
    """Applies rules until none matches; returns how often each fired."""
    fired = {r.name: 0 for r in rules}
    while (rule := _rewrite_once(g, rules)) is not None:
        fired[rule.name] += 1
        if sum(fired.values()) > MAX_REWRITES:
            raise RuntimeError(f"rule {rule.name} keeps firing: a rewrite recreates its own pattern")
    g.drop_unused_params()
    return fired


class RuleSet:
    """A pass made of rules: call it on a graph; `fired` holds the last run's counts."""

    def __init__(self, rules: Sequence[Rule], module: Any):
        self.rules, self.module, self.fired = list(rules), module, {}

    def __call__(self, g: Graph) -> Graph:
        self.fired = rewrite(g, self.rules)
        return g


def rule_pass(name: str, rules: Sequence[Rule]):
    """A Pass named `name` running `rules` to a fixed point. Its id hashes the calling module."""
    from .manager import Pass

    return Pass(name, RuleSet(rules, inspect.getmodule(sys._getframe(1))))
