"""The `kernel` op: a generated kernel (deepfuse/kernel) standing for a fused group of
primitive ops. attrs: "kernel", the kernel IR as JSON (Kernel.to_json); "ops", the graph ops it
replaced. Its reference runs the kernel IR's interpreter, which tests check against the graph
interpreter on the ops it replaced; each target renders the kernel IR into its own code.
"""
from __future__ import annotations

import torch

from .ops import expect, register
from .types import TensorType


def _kernel_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    k = attrs["kernel"]
    ins = [b for b in k["buffers"] if b[3] == "in"]
    expect(len(ins) == len(types), f"kernel {k['name']} takes {len(ins)} inputs, got {len(types)}")
    for (name, dtype, shape, _), t in zip(ins, types):
        expect(t == TensorType(dtype, tuple(shape)), f"kernel {k['name']} input {name} wants {dtype}{shape}, got {t}")
    return [TensorType(dtype, tuple(shape)) for _, dtype, shape, role in k["buffers"] if role == "out"]


@register("kernel", _kernel_type)
def kernel(*xs: torch.Tensor, kernel: dict, ops: list[str] | None = None) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """A generated kernel (attrs["kernel"]), run by the kernel IR's interpreter."""
    from ..kernel.interpret import run
    from ..kernel.ir import Kernel

    k = Kernel.from_json(kernel)
    outs = run(k, {b.name: x for b, x in zip(k.inputs, xs)})
    res = tuple(outs[b.name] for b in k.outputs)
    return res if len(res) > 1 else res[0]
