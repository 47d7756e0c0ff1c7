"""Target registry. A target names the ops it has hand-written kernels (templates) for, how it
turns a final graph into launch data, and how it runs that data.

Every other op gets its decomposition where each piece then has a kernel, and groups of
primitive ops become generated kernels (passes/generate_kernels.py) that the target renders
from the kernel IR; what is left runs its op's reference and is listed in the plan's
`host_steps`. Adding a target touches only its own folder plus one line here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import DeepfuseError
from ..ir import Graph, Node
from ..passes import Pass, cleanup_passes, dce, fusion_passes, prologue_passes, quant_passes
from ..passes.decompose import decompose_for
from ..passes.fuse_epilogues import HOSTS, fuse_epilogues
from ..passes.generate_kernels import generate_kernels

Runner = Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]
Keep = Callable[[Node], bool]
VIEW_OPS = ("reshape",)  # a reference that only relabels memory


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    keeps: Keep  # the node runs a hand-written kernel (template) here
    build: Callable[[Graph], dict]  # final graph -> launch plan (JSON-able)
    runner: Callable[[dict, dict[str, torch.Tensor]], Runner]  # (plan, weights) -> step function
    binaries: Callable[[dict], dict[str, bytes]] = lambda plan: {}  # plan -> artifact files (kernels/...)
    runs_binaries: bool = False  # the runner takes those files as a third argument (Triton: cubins)
    device: bool = True  # a reference launch runs off the target's kernels (a host step)
    templates: frozenset[str] = frozenset()  # ops with a template, for some forms of them (keeps decides)
    epilogue_hosts: frozenset[str] = frozenset()  # template ops whose kernels run a generated epilogue
    # final graph -> the plan of a batch-invariant build (one kernel form per op at every batch shape);
    # None: not offered here. The plan is then marked "batch_invariant" (the CPU executor reads the mark)
    invariant_build: Callable[[Graph], dict] | None = None

    def make_runner(self, plan: dict, weights: dict[str, torch.Tensor], files: dict[str, bytes]) -> Runner:
        return self.runner(plan, weights, files) if self.runs_binaries else self.runner(plan, weights)

    def pipeline(self, fuse: bool = True, quant: str | None = None) -> list[Pass]:
        passes = cleanup_passes() + (fusion_passes() if fuse else []) + quant_passes(quant)
        passes += prologue_passes() if fuse else []
        return passes + self.codegen_passes()

    def codegen_passes(self) -> list[Pass]:
        """Decompose what has no template here, then generate kernels for the primitive groups."""
        return [Pass("decompose", decompose_for(self.keeps)), Pass("generate_kernels", generate_kernels(self.keeps)),
                Pass("dce", dce), Pass("fuse_epilogues", fuse_epilogues(self.hosts_epilogue))]

    def hosts_epilogue(self, n: Node) -> bool:
        """The node's template takes a generated epilogue here."""
        return self.keeps(n) and n.op in self.epilogue_hosts

    def lower(self, g: Graph, batch_invariant: bool = False) -> dict:
        """The launch plan of a final graph, each launch marked with its kind ("generated",
        "template", "template+generated" (a GEMM with its generated epilogue), "collective" (a
        collective op the target's host code calls: ascend950's HCCL), "view" or "reference")
        and the plan's host_steps listed."""
        if batch_invariant:
            self.check_invariant()
        plan = self.invariant_build(g) if batch_invariant else self.build(g)
        for n, p in zip(g.nodes, plan["launches"]):
            p["kind"] = launch_kind(self, n, p)
        plan["host_steps"] = [{"node": p.get("node", f"%{i} ({p['op']})"), "op": p["op"], "why": self.why_reference(n)}
                              for i, (n, p) in enumerate(zip(g.nodes, plan["launches"])) if p["kind"] == "reference"]
        if batch_invariant:
            if self.device and plan["host_steps"]:  # a torch op's kernels may change with the batch
                raise DeepfuseError(f"batch-invariant execution is not available on {self.name}: "
                                    f"{', '.join(s['node'] for s in plan['host_steps'])} would run torch's reference")
            plan["batch_invariant"] = True
        return plan

    def check_invariant(self) -> None:
        """Raises unless this target offers batch-invariant builds."""
        if self.invariant_build is None:
            offered = ", ".join(name for name in TARGETS if TARGETS[name]().invariant_build)
            raise DeepfuseError(f"batch_invariant is implemented for the {offered} targets, not {self.name!r}")

    def why_reference(self, n: Node) -> str:
        if n.op in ("kernel", "with_epilogue"):
            return (f"the {self.name} renderer does not take this generated kernel ({'+'.join(n.attrs['ops'])}); "
                    "see docs/kernels.md for its limits")
        quant = {k: n.attrs[k] for k in ("act_group", "group_size") if k in n.attrs}
        if n.op in self.templates:
            return f"the {self.name} {n.op} template does not take this form{f' ({quant})' if quant else ''}"
        return f"{self.name} has no kernel for {n.op} and no decomposition into ops that have one"


