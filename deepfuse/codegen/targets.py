"""Target registry. A target names its lowering passes, the ops it has kernels for,
how it turns a final graph into launch data, and how it runs that data.

Adding a target touches only its own folder plus one line here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import DeepfuseError
from ..ir import Graph
from ..passes import Pass, cleanup_passes, fusion_passes, prologue_passes, quant_passes
from ..passes.decompose import decompose_unsupported

Runner = Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]


@dataclass(frozen=True)
class Target:
    name: str
    description: str
    kernels: frozenset[str]
    build: Callable[[Graph], dict]  # final graph -> launch plan (JSON-able)
    runner: Callable[[dict, dict[str, torch.Tensor]], Runner]  # (plan, weights) -> step function
    binaries: Callable[[dict], dict[str, bytes]] = lambda plan: {}  # plan -> artifact files (kernels/...)
    runs_binaries: bool = False  # the runner takes those files as a third argument (Triton: cubins)

    def make_runner(self, plan: dict, weights: dict[str, torch.Tensor], files: dict[str, bytes]) -> Runner:
        return self.runner(plan, weights, files) if self.runs_binaries else self.runner(plan, weights)

    def pipeline(self, fuse: bool = True, quant: str | None = None) -> list[Pass]:
        passes = cleanup_passes() + (fusion_passes() if fuse else []) + quant_passes(quant)
        passes += prologue_passes() if fuse else []
        return passes + [Pass("decompose_unsupported", decompose_unsupported(set(self.kernels)))]


def _cpu() -> Target:
    from ..ir import OPS
    from .cpu import CpuExecutor, build_plan

    return Target("cpu", "this machine's CPU, torch kernels", frozenset(OPS), build_plan, CpuExecutor)


def _triton(arch: str) -> Callable[[], Target]:
    def make() -> Target:
        from ..ir import OPS
        from .triton import ARCH_DESCRIPTIONS, build_plan, compile_binaries
        from .triton.runner import TritonRunner

        # every op is allowed: those without an emitter run their torch reference on the device
        return Target(arch, ARCH_DESCRIPTIONS[arch], frozenset(OPS), lambda g: build_plan(g, arch), TritonRunner,
                      compile_binaries, runs_binaries=True)

    return make


def _ascend() -> Target:
    from ..ir import OPS
    from .ascendc import DESCRIPTION, build_plan
    from .ascendc.project import project_files
    from .ascendc.runner import EmulatorRunner

    # every op is allowed: those without an emitter run their reference (a host step)
    return Target("ascend950", DESCRIPTION, frozenset(OPS), build_plan, EmulatorRunner, project_files)


TARGETS: dict[str, Callable[[], Target]] = {"cpu": _cpu, "sm90": _triton("sm90"), "sm100": _triton("sm100"),
                                            "ascend950": _ascend}


def get_target(name: str) -> Target:
    if name not in TARGETS:
        raise DeepfuseError(f"unknown target {name!r} (available: {', '.join(sorted(TARGETS))})")
    return TARGETS[name]()
