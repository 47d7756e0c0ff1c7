"""Runs emitted AscendC kernels on the CPU: each kernel is compiled with g++ against deepfuse's
emulation of the AscendC API (emu/) into a shared library, cached by source, and launched
through ctypes on torch tensors' memory, once per AI core (GetBlockIdx = 0 .. block_dim-1).

The emulator is strict where the hardware is: unified-buffer capacity, 32-byte DataCopy rules,
queue misuse, missing pipe synchronisation and the cube's buffer limits; a violation fails the
launch with its message. It checks numerics and API discipline, not performance.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import torch

from ...errors import DeepfuseError
from .kernel import UB_BYTES, AscendKernel

EMU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emu")
CACHE = os.path.join(tempfile.gettempdir(), "deepfuse-ascendc-emu")

HARNESS = """\
#include "kernel_operator.h"
#include "kernel.cpp"
#include <cstdio>

extern "C" int deepfuse_launch(uint8_t** args, uint8_t* workspace, uint8_t* tiling, int64_t blocks, size_t ub,
                               char* err, int errlen) {
    deepfuse_emu::ub_limit() = ub;
    try {
        deepfuse_emu::launch(blocks, [&] { KERNEL_CALL; });
    } catch (const std::exception& e) {
        std::snprintf(err, errlen, "%s", e.what());
        return 3;
    }
    return 0;
}
"""
_LOADED: dict[str, ctypes.CDLL] = {}


def _emu_sources() -> str:
    parts = []
    for root, _, files in sorted(os.walk(EMU_DIR)):
        for f in sorted(files):
            with open(os.path.join(root, f)) as fh:
                parts.append(fh.read())
    return "".join(parts)


def build(kernel: AscendKernel) -> str:
    """Compiles kernel + harness into a shared library (cached by source); returns its path."""
    if shutil.which("g++") is None:
        raise DeepfuseError("the AscendC emulator needs g++ (apt install g++)")
    call = f"{kernel.name}(" + "".join(f"args[{i}], " for i in range(len(kernel.args))) + "workspace, tiling)"
    key = hashlib.sha256((kernel.source + call + _emu_sources()).encode()).hexdigest()[:16]
    out = os.path.join(CACHE, key)
    lib = os.path.join(out, "kernel.so")
    if os.path.exists(lib):
        return lib
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernel.cpp"), "w") as f:
        f.write(kernel.source)
    with open(os.path.join(out, "harness.cpp"), "w") as f:
        f.write(HARNESS)
    tmp = f"{lib}.{os.getpid()}.tmp"
    cmd = ["g++", "-std=c++17", "-O1", "-shared", "-fPIC", "-I", EMU_DIR, "-I", out, f"-DKERNEL_CALL={call}",
           os.path.join(out, "harness.cpp"), "-o", tmp]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:300])
        raise DeepfuseError(f"AscendC kernel {kernel.name} does not compile against the emulator: {first}")
    os.replace(tmp, lib)
    return lib


def launch(kernel: AscendKernel, tensors: list[torch.Tensor], tiling: bytes, ub_bytes: int = UB_BYTES) -> None:
    """Runs the kernel over its block_dim cores on `tensors` (one per GM argument, contiguous CPU
    memory, written in place)."""
    path = build(kernel)
    if path not in _LOADED:
        _LOADED[path] = ctypes.CDLL(path)
    fn = _LOADED[path].deepfuse_launch
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise DeepfuseError(f"{kernel.name}: the emulator needs contiguous CPU tensors")
    ptrs = (ctypes.c_void_p * max(1, len(tensors)))(*[t.data_ptr() for t in tensors])
    workspace = ctypes.create_string_buffer(max(kernel.workspace, 32))
    tiling_buf = ctypes.create_string_buffer(tiling, max(len(tiling), 4))
    err = ctypes.create_string_buffer(512)
    rc = fn(ptrs, workspace, tiling_buf, ctypes.c_int64(kernel.block_dim), ctypes.c_size_t(ub_bytes), err,
            ctypes.c_int(512))
    if rc != 0:
        raise DeepfuseError(f"AscendC kernel {kernel.name} failed in the emulator: {err.value.decode()}")
