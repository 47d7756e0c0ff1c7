"""IR types: dtypes and (partly symbolic) tensor shapes.

A dimension is an int or a symbol name (str) such as "T" (tokens in the step) or
"S" (sequences in the step). Symbols are bound at run time.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "i32": torch.int32,
    "i64": torch.int64,
    "u8": torch.uint8,
    "i8": torch.int8,
    "bool": torch.bool,
}
TORCH_TO_DTYPE = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = ("f32", "bf16", "f16")

Dim = int | str


@dataclass(frozen=True)
class TensorType:
    """dtype: a key of DTYPES; shape: tuple of int or symbol names."""

    dtype: str
    shape: tuple[Dim, ...]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def with_shape(self, *shape: Dim) -> TensorType:
        return TensorType(self.dtype, tuple(shape))

    @staticmethod
    def of(t: torch.Tensor) -> TensorType:
        return TensorType(TORCH_TO_DTYPE[t.dtype], tuple(t.shape))

    def matches(self, t: torch.Tensor, bindings: dict[str, int]) -> bool:
        """True if tensor t fits this type; binds symbols in `bindings` as it goes."""
        if TORCH_TO_DTYPE.get(t.dtype) != self.dtype or t.dim() != self.rank:
            return False
        for want, got in zip(self.shape, t.shape):
            if isinstance(want, int):
                if want != got:
                    return False
            elif bindings.setdefault(want, got) != got:
                return False
        return True


_TYPE_RE = re.compile(r"^(\w+)\[([\w,]*)\]$")


def parse_type(text: str) -> TensorType:
    m = _TYPE_RE.match(text.strip())
    if not m:
        raise ValueError(f"bad type {text!r}")
    dims = tuple(int(d) if d.isdigit() else d for d in m.group(2).split(",") if d)
    return TensorType(m.group(1), dims)
