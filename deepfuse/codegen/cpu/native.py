"""Native CPU kernels: C++ next to this file, compiled with g++ on first use through
torch.utils.cpp_extension (cached under ~/.cache/deepfuse/native/, so later processes load
the built library in well under a second). Once per process every entry point then checks itself
on this machine against an independent reference on small data (selfcheck.py, ~0.1 s); one that
disagrees is refused: its group's availability flag reads False (a failing AMX path: amx_available,
and the vector paths run), and a failing always-used one refuses the whole library. A machine
without a working compiler, or whose library the check refuses, gets None and the torch-op path,
with a warning; `build_error` says why."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Callable


def build_tag() -> str:
    """A short tag of this CPU's instruction set and this torch install: the library is built
    with -march=native against one torch's headers, so a home directory shared with another
    kind of machine or another environment must not reuse (or rebuild over) it."""
    import torch

    flags = platform.machine() + torch.__version__ + os.path.dirname(torch.__file__)
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:8]


SOURCES = ("paged_decode.cpp", "decode_amx.cpp", "prefill_attention.cpp", "panel_gemm.cpp", "bf16_gemm.cpp",
           "vec_gemm.cpp", "i8_gemm.cpp", "q4a8_gemm.cpp", "norms.cpp", "rows.cpp", "sample.cpp", "program.cpp", "bindings.cpp")
HEADERS = ("kernels.h", "vec.h", "amx.h", "q4.h", "row_ops.h", "prologue_rows.h", "balanced.h", "team.h")


@functools.cache
def source_hash() -> str:
    """A hash of the kernels' sources and headers (torch rebuilds on a changed source file or
    flag, not on a changed header: the hash goes into the flags)."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        with open(os.path.join(os.path.dirname(__file__), name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


build_error: str | None = None  # why kernels() is None: the build's exception, or the self-check's refusal


def compiler_errors(text: str) -> str:
    """The compiler's own error lines of a failed build's log (its first five), else the log's first line."""
    errors = [ln.strip() for ln in text.splitlines() if ": error:" in ln or ": fatal error:" in ln]
    return " | ".join(errors[:5]) if errors else text.splitlines()[0] if text else text


@functools.cache
def kernels():
    """The native kernels (paged_decode, paged_prefill; pack_panels, panel_gemm; amx_available,
    bf16_gemm_available, pack_vnni, bf16_gemm, q4_gemm; i8_gemm_available, pack_w8, i8_gemm,
    i8_gemm_swiglu, i8_gemm_norm; q4a8_gemm_available, q4a8_gemm, q4a8_gemm_swiglu, q4a8_gemm_norm;
    rms_norm, add_rms_norm; swiglu, rope_cache, argmax; sample_available, sample; see the .cpp files) as the self-check leaves
    them (CheckedKernels: the module's attributes, refused groups' flags False, the report in
    .selfcheck), or None where they cannot be built or an always-used one failed its check.
    Loaded and checked once per process."""
    global build_error
    module = build()
    if module is None:
        return None
    from .selfcheck import check

    checked = check(module)
    if checked is None:
        build_error = "the self-check refused the native kernels: " + ", ".join(
            name for name, (_, _, ok) in selfcheck_report().items() if not ok)
    return checked


def selfcheck_report() -> dict[str, tuple[float, float, bool]]:
    """The latest self-check: entry point -> (max error, tolerance, ok), both relative to the output's scale."""
    from .selfcheck import last_report

    return last_report()


