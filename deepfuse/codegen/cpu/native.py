"""Native CPU kernels: C++ next to this file, compiled with g++ on first use through
torch.utils.cpp_extension (cached under ~/.cache/deepfuse/native/, so later processes load
the built library in well under a second). A machine without a working compiler gets None
and the torch-op path, with one warning."""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings


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
           "vec_gemm.cpp", "i8_gemm.cpp", "norms.cpp", "rows.cpp", "bindings.cpp")
HEADERS = ("vec.h", "amx.h", "q4.h", "row_ops.h", "balanced.h")


@functools.cache
def source_hash() -> str:
    """A hash of the kernels' sources and headers (torch rebuilds on a changed source file or
    flag, not on a changed header: the hash goes into the flags)."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        with open(os.path.join(os.path.dirname(__file__), name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:12]


@functools.cache
def kernels():
    """The native kernels' extension module (paged_decode, paged_prefill; pack_panels, panel_gemm;
    amx_available, bf16_gemm_available, pack_vnni, bf16_gemm, q4_gemm;
    i8_gemm_available, pack_w8, i8_gemm; rms_norm, add_rms_norm; swiglu, rope_cache, argmax;
    see the .cpp files), or None
    where it cannot be built. Built once per machine and torch install under
    ~/.cache/deepfuse/native/ (one to three minutes on 2 cores; a line on stderr says so)."""
    from torch.utils.cpp_extension import load

    here = os.path.dirname(__file__)
    name = f"deepfuse_native_{build_tag()}"
    where = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "native", name)
    os.makedirs(where, exist_ok=True)
    stamp = os.path.join(where, "sources.hash")  # the sources the library there was built from
    built = open(stamp).read() if os.path.exists(stamp) else ""
    if built != source_hash() or not os.path.exists(os.path.join(where, name + ".so")):
        print("deepfuse: building the native CPU kernels (once per machine and version, one to three minutes)",
              file=sys.stderr, flush=True)
    try:
        module = load(name=name, sources=[os.path.join(here, s) for s in SOURCES], build_directory=where,
                      extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DDEEPFUSE_SOURCES={source_hash()}"],
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no g++, no Python headers, ...: the torch-op path still works
        warnings.warn(f"deepfuse: the native CPU kernels could not be built ({e}); attention, projections, "
                      f"norms and row ops use torch ops instead", stacklevel=2)
        return None
    with open(stamp, "w") as f:
        f.write(source_hash())
    return module


def fingerprint() -> str:
    """Names the step code this machine runs: the kernels' sources and build tag, and whether
    they built (keys caches of measured step times, runtime/engine.py)."""
    h = hashlib.sha256((build_tag() + source_hash()).encode())
    return h.hexdigest()[:12] + ("" if kernels() is not None else "-none")
