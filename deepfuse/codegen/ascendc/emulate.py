"""Runs an emitted AscendC kernel on the CPU: g++ against the emulation header (emu/), one
process per launch, tensors passed as files. The emulator is strict about unified-buffer
capacity, 32-byte DataCopy rules and queue misuse; a violation fails the run with its message.
This checks numerics and API discipline, not performance or the hardware's pipe timing.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import struct
import subprocess
import tempfile

import numpy as np
import torch

from ...errors import DeepfuseError
from .emit import AscendKernel

EMU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emu")
CACHE = os.path.join(tempfile.gettempdir(), "deepfuse-ascendc-emu")

HARNESS = """\
#include "kernel_operator.h"
#include "kernel.cpp"
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

static std::vector<uint8_t> slurp(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

int main(int argc, char** argv) {
    std::string dir = argv[1];
    std::vector<std::vector<uint8_t>> args;
    for (int i = 0; i < NARGS; i++) args.push_back(slurp(dir + "/arg" + std::to_string(i) + ".bin"));
    std::vector<uint8_t> tiling = slurp(dir + "/tiling.bin");
    deepfuse_emu::ub_limit() = UB_LIMIT;
    try {
        deepfuse_emu::launch(BLOCK_DIM, [&] { KERNEL_CALL; });
    } catch (const std::exception& e) {
        std::fprintf(stderr, "ascendc-emu: %s\\n", e.what());
        return 3;
    }
    for (int i = 0; i < NARGS; i++) {
        std::ofstream f(dir + "/arg" + std::to_string(i) + ".bin", std::ios::binary);
        f.write((const char*)args[i].data(), args[i].size());
    }
    return 0;
}
"""


def build(kernel: AscendKernel, ub_bytes: int = 248 * 1024) -> str:
    """Compiles kernel + harness with g++ (cached by source); returns the binary's path."""
    if shutil.which("g++") is None:
        raise DeepfuseError("the AscendC emulator needs g++ (apt install g++)")
    call = f"{kernel.name}(" + ", ".join(f"args[{i}].data()" for i in range(len(kernel.args))) + ", tiling.data())"
    defs = f"-DNARGS={len(kernel.args)} -DBLOCK_DIM={kernel.block_dim} -DUB_LIMIT={ub_bytes} -DKERNEL_CALL='{call}'"
    key = hashlib.sha256((kernel.source + defs + open(os.path.join(EMU_DIR, "kernel_operator.h")).read())
                         .encode()).hexdigest()[:16]
    out = os.path.join(CACHE, key)
    binary = os.path.join(out, "kernel")
    if os.path.exists(binary):
        return binary
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "kernel.cpp"), "w") as f:
        f.write(kernel.source)
    with open(os.path.join(out, "harness.cpp"), "w") as f:
        f.write(HARNESS)
    cmd = ["g++", "-std=c++17", "-O1", "-I", EMU_DIR, "-I", out, f"-DNARGS={len(kernel.args)}",
           f"-DBLOCK_DIM={kernel.block_dim}", f"-DUB_LIMIT={ub_bytes}", f"-DKERNEL_CALL={call}",
           os.path.join(out, "harness.cpp"), "-o", binary + ".tmp"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:300])
        raise DeepfuseError(f"AscendC kernel {kernel.name} does not compile against the emulator: {first}")
    os.replace(binary + ".tmp", binary)
    return binary


def run(kernel: AscendKernel, ins: list[torch.Tensor], out_shapes: list[tuple], tiling: bytes,
        ub_bytes: int = 248 * 1024) -> list[torch.Tensor]:
    """Launches the kernel over its block_dim AI cores; returns the node outputs."""
    binary = build(kernel, ub_bytes)
    outs = [torch.zeros(s, dtype=ins[0].dtype) for s in out_shapes]
    with tempfile.TemporaryDirectory() as d:
        for i, (kind, j) in enumerate(kernel.args):
            t = ins[j] if kind == "in" else outs[j]
            t.contiguous().numpy().tofile(os.path.join(d, f"arg{i}.bin"))
        with open(os.path.join(d, "tiling.bin"), "wb") as f:
            f.write(tiling)
        r = subprocess.run([binary, d], capture_output=True, text=True)
        if r.returncode != 0:
            msg = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else f"exit {r.returncode}"
            raise DeepfuseError(f"AscendC kernel {kernel.name} failed in the emulator: {msg}")
        for i, (kind, j) in enumerate(kernel.args):
            if kind == "out":
                data = torch.from_numpy(np.fromfile(os.path.join(d, f"arg{i}.bin"), dtype=np.float32))
                outs[j] = data.view(out_shapes[j]).clone()
    return outs


def rms_norm_tiling(rows: int, cores: int, eps: float) -> bytes:
    """The host tiling of the rms_norm kernels: rows, rowsPerCore, eps."""
    return struct.pack("<IIf", rows, -(-rows // cores), eps)


def rows_tiling(rows: int, cores: int) -> bytes:
    """The host tiling of row-wise kernels without attributes (swiglu): rows, rowsPerCore."""
    return struct.pack("<II", rows, -(-rows // cores))
