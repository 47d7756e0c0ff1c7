"""Building and running generated CPU kernels: render_cpp's source -> g++ -> a shared library
loaded with ctypes, cached under ~/.cache/deepfuse/generated/<hash>.so by a hash of the source,
the flags and this machine's build tag (a library built with -march=native is not reused on
another kind of CPU). One g++ call per distinct kernel (~0.3 s), written to a temporary name and
renamed into place, so concurrent builders never load a half-written library.

NativeKernel is the runtime side: `k(*inputs)` allocates the outputs and runs the entry;
`k.run(inputs, outs)` writes into given tensors; `k.bind(...)` prepares one call for bound steps.
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
from ...kernel.ir import Kernel
from .bound import Bound
from .generated import render_cpp
from .generated_phases import entry_name
from .native import build_tag, compiler_errors

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
    fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int)
    fn.restype = None
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
        self.in_dtypes = [DTYPES[b.dtype] for b in k.inputs]
        self.out_dtypes = [DTYPES[b.dtype] for b in k.outputs]
        dims = _dim_sources(k)
        rows = k.space[0]
        self.rows = dims[rows] if isinstance(rows, str) else rows
        self.out_dims = [[dims[d] if isinstance(d, str) else d for d in b.shape] for b in k.outputs]

    def inputs(self, xs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The inputs as the entry reads them: contiguous, of the buffers' dtypes (else DeepfuseError)."""
        out = []
        for x, dt, b in zip(xs, self.in_dtypes, self.kernel.inputs):
            if x.dtype != dt or x.device.type != "cpu":
                raise DeepfuseError(f"kernel {self.kernel.name}: input {b.name} wants a CPU {b.dtype} tensor, got {x.dtype}")
            out.append(x if x.is_contiguous() else x.contiguous())
        return out

    def row_count(self, xs: list[torch.Tensor]) -> int:
        return self.rows if isinstance(self.rows, int) else xs[self.rows[0]].shape[self.rows[1]]

    def run(self, xs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        """Runs the entry on contiguous inputs, writing contiguous outputs."""
        ins = (ctypes.c_void_p * len(xs))(*[x.data_ptr() for x in xs])
        res = (ctypes.c_void_p * len(outs))(*[o.data_ptr() for o in outs])
        self.fn(ins, res, self.row_count(xs), torch.get_num_threads())

    def __call__(self, *xs: torch.Tensor):
        xs = self.inputs(xs)
        outs = [torch.empty([d if isinstance(d, int) else xs[d[0]].shape[d[1]] for d in dims], dtype=dt)
                for dims, dt in zip(self.out_dims, self.out_dtypes)]
        self.run(xs, outs)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def into(self, *xs: torch.Tensor, out: list[torch.Tensor]) -> None:
        """Writes the outputs into `out` (planned buffers; a non-contiguous one gets a copy)."""
        xs = self.inputs(xs)
        direct = [o if o.is_contiguous() and o.dtype == dt else torch.empty(o.shape, dtype=dt)
                  for o, dt in zip(out, self.out_dtypes)]
        self.run(xs, direct)
        for o, d in zip(out, direct):
            if o is not d:
                o.copy_(d)

    def bind(self, *xs: torch.Tensor, out: list[torch.Tensor]) -> Bound:
        """One prepared call for these tensors (pointer arrays built once), else a repeat of into()."""
        if any(not x.is_contiguous() or x.dtype != dt for x, dt in zip(xs, self.in_dtypes)) or \
                any(not o.is_contiguous() or o.dtype != dt for o, dt in zip(out, self.out_dtypes)):
            return Bound([functools.partial(self.into, *xs, out=out)])
        ins = (ctypes.c_void_p * len(xs))(*[x.data_ptr() for x in xs])
        res = (ctypes.c_void_p * len(out))(*[o.data_ptr() for o in out])
        rows, fn, keep = self.row_count(list(xs)), self.fn, (xs, out)  # keep: the tensors live as long as the call
        return Bound([lambda: (fn(ins, res, rows, torch.get_num_threads()), keep)[0]])


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
