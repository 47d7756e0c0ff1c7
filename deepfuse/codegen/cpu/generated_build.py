"""Building and running generated CPU kernels: render_cpp's source -> g++ -> a shared library
loaded with ctypes, cached under ~/.cache/deepfuse/generated/<hash>.so by a hash of the source,
the flags and this machine's build tag (a library built with -march=native is not reused on
another kind of CPU). One g++ call per distinct kernel (~0.3 s), written to a temporary name and
renamed into place, so concurrent builders never load a half-written library.

NativeKernel is the runtime side: `k(*inputs)` allocates the outputs and runs the entry;
`k.run(inputs, outs)` writes into given tensors; `k.bind(...)` prepares one call for bound steps.
Everything that does not depend on the tensors is worked out once per kernel, so a call is the
dtype/device/layout checks, the outputs' allocation, one int64 array of the data pointers and
one ctypes call (~3 us at one row); a bound call is the ctypes call on its prebuilt array (~0.2 us).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable

import torch

from ...errors import DeepfuseError
from ...ir import DTYPES
from ...kernel.interpret import run
from ...kernel.ir import Kernel, verify
from .bound import Bound
from .generated import PARALLEL_ELEMS, render_cpp
from .generated_phases import entry_name
from .native import build_tag, compiler_errors
from .program import NativeOp

FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC")


def compiler() -> str | None:
    """The C++ compiler generated kernels are built with (g++, else c++), or None."""
    return shutil.which("g++") or shutil.which("c++")


def cache_dir() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "generated")


def build(source: str) -> str:
    """The path of the shared library of this source, compiled now unless cached. Raises
    DeepfuseError without a compiler (naming the fix) or with the compiler's error lines."""
    cxx = compiler()
    if cxx is None:
        raise DeepfuseError("generated CPU kernels need a C++ compiler: install g++ (e.g. apt-get install g++)")
    key = hashlib.sha256("\0".join((source, cxx, *FLAGS, build_tag())).encode()).hexdigest()[:20]
    where = cache_dir()
    path = os.path.join(where, key + ".so")
    if os.path.exists(path):
        return path
    os.makedirs(where, exist_ok=True)
    tmp = os.path.join(where, f"{key}.{os.getpid()}.tmp")
    with open(tmp + ".cpp", "w") as f:
        f.write(source)
    try:
        done = subprocess.run([cxx, *FLAGS, tmp + ".cpp", "-o", tmp + ".so"], capture_output=True, text=True)
        if done.returncode != 0:
            raise DeepfuseError(f"g++ failed on a generated kernel: {compiler_errors(done.stderr)}")
        os.replace(tmp + ".so", path)
    finally:
        for leftover in (tmp + ".cpp", tmp + ".so"):
            if os.path.exists(leftover):
                os.remove(leftover)
    return path


@functools.cache
def entry(source: str, name: str) -> Callable:
    """The ctypes function `name` of source's library (built or loaded once per process)."""
    fn = getattr(ctypes.CDLL(build(source)), name)
    fn.restype = None  # no argtypes: its one argument is always an int64 array, passed by address
    return fn


def _dim_sources(k: Kernel) -> dict[str, tuple[int, int]]:
    """Each symbolic dim -> (input position, axis) of the first input that names it."""
    found: dict[str, tuple[int, int]] = {}
    for i, b in enumerate(k.inputs):
        for axis, d in enumerate(b.shape):
            if isinstance(d, str):
                found.setdefault(d, (i, axis))
    return found


