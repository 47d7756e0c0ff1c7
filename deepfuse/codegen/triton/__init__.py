"""The Triton targets, sm90 (Hopper) and sm100 (Blackwell): fused graph -> emitted kernels ->
PTX and cubins compiled here, on a machine with no GPU (see aot.py).

The plan is the CPU plan's slot layout plus, per launch, the kernel specs emit.py made for
its node (none: the op's torch reference runs on the device) and the dtypes and symbolic
shapes the runner needs to allocate outputs and scratch.
"""
from __future__ import annotations

from ...ir import Graph
from ..device_plan import PLACEHOLDER, device_plan, named
from .emit import EMITTERS, INVARIANT_AWARE, emittable

ARCH_DESCRIPTIONS = {"sm90": "NVIDIA Hopper (sm_90a), Triton kernels", "sm100": "NVIDIA Blackwell (sm_100a), Triton kernels"}


def build_plan(g: Graph, arch: str, batch_invariant: bool = False) -> dict:
    """arch: "sm90", "sm100", or "interpret" (small tiles, for Triton's CPU interpreter).
    batch_invariant: one kernel form per op at every batch shape (emit.INVARIANT_AWARE), so a
    row's result never depends on what else its step holds or how its prompt was chunked."""
    plan = device_plan(g, arch)
    for n, p in zip(g.nodes, plan["launches"]):
        if not emittable(n):
            continue
        invariant = {"invariant": True} if batch_invariant and n.op in INVARIANT_AWARE else {}
        p["kernels"] = named(n, EMITTERS[n.op](n, PLACEHOLDER, arch, **invariant))
        tmps = [t for spec in p["kernels"] for t in spec.pop("scratch", [])]
        if tmps:  # each kernel's scratch, in kernel order: ["tmp", j] is the j-th
            p["tmps"] = tmps
    return plan


def compile_binaries(plan: dict) -> dict[str, bytes]:
    """kernels/<name>.{py,ptx,cubin,json} for every emitted kernel of the plan."""
    from .aot import compile_all

    specs: dict[str, tuple[dict, str]] = {}
    for p in plan["launches"]:
        for spec in p.get("kernels", []):
            specs.setdefault(spec["name"], (spec, p["node"]))
    files = compile_all(list(specs.values()), plan["arch"])
    return {f"kernels/{name}": data for name, data in sorted(files.items())}



__all__ = ["ARCH_DESCRIPTIONS", "build_plan", "compile_binaries"]
