"""Cache memory: the block pool (reference counts, prefix names, LRU eviction) and the cache
tensors' huge-page allocation. kv_cache.py builds the per-layer caches and the manager on them."""
from __future__ import annotations

import hashlib
import math
import mmap
from collections import OrderedDict

import numpy as np
import torch

from ..errors import DeepfuseError


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The name of a full block: hash of its parent's name and its token ids."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockPool:
    """Block ids with reference counts. A block with a name (prefix hash) and no users
    waits in an LRU and can be revived by a lookup until it is evicted for reuse."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # unnamed, unused: pop() gives the lowest id
        self.lru: OrderedDict[int, None] = OrderedDict()  # named, unused: oldest first
        self.name_of: dict[int, bytes] = {}  # committed names: their blocks are written
        self.by_name: dict[bytes, int] = {}
        self.pending_of: dict[int, bytes] = {}  # names given in the step being scheduled
        self.pending: dict[bytes, int] = {}
        self.evictions = 0

    def num_available(self) -> int:
        return len(self.free) + len(self.lru)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available():
            raise DeepfuseError(f"KV cache exhausted: need {n} more blocks, {self.num_available()} available; "
                                "raise num_blocks or lower max_tokens")
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.lru.popitem(last=False)
                del self.by_name[self.name_of.pop(b)]
                self.evictions += 1
            self.refs[b] = 1
            out.append(b)
        return out

    def holds(self, name: bytes) -> bool:
        """Whether a block named `name` is cached or pending (in use or not), without taking a reference."""
        return name in self.by_name or name in self.pending

    def lookup(self, name: bytes) -> int | None:
        """The cached (or, within its step, pending) block named `name`, with a reference taken, or None."""
        b = self.by_name.get(name, self.pending.get(name))
        if b is not None:
            if self.refs[b] == 0:  # only committed blocks wait unused in the LRU
                del self.lru[b]
            self.refs[b] += 1
        return b

    def name(self, block: int, name: bytes) -> None:
        """Records that `block` (full once the step being scheduled has run) will hold the prefix
        named `name`: pending until commit()."""
        if block in self.name_of or block in self.pending_of or self.holds(name):
            return
        self.pending_of[block], self.pending[name] = name, block

    def adopt(self, block: int, name: bytes) -> None:
        """A block just allocated whose content (the prefix `name`) is already written, from the
        disk store: named and committed at once, its reference dropped (it waits in the LRU)."""
        self.name_of[block], self.by_name[name] = name, block
        self.release([block])

    def commit(self) -> list[tuple[int, bytes]]:
        """The step that writes the pending blocks has completed: prefix lookups may find them.
        Returns the (block, name) pairs committed."""
        done = list(self.pending_of.items())
        self.name_of.update(self.pending_of)
        self.by_name.update(self.pending)
        self.pending_of.clear()
        self.pending.clear()
        return done

    def discard_pending(self) -> None:
        """The step that would have written the pending blocks failed: they stay unnamed."""
        self.pending_of.clear()
        self.pending.clear()

    def release(self, blocks: list[int], forget: bool = False) -> None:
        """Drops one reference from each; pass a table tail-first so tails are evicted first.
        forget: a block whose last reference this was loses its name and is free at once
        (a sliding window's block no cached boundary needs)."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than taken")
            if self.refs[b] == 0:
                if forget and b in self.name_of:
                    del self.by_name[self.name_of.pop(b)]
                if b in self.name_of:
                    self.lru[b] = None
                else:
                    if b in self.pending_of:  # never written: forget its name
                        del self.pending[self.pending_of.pop(b)]
                    self.free.append(b)

    def num_used(self) -> int:
        return sum(1 for r in self.refs if r > 0)


HUGE_PAGE = 2 << 20


def zeros_on_huge_pages(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    """`count` zeroed tensors of `shape`, each starting on a 2 MiB boundary of one anonymous
    mapping that Linux is asked to back with transparent huge pages. A step's attention reads
    every sequence's blocks, scattered over the whole cache: on 4 KiB pages nearly each block
    read misses the TLB (batch-64 decode attention on SmolLM2 went from ~53 to ~41 ms a step
    with scattered blocks). Every page is touched here, once: a first write to a huge page faults,
    and the fault can include the kernel compacting memory to find 2 MiB (3-11 ms a page on a
    2-core Zen 4, 1.5 GB in 3-8 s; 0.1 s when huge pages are at hand). Inside steps those faults
    had cost the throughput workload 2-3 s of its ~21 s (in the cache writes of the first pass
    over each block); here they are paid once, when the engine is made, in proportion to
    num_blocks. Where the platform has no MADV_HUGEPAGE: plain torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return [torch.zeros(shape, dtype=dtype) for _ in range(count)]
    stride = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    memory = mmap.mmap(-1, stride * count + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled
    memory.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(memory, dtype=torch.uint8)  # keeps the mapping alive
    raw[::4096].fill_(0)  # fault every page in now (zeros: the mapping stays zero-filled)
    start = -raw.data_ptr() % HUGE_PAGE
    return [raw[start + i * stride: start + i * stride + nbytes].view(dtype).view(shape) for i in range(count)]
