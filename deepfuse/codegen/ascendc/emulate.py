"""Runs emitted AscendC kernels on the CPU with g++ and deepfuse's emulation of the AscendC API
(emu/). Each kernel file of the artifact (the kernel and its host-side launch function,
kernel.kernel_file) compiles once (cached by source) into an object; its
`name<<<blockDim, 0, stream>>>(...)` is rewritten into the emulator's launch, which queues the
kernel on the stream. The emulated aclrtSynchronizeStream runs it over its cores in the mode
its entry declares (emu/deepfuse_emu/runtime.h).

    launch(kernel, tensors, tiling)   one kernel on torch tensors' memory (through ctypes)
    load_project(files)               the artifact's host launch code (host/deepfuse_launch.cpp)
                                      linked with its kernels: the same objects, called by the
                                      generated aclrt code instead of by Python

A kernel is compiled as the AI core would see it: only the emulated API's headers (-nostdinc,
`double` poisoned), so host-only C++ fails to compile. The emulator runtime and the host code
are compiled apart, with the host's C++ library (emu/runtime/runtime.cpp, emu/host/); the host
launch library also links the emulated HCCL (emu/runtime/hccl.cpp, its transport in hccl.py).
The emulator is strict where the hardware is (see emu/kernel_operator.h): a violation fails the
launch with its message. It checks numerics and API discipline, not performance.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading

import torch

from ...errors import DeepfuseError
from .kernel import UB_BYTES, AscendKernel, kernel_file, launch_symbol

EMU_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "emu")
CACHE = os.path.join(tempfile.gettempdir(), "deepfuse-ascendc-emu")

RUNTIME = os.path.join(EMU_DIR, "runtime", "runtime.cpp")
HCCL = os.path.join(EMU_DIR, "runtime", "hccl.cpp")  # the emulated HCCL, linked into the host launch library
# the entry's execution-space qualifier -> deepfuse_emu::enqueue's `qualifier`
QUALIFIERS = {"": 0, "__cube__": 1, "__vector__": 2, "__mix__(1, 1)": 3, "__mix__(1, 2)": 4}
_LOADED: dict[str, ctypes.CDLL] = {}


def _emu_key() -> str:
    h = hashlib.sha256()
    for root, _, files in sorted(os.walk(EMU_DIR)):
        for f in sorted(files):
            with open(os.path.join(root, f), "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def _gxx(args: list[str], what: str, kernel: bool = False) -> None:
    """g++ for a kernel (the emulated AscendC headers only: no C or C++ library header, no double)
    or for host code (the emulator runtime, the generated host launch code: emu/host's acl)."""
    if shutil.which("g++") is None:
        raise DeepfuseError("the AscendC emulator needs g++ (apt install g++)")
    flags = ["-nostdinc", "-nostdinc++", "-Werror=double-promotion", "-I", EMU_DIR] if kernel else \
        ["-I", EMU_DIR, "-I", os.path.join(EMU_DIR, "host")]
    r = subprocess.run(["g++", "-std=c++17", "-O1", "-fPIC", *flags, *args], capture_output=True, text=True)
    if r.returncode != 0:
        first = next((line for line in r.stderr.splitlines() if "error" in line), r.stderr.strip()[:300])
        raise DeepfuseError(f"{what} does not compile against the emulator: {first}")


def _cached(key: str, name: str, make) -> str:
    """The path of `name` in the cache directory for `key`, made by make(tmp_path) if missing."""
    out = os.path.join(CACHE, hashlib.sha256((key + _emu_key()).encode()).hexdigest()[:16])
    path = os.path.join(out, name)
    if not os.path.exists(path):
        os.makedirs(out, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # processes and threads build at once
        make(out, tmp)
        os.replace(tmp, path)
    return path


def qualifier(kernel: AscendKernel) -> int:
    """The kernel entry's execution-space qualifier (QUALIFIERS), read from its declaration."""
    m = re.search(r"^([^\n]*\b__global__\b[^\n]*?)\bvoid\s+" + kernel.name + r"\s*\(", kernel.source, re.M)
    if m is None:
        raise DeepfuseError(f"AscendC kernel {kernel.name}: no `__global__ ... void {kernel.name}(` entry")
    found = [q for q in QUALIFIERS if q and q.replace(" ", "") in m.group(1).replace(" ", "")]
    return QUALIFIERS[found[0] if found else ""]


def emulated_file(kernel: AscendKernel) -> str:
    """The kernel's artifact file as the emulator compiles it: `double` poisoned, and its
    `name<<<blockDim, 0, stream>>>(args)` turned into deepfuse_emu::launch_kernel with the
    entry's qualifier and the Matmul objects it declares (DEEPFUSE_EMU_MATMUL)."""
    text = kernel_file(kernel)
    launch = re.compile(r"\b" + kernel.name + r"<<<\s*([^,]+),\s*([^,]+),\s*([^>]+?)\s*>>>\(")
    if len(launch.findall(text)) != 1:
        raise DeepfuseError(f"AscendC kernel {kernel.name}: its file must launch it once with <<<...>>>")
    cut = launch.search(text).start()
    rewritten = launch.sub(rf"deepfuse_emu::launch_kernel({qualifier(kernel)}, DEEPFUSE_EMU_MATMUL, \1, \2, \3, "
                           rf"{kernel.name}, ", text[cut:])
    return (f"#pragma GCC poison double\n{text[:cut]}"
            f"#ifndef DEEPFUSE_EMU_MATMUL\n#define DEEPFUSE_EMU_MATMUL 0\n#endif\n{rewritten}")


def kernel_object(kernel: AscendKernel) -> str:
    """The kernel's file compiled against the emulator (cached); returns the .o path."""
    tu = emulated_file(kernel)

    def make(out: str, tmp: str) -> None:
        with open(os.path.join(out, "kernel.cpp"), "w") as f:
            f.write(tu)
        _gxx(["-c", os.path.join(out, "kernel.cpp"), "-o", tmp], f"AscendC kernel {kernel.name}", kernel=True)

    return _cached(tu, "kernel.o", make)


def _host_object(path: str, what: str) -> str:
    with open(path) as f:
        source = f.read()
    name = os.path.basename(path).replace(".cpp", ".o")
    return _cached(source, name, lambda out, tmp: _gxx(["-c", path, "-o", tmp], what))


def _runtime_object() -> str:
    return _host_object(RUNTIME, "the emulator runtime")


def _load(path: str) -> ctypes.CDLL:
    if path not in _LOADED:
        _LOADED[path] = ctypes.CDLL(path)
    return _LOADED[path]


def build(kernel: AscendKernel) -> str:
    """The kernel as a shared library exporting its launch function (cached); returns its path."""
    obj = kernel_object(kernel)
    return _cached(obj, "kernel.so", lambda out, tmp: _gxx(["-shared", obj, _runtime_object(), "-lm", "-o", tmp],
                                                            f"AscendC kernel {kernel.name}"))


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.deepfuse_emu_error.restype = ctypes.c_char_p
        raise DeepfuseError(f"{what} failed in the emulator: {lib.deepfuse_emu_error().decode()}")


CTYPES = {"int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "float": ctypes.c_float}


def tiling_ctype(kernel: AscendKernel) -> type:
    """The kernel's tiling struct as a ctypes Structure (passed by value to its launch function)."""
    return type(f"{kernel.name}_tiling", (ctypes.Structure,), {"_fields_": [(f, CTYPES[c]) for f, c, _ in kernel.tiling]})


def launch(kernel: AscendKernel, tensors: list[torch.Tensor], tiling: bytes, ub_bytes: int = UB_BYTES) -> dict:
    """Runs the kernel over its block_dim cores on `tensors` (one per GM argument, contiguous CPU
    memory, written in place) with `tiling` (its struct's bytes, kernel.pack): queued on the
    default stream by its launch function, then the stream synchronised. Returns what ran:
    {"blocks": bodies run, "busy_cubes": cube cores that computed a Matmul}."""
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise DeepfuseError(f"{kernel.name}: the emulator needs contiguous CPU tensors")
    struct = tiling_ctype(kernel)
    if len(tiling) != ctypes.sizeof(struct):
        raise DeepfuseError(f"{kernel.name}: {len(tiling)} bytes of tiling for a {ctypes.sizeof(struct)}-byte struct")
    lib = _load(build(kernel))
    lib.deepfuse_emu_set_ub(ctypes.c_size_t(ub_bytes))
    workspace = ctypes.create_string_buffer(max(kernel.workspace, 32))
    fn = getattr(lib, launch_symbol(kernel))
    fn.restype = None
    fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p] + [ctypes.c_void_p] * (len(tensors) + 1) + [struct]
    fn(kernel.block_dim, None, *[t.data_ptr() for t in tensors], ctypes.addressof(workspace),
       struct.from_buffer_copy(tiling))
    _check(lib, lib.aclrtSynchronizeStream(None), f"AscendC kernel {kernel.name}")
    lib.deepfuse_emu_blocks_run.restype = lib.deepfuse_emu_busy_cubes.restype = ctypes.c_int64
    return {"blocks": lib.deepfuse_emu_blocks_run(), "busy_cubes": lib.deepfuse_emu_busy_cubes()}


def load_project(files: dict[str, bytes], kernels: list[AscendKernel]) -> ctypes.CDLL:
    """The artifact's host launch library built against the emulator (kernels' objects + the
    generated host/deepfuse_launch.cpp + emulated aclrt and HCCL) and loaded."""
    objs = [kernel_object(k) for k in kernels]
    host = files["host/deepfuse_launch.cpp"].decode() + files["host/deepfuse_launch.h"].decode()

    def make(out: str, tmp: str) -> None:
        for name in ("host/deepfuse_launch.cpp", "host/deepfuse_launch.h"):
            with open(os.path.join(out, os.path.basename(name)), "wb") as f:
                f.write(files[name])
        _gxx(["-shared", "-I", out, os.path.join(out, "deepfuse_launch.cpp"), *objs, _runtime_object(),
              _host_object(HCCL, "the emulated HCCL"), "-lm", "-o", tmp], "the generated host launch code")

    return _load(_cached(host + "".join(objs), "project.so", make))