@functools.cache
def build():
    """The extension module itself, unchecked, or None where it cannot be built (the exception's
    text in build_error). Built once per machine and torch install under
    ~/.cache/deepfuse/native/ (one to three minutes on 2 cores; a line on stderr says so)."""
    global build_error
    from torch.utils.cpp_extension import load

    here = os.path.dirname(__file__)
    # one directory per machine kind, torch install and source version: checkouts of different
    # versions sharing a home directory never rebuild over one another
    name = f"deepfuse_native_{build_tag()}_{source_hash()}"
    where = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "native", name)
    os.makedirs(where, exist_ok=True)
    stamp = os.path.join(where, "sources.hash")  # the sources the library there was built from
    built = open(stamp).read() if os.path.exists(stamp) else ""
    if built != source_hash() or not os.path.exists(os.path.join(where, name + ".so")):
        print("deepfuse: building the native CPU kernels (once per machine and version, one to three minutes)",
              file=sys.stderr, flush=True)
    try:
        with _build_lock(where):
            module = load(name=name, sources=[os.path.join(here, s) for s in SOURCES], build_directory=where,
                          extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DDEEPFUSE_SOURCES={source_hash()}"],
                          extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no g++, no Python headers, ...: the torch-op path still works
        build_error = compiler_errors(f"{type(e).__name__}: {e}")
        warnings.warn(f"deepfuse: the native CPU kernels could not be built ({build_error}); attention, "
                      f"projections, norms and row ops use torch ops instead", stacklevel=3)
        return None
    with open(stamp, "w") as f:
        f.write(source_hash())
    return module


@contextlib.contextmanager
def _build_lock(where: str):
    """Holds an exclusive lock on the build directory for one process at a time. The kernel
    releases it when its holder ends, however it ends; so, holding it, a `lock` file that torch's
    own build baton left behind belongs to a build that was killed midway, and is removed (torch
    would otherwise wait on it forever)."""
    import fcntl

    with open(os.path.join(where, "build.flock"), "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = os.path.join(where, "lock")
        if os.path.exists(stale):
            os.remove(stale)
        yield


FLAGS = {"bf16_gemm": "bf16_gemm_available", "amx": "amx_available", "i8_gemm": "i8_gemm_available",
         "q4a8_gemm": "q4a8_gemm_available", "sample": "sample_available",
         "paged_prefill": "paged_prefill_available"}  # a group of entry points the check may refuse -> its flag


class CheckedKernels:
    """The native module as its self-check leaves it: every attribute is the module's, except the
    flags of refused groups, which read False, and, with AMX refused, the four entry points that
    take an amx switch, which run their vector paths. `selfcheck`: the report, name -> (error,
    tolerance, ok); `refused`: the refused groups."""

    def __init__(self, module, report: dict[str, tuple[str, float, float, bool]]):
        """report: entry point -> (group, error, tolerance, ok), as selfcheck.check makes it."""
        self.module = module
        self.refused = frozenset(group for group, _, _, ok in report.values() if not ok)
        self.selfcheck = {name: (error, tol, ok) for name, (_, error, tol, ok) in report.items()}
        for name in dir(module):  # plain instance attributes: no __getattr__ on the hot path
            if not name.startswith("_"):
                self.__dict__[name] = getattr(module, name)
        for group in self.refused:
            self.__dict__[FLAGS[group]] = _no
        if "amx" in self.refused:
            self.__dict__.update(_vector_only(module))

    def __getattr__(self, name: str):
        if "module" not in self.__dict__:  # not initialised (copy, pickle): nothing to delegate to
            raise AttributeError(name)
        return getattr(self.__dict__["module"], name)

    def __repr__(self) -> str:
        return f"<CheckedKernels of {self.module!r}, refused: {sorted(self.refused) or 'none'}>"


def _no() -> bool:
    return False


def _vector_only(m) -> dict[str, Callable]:
    """The entry points with an AMX switch, bound to their vector paths (same signatures)."""

    def bf16_gemm(x, panels, n, out=None, amx=True):
        return m.bf16_gemm(x, panels, n, out, False)

    def q4_gemm(x, nibbles, scales, mins, n, out=None, amx=True):
        return m.q4_gemm(x, nibbles, scales, mins, n, out, False)

    def paged_prefill(q, cache, tables, rows, qlens, lens, num_heads, window, scale, out, amx=True):
        return m.paged_prefill(q, cache, tables, rows, qlens, lens, num_heads, window, scale, out, False)

    def paged_decode(q, cache, tables, lens, num_heads, window, scale, out, amx_rows=2, batch_invariant=False):
        return m.paged_decode(q, cache, tables, lens, num_heads, window, scale, out, 0, batch_invariant)

    return {"bf16_gemm": bf16_gemm, "q4_gemm": q4_gemm, "paged_prefill": paged_prefill, "paged_decode": paged_decode}


def fingerprint() -> str:
    """Names the step code this machine runs: the kernels' sources and build tag, whether they
    built and passed their self-check, and which groups it refused (keys caches of measured step
    times, runtime/engine.py)."""
    h = hashlib.sha256((build_tag() + source_hash()).encode())
    native = kernels()
    if native is None:
        return h.hexdigest()[:12] + "-none"
    return h.hexdigest()[:12] + "".join(f"-no-{group}" for group in sorted(native.refused))