class NativeKernel:
    """A Kernel compiled for this CPU: called like the `kernel` op (inputs in buffer order; one
    output, or a tuple of them)."""

    def __init__(self, k: Kernel):
        self.kernel = k
        self.fn = entry(render_cpp(k), entry_name(k))
        self.in_dtypes = tuple(DTYPES[b.dtype] for b in k.inputs)
        self.out_dtypes = tuple(DTYPES[b.dtype] for b in k.outputs)
        dims = _dim_sources(k)
        rows = k.space[0]
        self.rows = dims[rows] if isinstance(rows, str) else rows
        self.out_dims = [[dims[d] if isinstance(d, str) else d for d in b.shape] for b in k.outputs]
        self.like = [_same_as(k, b, dims) for b in k.outputs]
        self.per_row = k.space[1] * k.space[2]  # elements per row: rows * per_row decides OpenMP
        n = len(k.inputs) + len(k.outputs)
        self.threads_at = n + 1  # the args slot of the thread count
        self.args_type = type("Args", (ctypes.c_int64 * (n + 2),), {})  # instances can hold `keep`

    def inputs(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The inputs as the entry reads them: contiguous, of the buffers' dtypes (else DeepfuseError)."""
        if len(xs) != len(self.in_dtypes):
            raise DeepfuseError(f"kernel {self.kernel.name}: {len(self.in_dtypes)} inputs, got {len(xs)}")
        out = []
        for x, dt, b in zip(xs, self.in_dtypes, self.kernel.inputs):
            if x.dtype != dt or not x.is_cpu:
                raise DeepfuseError(f"kernel {self.kernel.name}: input {b.name} wants a CPU {b.dtype} tensor, got {x.dtype}")
            out.append(x if x.is_contiguous() else x.contiguous())
        return out

    def check_shapes(self, xs, outs=()) -> None:
        """DeepfuseError unless the tensors have the buffers' shapes (each symbol one size): the
        entry indexes by those shapes, so any other tensor would be read or written out of bounds."""
        sizes: dict[str, int] = {}
        for x, b in zip((*xs, *outs), (*self.kernel.inputs, *self.kernel.outputs)):
            ok = x.dim() == len(b.shape)
            for d, n in zip(b.shape, x.shape):
                ok = ok and (d == n if isinstance(d, int) else sizes.setdefault(d, n) == n)
            if not ok:
                raise DeepfuseError(f"kernel {self.kernel.name}: {b.name} wants shape {list(b.shape)} "
                                    f"(symbols so far {sizes}), got {list(x.shape)}")

    def ready(self, xs, dtypes) -> bool:
        """Whether xs are CPU tensors of these dtypes, contiguous (what the entry reads as is)."""
        return len(xs) == len(dtypes) and all(x.dtype == dt and x.is_cpu and x.is_contiguous() for x, dt in zip(xs, dtypes))

    def row_count(self, xs) -> int:
        return self.rows if isinstance(self.rows, int) else xs[self.rows[0]].shape[self.rows[1]]

    def pack(self, xs, outs, rows: int):
        """The entry's argument array: data pointers, row count, thread count."""
        return self.args_type(*[x.data_ptr() for x in xs], *[o.data_ptr() for o in outs], rows, torch.get_num_threads())

    def run(self, xs, outs) -> None:
        """Runs the entry on contiguous inputs, writing contiguous outputs."""
        self.fn(self.pack(xs, outs, self.row_count(xs)))

    def __call__(self, *xs: torch.Tensor):
        if not self.ready(xs, self.in_dtypes):
            xs = self.inputs(xs)
        self.check_shapes(xs)
        outs = [torch.empty_like(xs[like]) if like is not None else
                torch.empty([d if isinstance(d, int) else xs[d[0]].shape[d[1]] for d in dims], dtype=dt)
                for like, dims, dt in zip(self.like, self.out_dims, self.out_dtypes)]
        self.fn(self.pack(xs, outs, self.row_count(xs)))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def into(self, *xs: torch.Tensor, out: list[torch.Tensor]) -> None:
        """Writes the outputs into `out` (planned buffers; a non-contiguous one gets a copy)."""
        if not self.ready(xs, self.in_dtypes):
            xs = self.inputs(xs)
        self.check_shapes(xs, out)
        if self.ready(out, self.out_dtypes):
            self.fn(self.pack(xs, out, self.row_count(xs)))
            return
        direct = [o if o.is_contiguous() and o.dtype == dt else torch.empty(o.shape, dtype=dt)
                  for o, dt in zip(out, self.out_dtypes)]
        self.run(xs, direct)
        for o, d in zip(out, direct):
            if o is not d:
                o.copy_(d)

    def bind(self, *xs: torch.Tensor, out: list[torch.Tensor]) -> Bound:
        """One prepared call for these tensors: the entry on an argument array built once (the
        thread count refreshed per call where the rows run on OpenMP), else a repeat of into()."""
        if not (self.ready(xs, self.in_dtypes) and self.ready(out, self.out_dtypes)):
            return Bound([functools.partial(self.into, *xs, out=out)])
        self.check_shapes(xs, out)  # once: a bound call runs on these very tensors
        rows = self.row_count(xs)
        args = self.pack(xs, out, rows)
        args.keep = (xs, out)  # the tensors live as long as the call
        entry = ctypes.cast(self.fn, ctypes.c_void_p).value
        if rows * self.per_row < PARALLEL_ELEMS:  # runs in this thread whatever the thread count
            return Bound([NativeOp(functools.partial(self.fn, args), "generated", entry, ctypes.addressof(args), -1)])
        fn, at = self.fn, self.threads_at

        def call() -> None:
            args[at] = torch.get_num_threads()
            fn(args)
        return Bound([NativeOp(call, "generated", entry, ctypes.addressof(args), at)])


def _same_as(k: Kernel, out, dims: dict[str, tuple[int, int]]) -> int | None:
    """The input an output can be allocated like (torch.empty_like): one of the same dtype whose
    shape is the output's, dim for dim (symbols by name); else None."""
    for i, b in enumerate(k.inputs):
        if b.dtype == out.dtype and tuple(b.shape) == tuple(out.shape) and \
                all(not isinstance(d, str) or dims[d][0] == i for d in out.shape):
            return i
    return None


@functools.cache
def warn_no_compiler() -> None:
    """Says once per process that generated kernels run on the kernel IR's interpreter."""
    warnings.warn("deepfuse: no C++ compiler (install g++): generated kernels run on the kernel IR's torch "
                  "interpreter, much slower", stacklevel=3)


def interpreted(k: Kernel) -> Callable:
    """k run by deepfuse.kernel.interpret (the fallback without a compiler)."""
    def call(*xs: torch.Tensor):
        outs = run(k, {b.name: x for b, x in zip(k.inputs, xs)})
        res = tuple(outs[b.name] for b in k.outputs)
        return res if len(res) > 1 else res[0]
    return call


def make_generated(attrs: dict, into: bool = False) -> Callable:
    """The CPU kernel of a `kernel` node: compiled (NativeKernel), or the interpreter with a
    one-time warning where there is no compiler. into: the out-kernel form, kernel(*xs, out=[...])."""
    k = Kernel.from_json(attrs["kernel"])
    verify(k)  # an artifact's kernel IR: checked (buffers' bounds included) before it becomes code
    if compiler() is None:
        warn_no_compiler()
        fn = interpreted(k)
        if not into:
            return fn

        def write(*xs: torch.Tensor, out: list[torch.Tensor]) -> None:
            res = fn(*xs)
            for o, r in zip(out, res if isinstance(res, tuple) else (res,)):
                o.copy_(r)
        return write
    nk = NativeKernel(k)
    if not into:
        return nk

    def write_native(*xs: torch.Tensor, out: list[torch.Tensor]) -> None:
        nk.into(*xs, out=out)
    write_native.bind = nk.bind
    return write_native
