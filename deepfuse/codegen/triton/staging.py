"""Staging: a step's host inputs reach the device in one non-blocking copy.

A host byte buffer (pinned where the device is a GPU) and a device byte buffer of the same
size; each input is a typed view of both at a 256-byte aligned offset (the cubins assume
16-byte aligned pointers). The host side is written in place (numpy views), then `upload`
copies the bytes in use with one `copy_(non_blocking=True)`; the kernels read the device
views. The host buffer is written again only once the copy that read it has completed (a CUDA
event, queried: the synchronous engine has read the step's tokens by then, so it has; the
overlapped loop, runtime/overlap.py, launches a step before reading the last one and may wait
for that copy alone). On the CPU the
"device" buffer is a second host buffer and the copy a memcpy: the same code runs in the tests.
Owns its two buffers; it never reads the device back.
"""
from __future__ import annotations

import numpy as np
import torch

ALIGN = 256


def layout(fields: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[dict, int]:
    """Places fields (name, dtype, shape) one after another, each at an ALIGN-byte offset ->
    ({name: (offset, dtype, shape)}, total bytes)."""
    out, at = {}, 0
    for name, dtype, shape in fields:
        out[name] = (at, dtype, tuple(shape))
        at += -(-int(np.prod(shape, dtype=np.int64)) * dtype.itemsize // ALIGN) * ALIGN
    return out, at


def typed(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The view of `buf` (u8) at offset as dtype [shape]."""
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    return buf[offset:offset + n].view(dtype).view(shape)


class Staging:
    """host: u8 [nbytes] (pinned on a GPU machine), device: u8 [nbytes] on `device`."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.host = torch.zeros(max(nbytes, ALIGN), dtype=torch.uint8, pin_memory=self.cuda)
        self.dev = torch.zeros(max(nbytes, ALIGN), dtype=torch.uint8, device=self.device)
        self._copied = torch.cuda.Event() if self.cuda else None  # recorded after each upload
        self._uploaded = False

    @property
    def nbytes(self) -> int:
        return self.host.numel()

    def wait_writable(self) -> None:
        """Returns once the host buffer may be written: the last upload has read it. Queried first,
        so it waits only where a caller runs two steps without taking the first one's tokens."""
        if self._uploaded and not self._copied.query():
            self._copied.synchronize()

    def upload(self, nbytes: int) -> None:
        """Copies host[:nbytes] to device[:nbytes] on the current stream, not waiting for it."""
        self.dev[:nbytes].copy_(self.host[:nbytes], non_blocking=True)
        if self.cuda:
            self._copied.record()
            self._uploaded = True

    def host_view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return typed(self.host, offset, dtype, shape)

    def device_view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return typed(self.dev, offset, dtype, shape)


class Packer:
    """Moves a step's host tensors (any shapes, one step after another) to the device in one copy:
    `pack(tensors)` -> the same tensors as views of the device buffer (valid until the next
    pack). The buffers grow to the largest step seen."""

    def __init__(self, device: torch.device):
        self.device, self.staging = torch.device(device), None

    def pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        places, nbytes = layout([(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()])
        if self.staging is None or self.staging.nbytes < nbytes:
            if self.staging is not None:
                self.staging.wait_writable()
            self.staging = Staging(2 * nbytes, self.device)
        s = self.staging
        s.wait_writable()
        for k, t in tensors.items():
            s.host_view(*places[k]).copy_(t)  # host to host
        s.upload(nbytes)
        return {k: s.device_view(*places[k]) for k in tensors}
