"""What the device targets (Triton, AscendC) add to the CPU plan's slot layout: per launch, the
shapes and dtypes their runners need to allocate outputs and scratch, and kernel names made from
the op and a hash of the emitted kernels, so the layers' identical kernels are one kernel.
"""
from __future__ import annotations

import hashlib
import json

from ..ir import Graph, Node
from .cpu.plan import build_plan as slot_plan

PLACEHOLDER = "DEEPFUSE_KERNEL_NAME"  # emitters name kernels with this; named() replaces it


def device_plan(g: Graph, arch: str) -> dict:
    """The slot plan with each launch's in_shape, out_dtype and node label."""
    plan = slot_plan(g)
    plan["arch"] = arch
    counter = 0
    for n, p in zip(g.nodes, plan["launches"]):
        p["in_shape"] = [list(v.type.shape) for v in n.inputs]
        p["out_dtype"] = [v.type.dtype for v in n.outputs]
        p["node"] = f"%{counter} ({n.op})"
        counter += len(n.outputs)
    return plan


def named(node: Node, kernels: list[dict]) -> list[dict]:
    """The kernels (JSON, named PLACEHOLDER...) with PLACEHOLDER replaced by op + hash; their order stays."""
    digest = hashlib.sha256(json.dumps(kernels, sort_keys=True).encode()).hexdigest()[:10]
    return json.loads(json.dumps(kernels).replace(PLACEHOLDER, f"{node.op}_{digest}"))
