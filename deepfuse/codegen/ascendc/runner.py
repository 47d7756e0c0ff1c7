"""Runs an ascend950 plan on this machine: each launch's AscendC kernels in deepfuse's CPU
emulator (emulate.py), or its op's torch reference where the plan has no kernel. This is how
the kernels are checked against the interpreter; it is not a fast way to run a model.

via_host=True launches the kernels through the artifact's generated host code
(host/deepfuse_launch.cpp, built against the emulated aclrt) instead of from Python, so the
host code's tiling and argument order are checked too. A tensor-parallel rank's plan always runs
that way: its collectives are HCCL calls of the host code (collective.py), which the emulated
HCCL hands to torch.distributed over the rank's process group (hccl.py).
"""
from __future__ import annotations

import ctypes
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from ...errors import DeepfuseError
from ...ir import DTYPES, OPS
from ..triton.runner import sizes_of
from .emulate import build, launch, load_project
from .hccl import init_comm, transport_error
from .kernel import AscendKernel, pack
from .project import MAX_ARGS, MAX_DIMS, kernels_of, project_files

Ptrs = ctypes.c_void_p * MAX_ARGS
Shapes = (ctypes.c_int64 * MAX_DIMS) * MAX_ARGS


class LaunchArgs(ctypes.Structure):
    """host/deepfuse_launch.h's DeepfuseLaunchArgs."""
    _fields_ = [("in_", Ptrs), ("out", Ptrs), ("tmp", Ptrs), ("in_shape", Shapes), ("tmp_shape", Shapes),
                ("workspace", ctypes.c_void_p), ("comm", ctypes.c_void_p)]


class EmulatorRunner:
    def __init__(self, plan: dict, weights: dict[str, torch.Tensor], via_host: bool = False):
        self.plan = plan
        self.base: list = [None] * plan["num_slots"]
        for name, s in plan["params"].items():
            self.base[s] = weights[name].contiguous()
        self.launches = [(p, [AscendKernel(**k) for k in p.get("kernels", [])], OPS[p["op"]].reference)
                         for p in plan["launches"]]
        self.host = None
        self.built = False
        # the ranks the collectives span (0: a one-rank plan); their HcclComm is made at the first step
        self.world = next((p["attrs"]["world"] for p in plan["launches"] if p.get("collective")), 0)
        self.comm = None
        if via_host or self.world:
            self.host = load_project(project_files(plan), list(kernels_of(plan).values()))
            self.host.deepfuse_workspace_bytes.restype = ctypes.c_uint64
            self.workspace = torch.zeros(max(self.host.deepfuse_workspace_bytes(), 32), dtype=torch.uint8)

    def _build(self) -> None:
        """Compiles every kernel of the plan with g++ (cached), in parallel; on the first step,
        not at load."""
        if self.built:
            return
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            list(pool.map(build, kernels_of(self.plan).values()))
        self.built = True

    def __call__(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self._build()
        env = list(self.base)
        for name, s in self.plan["inputs"].items():
            t = inputs[name]
            written = name.startswith("kv_cache.")  # updated in place by the step
            if t.device.type != "cpu" or (written and not t.is_contiguous()):
                raise DeepfuseError(f"the ascend950 emulator takes CPU inputs and contiguous caches; {name} is not")
            env[s] = t.contiguous()  # the engine's step views (block_tables[:s, :width]) are copied
        for i, (p, kernels, ref) in enumerate(self.launches):
            ins = [env[j] for j in p["in"]]
            if kernels or p.get("collective"):
                outs = self._run(i, p, kernels, ins)
            else:
                res = ref(*ins, **p["attrs"])
                outs = list(res) if isinstance(res, (tuple, list)) else [res]
            for s, t in zip(p["out"], outs):
                env[s] = t
            for s in p["free"]:
                env[s] = None
        return [env[s] for s in self.plan["outputs"]]

    def _run(self, index: int, p: dict, kernels: list[AscendKernel], ins: list[torch.Tensor]) -> list[torch.Tensor]:
        ins = [t.contiguous() for t in ins]
        shapes = sizes_of(p["out_shape"], ins, p["in_shape"])
        outs = [torch.zeros(s, dtype=DTYPES[d]) for s, d in zip(shapes, p["out_dtype"])]
        tmp_shapes = [tuple(s) for s in sizes_of([t["shape"] for t in p["tmps"]], ins, p["in_shape"])]
        tmps = [torch.zeros(s, dtype=DTYPES[t["dtype"]]) for s, t in zip(tmp_shapes, p["tmps"])]
        for k in kernels:
            for i, axis, n, what in k.requires:
                if ins[i].shape[axis] != n:
                    raise DeepfuseError(f"{k.name} ({p['node']}) was built for {what} {n}, the step has {ins[i].shape[axis]}")
        if self.host is not None:
            self._run_host(index, p, ins, outs, tmps)
            return outs
        in_shapes = [tuple(t.shape) for t in ins]
        for k in kernels:
            tensors = [{"in": ins, "out": outs, "tmp": tmps}[kind][i] for kind, i in k.args]
            launch(k, tensors, pack(k.tiling, in_shapes, tmp_shapes))
        return outs

    def _run_host(self, index: int, p: dict, ins, outs, tmps) -> None:
        a = LaunchArgs()
        for field, tensors in (("in_", ins), ("out", outs), ("tmp", tmps)):
            for j, t in enumerate(tensors):
                getattr(a, field)[j] = t.data_ptr()
        for field, tensors in (("in_shape", ins), ("tmp_shape", tmps)):
            for j, t in enumerate(tensors):
                for d, n in enumerate(t.shape):
                    getattr(a, field)[j][d] = n
        a.workspace = self.workspace.data_ptr()
        if self.world and self.comm is None:
            self.comm = init_comm(self.host, self.world)
            weakref.finalize(self, self.host.HcclCommDestroy, self.comm)
        a.comm = self.comm
        rc = self.host.deepfuse_launch(index, None, ctypes.byref(a))
        if rc == 0:  # the kernels are queued on the stream: run them
            rc = self.host.aclrtSynchronizeStream(None)
        if rc != 0:
            self.host.deepfuse_emu_error.restype = ctypes.c_char_p
            raise DeepfuseError(f"launch {index} {p['node']} failed through the host code (aclError {rc}): "
                                f"{self.host.deepfuse_emu_error().decode()}{transport_error()}")
