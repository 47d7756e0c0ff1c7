"""CompiledGraph: any traced function (an ir.Graph from deepfuse.trace) compiled for a target
and callable on this machine: the CPU target natively, sm90/sm100 on a GPU (or in Triton's CPU
interpreter when the process started with TRITON_INTERPRET=1), ascend950 in the AscendC emulator.

    g = deepfuse.trace(fn, Spec("x", "f32", ("T", 64)), ...)
    f = deepfuse.compile(g, target="ascend950")
    y = f(x=...)            # or f(x): the graph's inputs, by name or in order
    f.launches              # [{"op", "kind": "generated" | "template" | "template+generated" | "view"
                            #   | "collective" | "reference", "ops": the graph ops a generated kernel fuses}]
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import DeepfuseError
from .ir import Graph, print_graph


@dataclass
class CompiledGraph:
    graph: Graph  # the final graph
    plan: dict
    target: str
    runner: object
    passes: list[dict]

    @property
    def launches(self) -> list[dict]:
        """Per launch: its op, its kind, and for a generated kernel the graph ops it fuses."""
        return [{"op": p["op"], "kind": p["kind"], **({"ops": p["attrs"]["ops"]} if "ops" in p["attrs"] else {})}
                for p in self.plan["launches"]]

    @property
    def host_steps(self) -> list[dict]:
        return self.plan["host_steps"]

    def kernels_text(self) -> str:
        """Every generated kernel's IR, as text."""
        from .kernel.ir import Kernel

        return "\n".join(Kernel.from_json(n.attrs["kernel"]).text() for n in self.graph.nodes if n.op == "kernel")

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        names = [v.name for v in self.graph.inputs]
        if len(args) > len(names):
            raise DeepfuseError(f"{self.graph.name} takes {len(names)} inputs ({', '.join(names)}), got {len(args)}")
        inputs = dict(zip(names, args)) | kwargs
        missing = [n for n in names if n not in inputs]
        if missing or set(inputs) - set(names):
            raise DeepfuseError(f"{self.graph.name} takes inputs {', '.join(names)}; "
                                f"missing {missing or 'none'}, unknown {sorted(set(inputs) - set(names)) or 'none'}")
        from .ir.interpret import check_inputs

        try:
            check_inputs(self.graph, inputs)
        except ValueError as e:
            raise DeepfuseError(str(e)) from None
        outs = self.runner(inputs)
        return outs[0] if len(outs) == 1 else outs

    def __repr__(self) -> str:
        kinds = {}
        for p in self.launches:
            kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
        return f"<CompiledGraph {self.graph.name} for {self.target}: {kinds}>\n{print_graph(self.graph)}"
