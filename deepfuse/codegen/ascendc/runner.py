"""Runs an ascend950 plan on this machine: each launch's AscendC kernels in deepfuse's CPU
emulator (emulate.py), or its op's torch reference where the plan has no kernel. This is how
the kernels are checked against the interpreter; it is not a fast way to run a model.
"""
from __future__ import annotations

import torch

from ...errors import DeepfuseError
from ...ir import DTYPES, OPS
from ..triton.runner import sizes_of
from .emulate import launch
from .kernel import AscendKernel, pack


class EmulatorRunner:
    def __init__(self, plan: dict, weights: dict[str, torch.Tensor]):
        self.plan = plan
        self.base: list = [None] * plan["num_slots"]
        for name, s in plan["params"].items():
            self.base[s] = weights[name].contiguous()
        self.launches = [(p, [AscendKernel(**k) for k in p.get("kernels", [])], OPS[p["op"]].reference)
                         for p in plan["launches"]]

    def __call__(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        env = list(self.base)
        for name, s in self.plan["inputs"].items():
            t = inputs[name]
            if t.device.type != "cpu" or not t.is_contiguous():
                raise DeepfuseError(f"the ascend950 emulator takes contiguous CPU inputs; {name} is not")
            env[s] = t
        for p, kernels, ref in self.launches:
            ins = [env[i] for i in p["in"]]
            sampled = p["op"] == "sample" and bool((ins[1] > 0).any())
            if kernels and not sampled:
                outs = self._run(p, kernels, ins)
            else:
                res = ref(*ins, **p["attrs"])
                outs = list(res) if isinstance(res, (tuple, list)) else [res]
            for s, t in zip(p["out"], outs):
                env[s] = t
            for s in p["free"]:
                env[s] = None
        return [env[s] for s in self.plan["outputs"]]

    def _run(self, p: dict, kernels: list[AscendKernel], ins: list[torch.Tensor]) -> list[torch.Tensor]:
        ins = [t.contiguous() for t in ins]
        shapes = sizes_of(p["out_shape"], ins, p["in_shape"])
        outs = [torch.zeros(s, dtype=DTYPES[d]) for s, d in zip(shapes, p["out_dtype"])]
        tmp_shapes = sizes_of([t["shape"] for t in p["tmps"]], ins, p["in_shape"])
        tmps = [torch.zeros(s, dtype=DTYPES[t["dtype"]]) for s, t in zip(tmp_shapes, p["tmps"])]
        in_shapes = [tuple(t.shape) for t in ins]
        for k in kernels:
            for i, axis, n, what in k.requires:
                if ins[i].shape[axis] != n:
                    raise DeepfuseError(f"{k.name} ({p['node']}) was built for {what} {n}, the step has {ins[i].shape[axis]}")
            tensors = [{"in": ins, "out": outs, "tmp": tmps}[kind][i] for kind, i in k.args]
            launch(k, tensors, pack(k.tiling, in_shapes, [tuple(s) for s in tmp_shapes]))
        return outs
