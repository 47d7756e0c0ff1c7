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


@functools.cache
def paged_decode():
    """The paged_decode extension module (paged_decode.cpp), or None where it cannot be built.
    Built once per machine and torch install under ~/.cache/deepfuse/native/ (~40 s on 2
    cores; a line on stderr says so)."""
    from torch.utils.cpp_extension import load

    src = os.path.join(os.path.dirname(__file__), "paged_decode.cpp")
    name = f"deepfuse_paged_decode_{build_tag()}"
    where = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "native", name)
    os.makedirs(where, exist_ok=True)
    if not os.path.exists(os.path.join(where, name + ".so")):
        print("deepfuse: building the native decode attention kernel (once per machine, ~40 s)", file=sys.stderr,
              flush=True)
    try:
        return load(name=name, sources=[src], build_directory=where, extra_cflags=["-O3", "-march=native", "-fopenmp"],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no g++, no Python headers, ...: the torch-op path still works
        warnings.warn(f"deepfuse: the native paged decode kernel could not be built ({e}); "
                      f"decode attention gathers blocks with torch ops instead", stacklevel=2)
        return None
