"""Pass and PassManager: ordered passes, verify after each, timing, IR dumps, pass ids.

A pass is a function Graph -> Graph (it may mutate and return its argument), or a set of
rewrite rules (pattern.rule_pass), whose per-rule counts land in the report. Its id is a
hash of its module's source, so artifacts and cache keys change when a pass does.
"""
from __future__ import annotations

import hashlib
import inspect
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..ir import Graph, print_graph, verify


@dataclass(frozen=True)
class Pass:
    name: str
    fn: Callable[[Graph], Graph]

    @property
    def id(self) -> str:
        module = getattr(self.fn, "module", None) or inspect.getmodule(self.fn)  # a RuleSet names its module
        src = inspect.getsource(module) + self.name
        return hashlib.sha256(src.encode()).hexdigest()[:16]

    def __call__(self, g: Graph) -> Graph:
        return self.fn(g)


@dataclass
class PassReport:
    name: str
    id: str
    seconds: float
    nodes_before: int
    nodes_after: int
    fired: dict[str, int] = field(default_factory=dict)  # rule name -> rewrites, for rule passes


class PassManager:
    """Runs passes in order; verifies the input and the graph after every pass."""

    def __init__(self, passes: list[Pass]):
        self.passes = passes

    def run(self, g: Graph, dump_dir: str | None = None) -> tuple[Graph, list[PassReport]]:
        verify(g)
        if dump_dir:
            os.makedirs(dump_dir, exist_ok=True)
        reports = []
        for i, p in enumerate(self.passes):
            before = print_graph(g) if dump_dir else ""
            n_before = len(g.nodes)
            t0 = time.perf_counter()
            g = p(g)
            seconds = time.perf_counter() - t0
            try:
                verify(g)
            except ValueError as e:
                raise ValueError(f"pass {p.name} produced an invalid graph: {e}") from None
            if dump_dir:
                stem = os.path.join(dump_dir, f"{i:02d}-{p.name}")
                with open(stem + ".before.ir", "w") as f:
                    f.write(before)
                with open(stem + ".after.ir", "w") as f:
                    f.write(print_graph(g))
            reports.append(PassReport(p.name, p.id, seconds, n_before, len(g.nodes), dict(getattr(p.fn, "fired", {}))))
        return g, reports

    def ids(self) -> dict[str, str]:
        return {p.name: p.id for p in self.passes}
