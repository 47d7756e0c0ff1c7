"""Bound steps: a step's launches as prepared calls, repeated while the step's tensors stay put.

A decode step runs ~150 launches, and their Python (the executor's loop, each kernel's checks and
argument plumbing, run with caches a GEMM has just swept) cost 1.5-4 ms of a ~50 ms step
(SmolLM2-135M, W8A8, 64 sequences, 2 cores; ~1 ms of a ~7.5 ms step at batch 1) while the
other thread idled. The engine's step inputs
live in preallocated buffers (runtime/batch.py), so consecutive decode steps hand the executor
tensors with the same storage, shapes and strides, only new contents. For such a layout the
executor binds its launches once, each to a list of calls with every argument resolved
(functools.partial of a native kernel where one runs it), and later steps with the same layout
run just those calls.

The protocol: an out-kernel (out_kernels.py) has `bind(*ins, out=views) -> Bound | None`. Bound
calls must do what the kernel's own call does for any contents of those tensors; a kernel whose
Python decides on tensor contents (attention: which rows decode) binds only where that decision
follows from the shapes, and returns None elsewhere. A guard is checked once per step before the
calls run again (rope tables: the step's positions must lie inside the bound ones).

A launch whose outputs have no planned buffer (the step's outputs: logits, sampled tokens, rows)
binds, with step programs on, through `bind_new(*ins) -> (Bound, outputs) | None`: its outputs are
RunOutputs that each run allocates, and its calls may begin with a NativeStop, which holds the
run there unless the step's contents allow the bound calls (where the self-check refused the
native sampler: every row greedy, no drafts).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from .native import kernels as native_kernels
from .program import NativeStop, RunOutput, Segments


@dataclass
class Bound:
    """calls: run in order, they do what the kernel's call did. guards: each must return True
    before the calls run again; launches that share a guard share its key (checked once)."""

    calls: list[Callable[[], object]]
    guards: dict[object, Callable[[], bool]] = field(default_factory=dict)

    @staticmethod
    def of(call: Callable[[], object] | None) -> Bound | None:
        """One call (None: nothing bound)."""
        return None if call is None else Bound([call])

    def then(self, other: Bound | None) -> Bound | None:
        """This, then other (None if other is None)."""
        if other is None:
            return None
        return Bound(self.calls + other.calls, {**self.guards, **other.guards})


def bind_as_is(kernel: Callable) -> Callable:
    """Gives an out-kernel whose Python depends only on its inputs' shapes, dtypes and strides
    the bind that repeats its own call with these tensors; returns the kernel."""
    kernel.bind = lambda *ins, out: Bound([partial(kernel, *ins, out=out)])
    return kernel


def layout_key(tensors: list[torch.Tensor]) -> tuple | bytes:
    """What a binding depends on in the step inputs: where each tensor's memory is and how it
    is laid out (the bound calls hold the tensors, so an address cannot be reused meanwhile).
    The native kernels' one call where they are built (~170 Python calls fewer for a step's 42 inputs)."""
    native = native_kernels()
    if native is not None and hasattr(native, "layout_key"):
        return native.layout_key(tensors)
    return tuple((t.data_ptr(), t.dtype, *t.shape, *t.stride()) for t in tensors)


@dataclass
class BoundPrefix:
    """The first `count` of `launches`, bound. env: the executor's slots after them (the
    outputs are planned buffer views, or RunOutputs for the step's outputs). segments: the calls
    as native programs with any Python calls between them (program.py); see run()."""

    launches: list
    count: int
    calls: list[Callable[[], object]]
    guards: list[Callable[[], bool]]
    env: list
    programs: bool = True  # the calls as native programs where they are NativeOps (else each from Python)

    def __post_init__(self):
        self.segments = Segments(self.calls, self.guards, self.programs)
        self.new_slots = [(s, t) for s, t in enumerate(self.env) if isinstance(t, RunOutput)]

    def run(self, want: list[int] | None = None) -> tuple[int, list]:
        """Runs the bound calls -> (done, env): done is how many launches ran (count, or fewer
        where a stop held the run; -1: a guard failed and nothing ran); env: the slots after
        them, this run's tensors in place of RunOutputs (a fresh list; None when a guard failed).
        want: slots whose tensors alone are wanted where every call runs; env is then those
        tensors, in want's order (a copy of every slot, and its release, cost ~30 us a decode
        step where the step's weights had swept the caches)."""
        held, made = self.segments.run()
        if held == -1:
            return -1, None
        if held is None and want is not None:
            return self.count, [made.get(id(self.env[s]), self.env[s]) for s in want]
        env = list(self.env)
        for s, t in self.new_slots:
            if id(t) in made:
                env[s] = made[id(t)]
        return self.count if held is None else held, env


class StepBinder:
    """Bound prefixes of an executor's launches by layout key, the last few kept (decode steps
    keep one layout until the longest sequence needs another block; prefill steps each bring
    their own)."""

    KEEP = 4

    def __init__(self, programs: bool = True):
        """programs: run bound calls as native step programs (program.py); False: each from Python."""
        self.cache: dict[tuple, BoundPrefix] = {}
        self.programs = programs

    def get(self, key: tuple, launches: list, env: list, views: list, fresh: bool = False) -> BoundPrefix:
        """The prefix of launches ((kernel, input slots, output slots, frees) each) for this
        layout: the one bound before (unless fresh: its guards failed), else bound now from env
        (the slots with this step's inputs) and views (the launches' planned outputs, the same
        memory for the same key). Its count is 0 where the first launch does not bind."""
        prefix = self.cached(key, launches)
        if prefix is not None and not fresh:
            return prefix
        prefix = self.bind(launches, env, views, self.programs)
        self.cache.pop(key, None)
        if len(self.cache) >= self.KEEP:
            self.cache.pop(next(iter(self.cache)))
        self.cache[key] = prefix
        return prefix

    def cached(self, key: tuple, launches: list) -> BoundPrefix | None:
        """The prefix bound before for this layout of these launches, if any."""
        prefix = self.cache.get(key)
        return prefix if prefix is not None and prefix.launches is launches else None

    @staticmethod
    def bind(launches: list, env: list, views: list, programs: bool = True) -> BoundPrefix:
        env = list(env)
        programs = programs and hasattr(native_kernels(), "StepProgram")
        calls: list[Callable[[], object]] = []
        guards: dict[object, Callable[[], bool]] = {}
        count = 0
        for (kernel, ins, outs, _), out in zip(launches, views):
            bind, bind_new = getattr(kernel, "bind", None), getattr(kernel, "bind_new", None)
            if out is not None:  # (a planned kernel's bind takes tensors: none of a run's outputs)
                bound = bind(*[env[i] for i in ins], out=out) \
                    if bind is not None and not any(isinstance(env[i], RunOutput) for i in ins) else None
            else:  # a step output: allocated by each run of a step program
                made = bind_new(*[env[i] for i in ins]) if programs and bind_new is not None else None
                bound, out = made if made is not None else (None, None)
            if bound is None:
                break
            for call in bound.calls:
                if isinstance(call, NativeStop):
                    call.launch = count
            calls += bound.calls
            guards.update(bound.guards)
            for s, t in zip(outs, out):
                env[s] = t
            count += 1
        return BoundPrefix(launches, count, calls, list(guards.values()), env, programs)
