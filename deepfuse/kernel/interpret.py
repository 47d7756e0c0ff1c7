"""The kernel IR's reference: runs a Kernel with torch on CPU tensors.

Elem values are [R, G, C] tensors, row values [R, G, 1]; every float value is f32 (round and
cast do what the renderers must: round to nearest even). This is what the renderers' kernels
are checked against, and it is checked against the graph interpreter (tests/kernel).
"""
from __future__ import annotations

import torch

from ..ir.types import DTYPES
from .ir import Index, Kernel

UNARY_FNS = {"neg": torch.neg, "abs": torch.abs, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
             "rsqrt": torch.rsqrt, "tanh": torch.tanh, "erf": torch.erf, "sigmoid": torch.sigmoid,
             "recip": torch.reciprocal}
BINARY_FNS = {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div, "max": torch.maximum,
              "min": torch.minimum, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
              "ne": torch.ne}


def bind_space(k: Kernel, tensors: dict[str, torch.Tensor]) -> tuple[int, int, int]:
    """The index space's sizes for these input tensors (the row symbol bound from the first
    input whose shape names it)."""
    r, g, c = k.space
    if isinstance(r, str):
        for b in k.inputs:
            for d, n in zip(b.shape, tensors[b.name].shape):
                if d == r:
                    return n, g, c
        raise ValueError(f"{k.name}: no input binds the row count {r!r}")
    return r, g, c


def output_shapes(k: Kernel, tensors: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Each output buffer's concrete shape for these inputs."""
    env: dict[str, int] = {}
    for b in k.inputs:
        for d, n in zip(b.shape, tensors[b.name].shape):
            if isinstance(d, str):
                env.setdefault(d, n)
    return {b.name: [env[d] if isinstance(d, str) else d for d in b.shape] for b in k.outputs}


def _flat_index(ix: Index, rgc: tuple[int, int, int], device) -> torch.Tensor:
    r, g, c = rgc
    rr = torch.arange(r, device=device).view(r, 1, 1)
    gg = torch.arange(g, device=device).view(1, g, 1)
    if ix.kind == "row":
        return rr * ix.row + gg * ix.group + ix.offset
    cc = torch.arange(c, device=device).view(1, 1, c)
    return rr * ix.row + gg * ix.group + cc * ix.col + ix.offset


def run(k: Kernel, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Runs k on its input tensors (by buffer name); returns its outputs by name."""
    rgc = bind_space(k, tensors)
    shapes = output_shapes(k, tensors)
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    outs = {b.name: torch.zeros(shapes[b.name], dtype=DTYPES[b.dtype], device=device) for b in k.outputs}
    env: dict[int, torch.Tensor] = {}
    for ins in k.body:
        a = [env[x] for x in ins.args]
        if ins.op == "load":
            flat = tensors[ins.attrs["buf"]].contiguous().reshape(-1)
            v = flat[_flat_index(ins.attrs["index"], rgc, device)]
        elif ins.op == "store":
            ix = _flat_index(ins.attrs["index"], rgc, device)
            val = a[0].expand(ix.shape) if a[0].shape != ix.shape else a[0]
            outs[ins.attrs["buf"]].view(-1)[ix.reshape(-1)] = val.reshape(-1)
            continue
        elif ins.op == "const":
            v = torch.tensor(ins.attrs["value"], dtype=DTYPES[ins.dtype], device=device).view(1, 1, 1)
        elif ins.op == "col":
            v = torch.arange(rgc[2], dtype=torch.int32, device=device).view(1, 1, -1)
        elif ins.op in UNARY_FNS:
            v = UNARY_FNS[ins.op](a[0])
        elif ins.op in BINARY_FNS:
            v = BINARY_FNS[ins.op](a[0], a[1])
        elif ins.op == "where":
            v = torch.where(a[0], a[1], a[2])
        elif ins.op == "cast":
            v = a[0].to(DTYPES[ins.attrs["to"]])
        elif ins.op == "round":
            v = a[0].to(DTYPES[ins.attrs["to"]]).float()
        elif ins.op == "reduce":
            x = a[0].expand(rgc)
            kind = ins.attrs["kind"]
            if kind == "argmax":
                v = torch.argmax(x, dim=-1, keepdim=True).to(torch.int32)  # torch: the first maximum
            else:
                v = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}[kind](x, dim=-1, keepdim=True)
        else:
            raise ValueError(f"{k.name}: unknown op {ins.op!r}")
        env[ins.out] = v
    return outs
