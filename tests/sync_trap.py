"""A trap for host waits: inside `no_host_waits()`, every torch call that would make the host wait
for a GPU (read a value back, synchronise, copy to the host or from pageable memory) raises,
except while a Triton kernel itself runs (TritonRunner._launch: Triton's CPU interpreter reads
its tensors on the host). On this CPU-only machine nothing truly waits, so the trap names the
calls that would: .item, .tolist, .cpu, .numpy, bool/int/float/index of a tensor, ops whose
output size depends on values (nonzero, masked_select, unique, bincount, a tensor of repeats, a
boolean index), a waiting copy between devices, and torch.cuda's synchronize calls. It also
records every copy_/to call that moves data, with its non_blocking flag (`trap.copies`).
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from deepfuse.codegen.triton.runner import TritonRunner

T = torch.Tensor
READS = {T.item, T.tolist, T.cpu, T.numpy, T.__array__, T.__bool__, T.__int__, T.__float__, T.__index__,
         torch.nonzero, T.nonzero, torch.argwhere, torch.masked_select, T.masked_select, torch.unique,
         T.unique, torch.unique_consecutive, torch.bincount, T.bincount}
INDEXING = {T.__getitem__, T.__setitem__, T.index_put_, torch.index_put}


class HostWait(AssertionError):
    pass


def _bool_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, T) and i.dtype in (torch.bool, torch.uint8) and i.dim() > 0 for i in items)


def _target_device(args, kwargs):
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, (str, torch.device)):
            return torch.device(a)
        if isinstance(a, T):
            return a.device
    return None


class Trap(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.suspended, self.copies = 0, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.suspended:
            self.check(func, args, kwargs)
        return func(*args, **kwargs)

    def check(self, func, args, kwargs) -> None:
        name = getattr(func, "__name__", str(func))
        if func in READS:
            raise HostWait(f"{name} reads a tensor back to the host inside a step")
        if func in (torch.repeat_interleave, T.repeat_interleave) and isinstance(
                args[1] if len(args) > 1 else kwargs.get("repeats"), T) and kwargs.get("output_size") is None:
            raise HostWait("repeat_interleave with a tensor of repeats and no output_size reads them back")
        if func in INDEXING and len(args) > 1 and _bool_index(args[1]):
            raise HostWait(f"{name} with a boolean index reads the mask back (nonzero)")
        if func in (T.to, T.copy_):
            src, dst = (args[1], args[0]) if func is T.copy_ else (args[0], _target_device(args, kwargs))
            dst_device = dst.device if isinstance(dst, T) else dst
            if dst_device is not None and isinstance(src, T) and src.device != dst_device:
                if not kwargs.get("non_blocking", False):
                    raise HostWait(f"{name} from {src.device} to {dst_device} waits (non_blocking=False)")
            if func is T.copy_:
                self.copies.append((tuple(args[0].shape), bool(kwargs.get("non_blocking", False))))


@contextlib.contextmanager
def no_host_waits():
    """Yields the Trap; torch.cuda's synchronize calls raise too while it is active."""
    trap = Trap()
    real_launch = TritonRunner._launch

    def launch(self, *args, **kwargs):
        trap.suspended += 1
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            trap.suspended -= 1

    def refuse(*args, **kwargs):
        raise HostWait("a CUDA synchronize inside a step")

    mp = {(TritonRunner, "_launch"): launch, (torch.cuda, "synchronize"): refuse,
          (torch.cuda.Stream, "synchronize"): refuse, (torch.cuda.Event, "synchronize"): refuse}
    saved = {key: getattr(*key) for key in mp}
    try:
        for (obj, attr), fn in mp.items():
            setattr(obj, attr, fn)
        with trap:
            yield trap
    finally:
        for (obj, attr), fn in saved.items():
            setattr(obj, attr, fn)
