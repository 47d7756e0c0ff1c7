"""Native step programs: a bound step's calls (bound.py) as one native call.

A bound call that is one native kernel on fixed tensors is a NativeOp: callable from Python (the
call it stands for) and appendable to a StepProgram (program.cpp), which runs its ops in order
with no Python between them. A bound step's calls become segments: each run of NativeOps one
StepProgram, any other call (a reference op, a torch fallback) a Python call between them. A
decode step of the Llama-family builds (f32, bf16, int4, W8A8, int8 KV) is one segment.

Guards whose check is "every value of an int64 tensor below a limit" (NativeGuard) are checked
by the first program before it runs anything; run() then returns False and nothing has run.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from .native import kernels as native_kernels


class NativeOp:
    """call(): the Python form (runs the kernel now); name, args: the StepProgram method that
    appends the same kernel on the same arguments."""

    __slots__ = ("call", "name", "args")

    def __init__(self, call: Callable[[], object], name: str, *args):
        self.call, self.name, self.args = call, name, args

    def __call__(self):
        return self.call()


def native_op(native, name: str, *args) -> NativeOp:
    """The native module's entry `name` on args, as a NativeOp (the program form takes the same
    arguments, with the AMX switch of the four entries that have one made explicit)."""
    call = partial(getattr(native, name), *args)
    amx = "amx" not in getattr(native, "refused", ())
    if name in ("bf16_gemm", "q4_gemm"):
        return NativeOp(call, name, *args, amx)
    if name == "paged_decode":
        return NativeOp(call, name, *args[:-1], args[-1] if amx else 0)
    return NativeOp(call, name, *args)


def aten_op(name: str, *args) -> NativeOp:
    """An ATen op that StepProgram runs natively: int4_mm (torch's int4 GEMM into out), mm
    (x @ w^T into out), index_select (rows of a table into out), add (a + b into out)."""
    if name == "int4_mm":
        x, w, group, scale_zero, out = args
        call = lambda: out.copy_(torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group, scale_zero))
    elif name == "mm":
        x, w, out = args
        call = partial(torch.mm, x, w.t(), out=out)
    elif name == "index_select":
        table, ids, out = args
        call = partial(torch.index_select, table, 0, ids, out=out)
    elif name == "add":
        a, b, out = args
        call = partial(torch.add, a, b, out=out)
    else:
        raise ValueError(f"no ATen op {name!r} in StepProgram")
    return NativeOp(call, name, *args)


class NativeGuard:
    """A guard (bound.py) that holds while every value of t (int64, contiguous) is below limit."""

    __slots__ = ("t", "limit")

    def __init__(self, t: torch.Tensor, limit: int):
        self.t, self.limit = t, limit

    def __call__(self) -> bool:
        return int(self.t.max()) < self.limit


class Segments:
    """A bound step's calls as native programs and the Python calls between them. run() returns
    False, having run nothing, when a guard fails."""

    def __init__(self, calls: list[Callable[[], object]], guards: list[Callable[[], bool]], programs: bool = True):
        """programs=False: every call from Python, as bound calls ran before step programs
        (benchmarks compare the two)."""
        program_type = getattr(native_kernels(), "StepProgram", None) if programs else None
        self.parts: list = []  # StepProgram or a Python call
        self.python_guards = [g for g in guards if program_type is None or not isinstance(g, NativeGuard)]
        native_guards = [g for g in guards if g not in self.python_guards]
        for call in calls:
            if program_type is not None and isinstance(call, NativeOp):
                if not self.parts or not isinstance(self.parts[-1], program_type):
                    self.parts.append(program_type())
                getattr(self.parts[-1], call.name)(*call.args)
            else:
                self.parts.append(call)
        if native_guards:
            if not self.parts or not isinstance(self.parts[0], program_type):
                self.parts.insert(0, program_type())
            for g in native_guards:
                self.parts[0].guard_below(g.t, g.limit)
        self.programs = sum(isinstance(p, program_type) for p in self.parts) if program_type else 0
        self.python_calls = len(self.parts) - self.programs

    def run(self) -> bool:
        if not all(check() for check in self.python_guards):
            return False
        for part in self.parts:
            if not hasattr(part, "run"):
                part()
            elif not part.run():  # only the first part has guards: when one fails nothing has run
                return False
        return True