def launch_kind(t: Target, n: Node, p: dict) -> str:
    if p.get("collective"):  # a collective the target's host code runs (ascend950: HCCL)
        return "collective"
    if n.op == "kernel" and (p.get("kernels") or not t.device):
        return "generated"
    if n.op == "with_epilogue" and (p.get("kernels") or not t.device):
        return "template+generated"
    if p.get("kernels") or (not t.device and t.keeps(n)):
        return "template"
    return "view" if n.op in VIEW_OPS else "reference"


def _cpu() -> Target:
    from .cpu import CpuExecutor, build_plan
    from .cpu.kernels import FACTORIES, PREPACKED, PREPACKED_Q4
    from .cpu.out_kernels import OUT_FACTORIES

    # add: generated, so a residual add fuses with its neighbours (and into a GEMM's epilogue)
    hand = (set(FACTORIES) | set(PREPACKED) | set(PREPACKED_Q4) | set(OUT_FACTORIES)) - {"kernel", "add"}
    return Target("cpu", "this machine's CPU: native and torch kernels, generated C++", lambda n: n.op in hand,
                  build_plan, CpuExecutor, device=False, epilogue_hosts=frozenset(HOSTS), invariant_build=build_plan)


def _triton(arch: str) -> Callable[[], Target]:
    def make() -> Target:
        from .triton import ARCH_DESCRIPTIONS, build_plan, compile_binaries
        from .triton.emit import EMITTERS, EPILOGUE_HOSTS, emittable
        from .triton.runner import TritonRunner

        return Target(arch, ARCH_DESCRIPTIONS[arch], lambda n: n.op not in ("kernel", "with_epilogue") and emittable(n),
                      lambda g: build_plan(g, arch), TritonRunner, compile_binaries, runs_binaries=True,
                      templates=frozenset(EMITTERS) - {"kernel", "with_epilogue"}, epilogue_hosts=frozenset(EPILOGUE_HOSTS),
                      invariant_build=lambda g: build_plan(g, arch, batch_invariant=True))

    return make


def _ascend() -> Target:
    from .ascendc import DESCRIPTION, EMITTERS, build_plan, emittable
    from .ascendc.project import project_files
    from .ascendc.runner import EmulatorRunner

    return Target("ascend950", DESCRIPTION, lambda n: n.op not in ("kernel", "with_epilogue") and emittable(n),
                  build_plan, EmulatorRunner, project_files, templates=frozenset(EMITTERS) - {"kernel", "with_epilogue"},
                  epilogue_hosts=frozenset(HOSTS))


TARGETS: dict[str, Callable[[], Target]] = {"cpu": _cpu, "sm90": _triton("sm90"), "sm100": _triton("sm100"),
                                            "ascend950": _ascend}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise DeepfuseError(f"unknown target {name!r} (available: {', '.join(sorted(TARGETS))})")
    return TARGETS[name]()
