"""The fusion scheduler: which lowerable graph nodes share a generated kernel, and why.

The rule, applied greedily in graph order (each node joins at most one group, nothing is
ever computed twice):
  - vertical: a node joins the groups that produce its operands, so their results stay on chip
    (a value read only inside the group is never written);
  - horizontal: a node joins a group that reads the same graph value, so it is read once;
  - a group has one index space (R, G, C), the space of its elementwise members; a row op
    (its result is one value per row, [R, G, 1]) fits any space with its R and G. All
    reductions of a group run along its C, the only reduction axis a kernel has;
  - a merge that would put a node outside the group between two of its members (a cycle
    through, say, a GEMM) is refused.
Each group keeps its reasons (why nodes joined, why a neighbour did not); `deepfuse ir
--stats` and the dumps show them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import Graph, Node, Value
from .lower import Space, space_of


@dataclass(eq=False)
class Group:
    nodes: list[Node]
    space: Space
    row_only: bool  # every member so far is a row op (C still open)
    reasons: list[str] = field(default_factory=list)


def fits(a: Group, space: Space, row: bool) -> Space | None:
    """The merged space of group a and a node of (space, row), or None if they differ."""
    if a.space[:2] != space[:2]:
        return None
    if a.row_only or row:
        return a.space if row else space
    return a.space if a.space == space else None


def _keeps_rows(n: Node, space: Space) -> bool:
    """A reshape whose result can be the group's output buffer: the rows first, ints after."""
    shape = n.outputs[0].type.shape
    return len(shape) >= 1 and shape[0] == space[0] and all(isinstance(d, int) for d in shape[1:])


def _label(n: Node, names: dict[Value, str]) -> str:
    return f"%{names.get(n.outputs[0], n.outputs[0].name)} ({n.op})"


def schedule(g: Graph, lowerable: set[Node]) -> list[Group]:
    """Groups of the nodes in `lowerable` (each lowerable by space_of), in graph order."""
    order = {n: i for i, n in enumerate(g.nodes)}
    producers = g.producers()
    deps: dict[Node, int] = {}  # bitset of the nodes each node depends on, transitively
    for n in g.nodes:
        bits = 0
        for v in n.inputs:
            p = producers.get(v)
            if p is not None:
                bits |= deps[p] | (1 << order[p])
        deps[n] = bits
    group_of: dict[Node, Group] = {}
    groups: list[Group] = []
    readers: dict[Value, list[Group]] = {}
    names = {v: str(i) for i, v in enumerate(v for n in g.nodes for v in n.outputs)}

    def cycle_through(members: list[Node]) -> Node | None:
        """A node outside `members` that would run between two of them once they are one kernel
        (every other group counted as the one kernel it will be), or None."""
        inside = set(members)

        def unit(n: Node):
            return "merged" if n in inside else group_of.get(n, n)

        succ: dict = {}
        for n in g.nodes:
            for v in n.inputs:
                p = producers.get(v)
                if p is not None and unit(p) != unit(n):
                    succ.setdefault(unit(p), set()).add(unit(n))
        seen, todo = set(), list(succ.get("merged", ()))
        while todo:
            u = todo.pop()
            if u in seen:
                continue
            seen.add(u)
            nxt = succ.get(u, ())
            if "merged" in nxt:
                return u if isinstance(u, Node) else u.nodes[0]
            todo.extend(nxt)
        return None

    for n in g.nodes:
        if n.op == "reshape" and producers.get(n.inputs[0]) in group_of and \
                _keeps_rows(n, group_of[producers[n.inputs[0]]].space):  # a member's result, viewed
            grp = group_of[producers[n.inputs[0]]]
            grp.nodes.append(n)
            group_of[n] = grp
            continue
        if n not in lowerable:
            continue
        space, row = space_of(n)
        mine = Group([n], space, row)
        candidates: list[tuple[Group, str]] = []
        for v in n.inputs:
            p = producers.get(v)
            if p in group_of and all(grp is not group_of[p] for grp, _ in candidates):
                candidates.append((group_of[p], f"vertical: {_label(p, names)} -> {_label(n, names)}"))
            for grp in readers.get(v, []):
                if all(grp is not c for c, _ in candidates):
                    candidates.append((grp, f"horizontal: {_label(n, names)} reads %{names.get(v, v.name)} too"))
        for grp, why in candidates:
            merged = fits(grp, mine.space, mine.row_only)
            if merged is None:
                grp.reasons.append(f"not fused with {_label(n, names)}: index space {list(space)} vs {list(grp.space)}")
                continue
            through = cycle_through(grp.nodes + mine.nodes)
            if through is not None:
                grp.reasons.append(f"not fused with {_label(n, names)}: {_label(through, names)} runs between them")
                continue
            grp.nodes = sorted(grp.nodes + mine.nodes, key=order.__getitem__)
            grp.space, grp.row_only = merged, grp.row_only and mine.row_only
            grp.reasons += mine.reasons + [why]
            for m in mine.nodes:
                group_of[m] = grp
            if mine in groups:
                groups.remove(mine)
            for rs in readers.values():
                while mine in rs:
                    rs.remove(mine)
                if grp in rs and rs.count(grp) > 1:
                    rs.remove(grp)
            mine = grp
        if mine not in groups:
            groups.append(mine)
            group_of[n] = mine
        for v in n.inputs:
            if v not in producers or producers[v] not in group_of or group_of[producers[v]] is not mine:
                rs = readers.setdefault(v, [])
                if mine not in rs:
                    rs.append(mine)
    groups.sort(key=lambda grp: order[grp.nodes[0]])
    return groups
