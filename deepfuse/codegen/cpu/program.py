"""Native step programs: a bound step's calls (bound.py) as one native call.

A bound call that is one native kernel on fixed tensors is a NativeOp: callable from Python (the
call it stands for) and appendable to a StepProgram (program.cpp), which runs its ops in order
with no Python between them. A bound step's calls become segments: each run of NativeOps one
StepProgram, any other call (a reference op, a torch fallback) a Python call between them. A
decode step of the Llama-family builds (f32, bf16, int4, W8A8, int8 KV) is one segment.

Guards whose check is "every value of an int64 tensor below a limit" (NativeGuard) are checked
by the first program before it runs anything; run() then returns -1 and nothing has run.

A step's outputs (its logits, tokens and rows, which the caller keeps) are RunOutputs: each run
of the program allocates them anew, and ops name them in place of a tensor (program_op). A
NativeStop holds the run at its place unless its tensor passes its check (where the self-check
refused the native sampler: a row to sample with a temperature, a draft to verify): run() then
says how many launches ran, and the executor runs the rest from Python. Both exist only in
programs: a bound step binds them only with programs on.
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
    if name == "paged_decode":  # (..., amx_rows, batch_invariant)
        return NativeOp(call, name, *args[:-2], args[-2] if amx else 0, args[-1])
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


class RunOutput:
    """A tensor of this shape and dtype that each run of a step program allocates (a step output):
    bound calls name it where a tensor goes; Segments.run gives this run's tensor of each."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype):
        self.shape, self.dtype = tuple(shape), dtype


def _in_programs_only():
    raise RuntimeError("this bound call names a RunOutput: it runs only in a step program")


def program_op(name: str, *args) -> NativeOp:
    """The StepProgram method `name` on args, where some are RunOutputs (index_select_to,
    i8_gemm_to, copy_to, argmax_to): a call with no Python form."""
    return NativeOp(_in_programs_only, name, *args)


class NativeStop:
    """A bound call that holds a program's run at its place unless every value of t is below
    `below` (int64) or none is above `at_most` (f32). launch: the launch it stands before (set by
    StepBinder.bind); the executor runs that one and the rest from Python when it holds."""

    __slots__ = ("t", "below", "at_most", "launch")

    def __init__(self, t: torch.Tensor, below: int | None = None, at_most: float | None = None):
        if (below is None) == (at_most is None):
            raise ValueError("a NativeStop checks one of: below (int64), at_most (f32)")
        self.t, self.below, self.at_most, self.launch = t, below, at_most, -1

    def __call__(self):
        _in_programs_only()


class NativeGuard:
    """A guard (bound.py) that holds while every value of t (int64, contiguous) is below limit."""

    __slots__ = ("t", "limit")

    def __init__(self, t: torch.Tensor, limit: int):
        self.t, self.limit = t, limit

    def __call__(self) -> bool:
        return int(self.t.max()) < self.limit


class Segments:
    """A bound step's calls as native programs and the Python calls between them. run() returns
    -1, having run nothing, when a guard fails (see run)."""

    def __init__(self, calls: list[Callable[[], object]], guards: list[Callable[[], bool]], programs: bool = True):
        """programs=False: every call from Python, as bound calls ran before step programs
        (benchmarks compare the two)."""
        program_type = getattr(native_kernels(), "StepProgram", None) if programs else None
        self.parts: list = []  # StepProgram or a Python call
        self.python_guards = [g for g in guards if program_type is None or not isinstance(g, NativeGuard)]
        native_guards = [g for g in guards if g not in self.python_guards]
        self.stops: list[list[int]] = []  # per part: the launches its stops stand before, in order
        self.outputs: list[tuple[int, int, RunOutput]] = []  # (part, slot, output)
        self.names: list[list[str]] = []  # per part: its ops' names, in order (none for a Python call)
        slots: dict[int, tuple[int, int]] = {}  # id(RunOutput) -> (part, slot)
        if native_guards:  # checked by the first part, before anything runs
            self._start(program_type())
            for g in native_guards:
                self.parts[0].guard_below(g.t, g.limit)
        for call in calls:
            if program_type is not None and isinstance(call, (NativeOp, NativeStop)):
                if not self.parts or not isinstance(self.parts[-1], program_type):
                    self._start(program_type())
                program, part = self.parts[-1], len(self.parts) - 1
                if isinstance(call, NativeStop):
                    if call.launch < 0:
                        raise ValueError("a NativeStop needs the launch it stands before (StepBinder.bind sets it)")
                    if call.below is not None:
                        program.stop_unless_below(call.t, call.below)
                    else:
                        program.stop_unless_at_most(call.t, call.at_most)
                    self.stops[-1].append(call.launch)
                    continue
                args = []
                for a in call.args:
                    if isinstance(a, RunOutput):
                        if id(a) not in slots:
                            slots[id(a)] = (part, program.output(list(a.shape), a.dtype))
                            self.outputs.append((part, slots[id(a)][1], a))
                        if slots[id(a)][0] != part:
                            raise ValueError("a RunOutput is named by two step programs")
                        a = slots[id(a)][1]
                    args.append(a)
                getattr(program, call.name)(*args)
                self.names[-1].append(call.name)
                assert len(program) == len(self.names[-1]), f"{call.name} added more than one op"
            elif isinstance(call, NativeStop) or any(isinstance(a, RunOutput) for a in getattr(call, "args", ())):
                raise ValueError("a bound call with a stop or a RunOutput needs step programs")
            else:
                self._start(call)
        self.programs = sum(isinstance(p, program_type) for p in self.parts) if program_type else 0
        self.python_calls = len(self.parts) - self.programs

    def _start(self, part) -> None:
        """A new part (a StepProgram or a Python call), with no stops or op names yet."""
        self.parts.append(part)
        self.stops.append([])
        self.names.append([])

    def profile(self, on: bool) -> None:
        """on: every program times each of its ops from now on (op_seconds); off: stops and clears."""
        for part in self.parts:
            if hasattr(part, "op_ns"):
                part.profile(on)

    def op_seconds(self) -> tuple[int, list[tuple[str, float]]]:
        """-> (runs, timed): how many runs of the first program since profile(True), and (name, mean
        seconds per run of its program) of every program op in order (in a run a stop held, the ops
        after it count 0 s; a run in which an op raised is not counted)."""
        timed, counts = [], []
        for part, names in zip(self.parts, self.names):
            if hasattr(part, "op_ns"):
                ns, runs = part.op_ns()
                counts.append(runs)
                timed += [(name, t / 1e9 / max(runs, 1)) for name, t in zip(names, ns)]
        return (counts[0] if counts else 0), timed

    def run(self) -> tuple[int | None, dict[int, torch.Tensor]]:
        """-> (held, made): held is -1 when a guard failed (nothing ran), the launch a stop held
        the run before, or None (every call ran); made: id(RunOutput) -> this run's tensor."""
        made: dict[int, torch.Tensor] = {}
        if not all(check() for check in self.python_guards):
            return -1, made
        for i, (part, stops) in enumerate(zip(self.parts, self.stops)):
            if not hasattr(part, "run_step"):
                part()
                continue
            status, tensors = part.run_step()
            if status < 0:  # only the first part has guards: when one fails nothing has run
                return -1, made
            for p, slot, output in self.outputs:
                if p == i:
                    made[id(output)] = tensors[slot]
            if status < len(stops):
                return stops[status], made
        return None, made
