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
    from ..kernel.ir import Kernel, verify

    verify(Kernel.from_json(attrs["kernel"]))  # KernelError is a ValueError: the graph verifier names the node
    k = attrs["kernel"]
    ins = [b for b in k["buffers"] if b[3] == "in"]
    expect(len(ins) == len(types), f"kernel {k['name']} takes {len(ins)} inputs, got {len(types)}")
    for (name, dtype, shape, _), t in zip(ins, types):
        expect(t == TensorType(dtype, tuple(shape)), f"kernel {k['name']} input {name} wants {dtype}{shape}, got {t}")
    return [TensorType(dtype, tuple(shape)) for _, dtype, shape, role in k["buffers"] if role == "out"]


@register("kernel", _kernel_type)
def run_kernel(*xs: torch.Tensor, kernel: dict, ops: list[str] | None = None) -> tuple[torch.Tensor, ...] | torch.Tensor:
    """A generated kernel (attrs["kernel"]), run by the kernel IR's interpreter."""
    from ..kernel.interpret import run
    from ..kernel.ir import Kernel

    k = Kernel.from_json(kernel)
    outs = run(k, {b.name: x for b, x in zip(k.inputs, xs)})
    res = tuple(outs[b.name] for b in k.outputs)
    return res if len(res) > 1 else res[0]


def _epilogue_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    from .ops import OPS

    k = attrs["n_inner"]
    inner = OPS[attrs["inner"]].infer(types[:k], attrs["inner_attrs"])
    ins = [b for b in attrs["kernel"]["buffers"] if b[3] == "in"]
    extra = ins[:attrs["feeds"]] + ins[attrs["feeds"] + 1:]
    expect(len(inner) == 1, f"an epilogue follows an op with one output; {attrs['inner']} has {len(inner)}")
    fed = ins[attrs["feeds"]]
    expect(inner[0] == TensorType(fed[1], tuple(fed[2])), f"epilogue input {fed[0]} wants {fed[1]}{fed[2]}, "
           f"{attrs['inner']} gives {inner[0]}")
    return _checked_outputs(types[k:], extra, attrs["kernel"])


def _checked_outputs(types: list[TensorType], extra: list, kernel: dict) -> list[TensorType]:
    expect(len(extra) == len(types), f"epilogue of {kernel['name']} takes {len(extra)} more inputs, got {len(types)}")
    for (name, dtype, shape, _), t in zip(extra, types):
        expect(t == TensorType(dtype, tuple(shape)), f"epilogue input {name} wants {dtype}{shape}, got {t}")
    return [TensorType(dtype, tuple(shape)) for _, dtype, shape, role in kernel["buffers"] if role == "out"]


@register("with_epilogue", _epilogue_type)
def with_epilogue(*xs: torch.Tensor, inner: str, inner_attrs: dict, n_inner: int, kernel: dict, feeds: int,
                  ops: list[str] | None = None):
    """A template op (attrs inner, inner_attrs; its first n_inner inputs) whose result goes through a
    generated pointwise kernel (attrs kernel; the result is its input buffer `feeds`, the other
    inputs follow) in the same launch: the GEMM's epilogue (bias, activation, residual, scale)."""
    from .ops import OPS

    y = OPS[inner].reference(*xs[:n_inner], **inner_attrs)
    extra = list(xs[n_inner:])
    return run_kernel(*extra[:feeds], y, *extra[feeds:], kernel=kernel)
