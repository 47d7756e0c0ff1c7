"""Paged KV cache: per-layer block tensors, a reference-counted block pool with prefix
caching, and the manager that gives sequences their blocks.

Layer i's cache is one tensor [2, N, BS, Hkv, hd] (k and v; int8 rows are hd + 4 long). A sequence owns a list of
block ids (its block table); the token at position p lives in slot
table[p // BS] * BS + p % BS. This module owns memory; it does not schedule.

Prefix caching: a full block is named by a hash chained over the whole prefix,
blake2b(parent hash + the block's token ids), so equal names mean equal KV. A name given
while a step is scheduled is pending: the step's own requests may share the block (a step
writes all its new KV before attention reads any), but other steps find it only once the
step that writes it has completed (`commit`); a step that fails drops its pending names
(`discard_pending`), so an interrupted step never leaves a named, unwritten block. Named
blocks whose last user is gone stay cached and are evicted least recently used first,
only when a fresh block is needed. Under a sliding window a request that continues a cached
prefix needs only the prefix's blocks that its queries can still see (the last `window`
positions); the blocks before them may have been evicted.
"""
from __future__ import annotations

import hashlib
import math
import mmap
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import DeepfuseError


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 512  # total tokens cached = num_blocks * block_size
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise DeepfuseError(f"cache block_size and num_blocks must be >= 1, got {self.block_size}, {self.num_blocks}")


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

    def commit(self) -> None:
        """The step that writes the pending blocks has completed: prefix lookups may find them."""
        self.name_of.update(self.pending_of)
        self.by_name.update(self.pending)
        self.pending_of.clear()
        self.pending.clear()

    def discard_pending(self) -> None:
        """The step that would have written the pending blocks failed: they stay unnamed."""
        self.pending_of.clear()
        self.pending.clear()

    def release(self, blocks: list[int]) -> None:
        """Drops one reference from each; pass a table tail-first so tails are evicted first."""
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] < 0:
                raise RuntimeError(f"block {b} released more often than taken")
            if self.refs[b] == 0:
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


class KVCache:
    """The cache tensors of every layer plus their block pool."""

    def __init__(self, num_layers: int, num_kv_heads: int, row: int, dtype: torch.dtype, config: CacheConfig,
                 device: torch.device | str = "cpu"):
        """row: elements of one (position, kv head) row: head_dim, or head_dim + 4 for int8 rows
        that end in their scale (ir.opdefs_llm.kv_row_size). device: where the step's kernels
        run (CompiledModel.device); the step writes the cache in place, so it lives there."""
        self.config = config
        shape = (2, config.num_blocks, config.block_size, num_kv_heads, row)
        if torch.device(device).type == "cpu":
            self.layers = zeros_on_huge_pages(num_layers, shape, dtype)
        else:
            self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.pool = BlockPool(config.num_blocks)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def ensure_capacity(self, blocks: list[int], num_tokens: int) -> None:
        """Grows `blocks` in place so it covers num_tokens positions."""
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size


@dataclass
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # of which found cached

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class SeqBlocks:
    """One sequence's share of the cache: its block table and the names of its full blocks."""

    table: list[int] = field(default_factory=list)
    names: list[bytes] = field(default_factory=list)


class KVCacheManager:
    """Gives sequences blocks. `window` > 0 is the sliding-window policy: blocks wholly
    before the window of every future query are handed back early (a layer group with
    full attention uses window 0). Today one group covers all layers."""

    def __init__(self, cache: KVCache, window: int = 0):
        self.cache, self.pool, self.window = cache, cache.pool, window
        self.bs = cache.block_size
        self.stats = CacheStats()

    def match_prefix(self, tokens: list[int]) -> SeqBlocks:
        """Cached full blocks of `tokens`' prefix, references taken. At least the last token
        is always left to compute (its logits are needed), so a match never covers it.
        Under a sliding window the match is the longest prefix of whole blocks whose last
        `window` positions before its end are all cached: the blocks before those are never
        read again, and the table holds -1 in their place (as `computed` leaves it)."""
        seq = SeqBlocks()
        if not self.cache.config.enable_prefix_caching:
            return seq
        names, parent = [], b""
        for i in range((len(tokens) - 1) // self.bs):
            parent = block_hash(parent, tokens[i * self.bs:(i + 1) * self.bs])
            if not self.window and not self.pool.holds(parent):
                break
            names.append(parent)
        count = len(names)
        while count:  # a missing block j rules out every longer prefix whose window reaches it
            missing = [i for i in range(self.first_needed(count * self.bs), count) if not self.pool.holds(names[i])]
            if not missing:
                break
            count = missing[-1]
        first = self.first_needed(count * self.bs)
        seq.table = [-1] * first + [self.pool.lookup(name) for name in names[first:count]]
        seq.names = names[:count]
        return seq

    def first_needed(self, computed: int) -> int:
        """The first block a sequence with `computed` positions cached still reads: its next
        query, at position `computed`, sees the positions after computed - window (0 without a window)."""
        return max(0, computed + 1 - self.window) // self.bs if self.window else 0

    def blocks_needed(self, seq: SeqBlocks, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.bs) - len(seq.table))

    def can_allocate(self, seq: SeqBlocks, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= self.pool.num_available()

    def allocate(self, seq: SeqBlocks, tokens: list[int], num_tokens: int) -> None:
        """Grows seq's table to cover positions [0, num_tokens) of `tokens`, which the step being
        scheduled writes (check can_allocate first), and gives the blocks that become full
        pending names: a request admitted in the same step may already share them (a step writes
        all its new KV before any attention reads it); other steps see them once commit() says
        the step completed."""
        self.reserve(seq, num_tokens)
        if self.cache.config.enable_prefix_caching:
            # only blocks full of known tokens get a name: positions past len(tokens) hold draft
            # tokens under verification, which may be rejected
            while len(seq.names) < min(num_tokens, len(tokens)) // self.bs:
                i = len(seq.names)
                name = block_hash(seq.names[-1] if seq.names else b"", tokens[i * self.bs:(i + 1) * self.bs])
                self.pool.name(seq.table[i], name)
                seq.names.append(name)

    def reserve(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Grows seq's table to cover positions [0, num_tokens) without naming any block (for
        writes the target's step does not make, such as a draft model's)."""
        seq.table.extend(self.pool.allocate(self.blocks_needed(seq, num_tokens)))

    def computed(self, seq: SeqBlocks, num_computed: int) -> None:
        """Applies the window policy once `num_computed` tokens have their KV: blocks no future
        query can see go back to the pool (the table keeps -1 in their place)."""
        if self.window:
            for i in range(self.first_needed(num_computed)):
                if seq.table[i] >= 0:
                    self.pool.release([seq.table[i]])
                    seq.table[i] = -1

    def free(self, seq: SeqBlocks) -> None:
        self.pool.release([b for b in reversed(seq.table) if b >= 0])
        seq.table, seq.names = [], []

    def truncate(self, seq: SeqBlocks, num_blocks: int, num_names: int) -> None:
        """Shrinks seq back to its first num_blocks blocks and num_names names (undoing a step's growth)."""
        self.pool.release([b for b in reversed(seq.table[num_blocks:]) if b >= 0])
        del seq.table[num_blocks:], seq.names[num_names:]

    def commit(self) -> None:
        """The step has completed: its blocks' names become findable by prefix lookup."""
        self.pool.commit()

    def discard_pending(self) -> None:
        """The step failed: the names it gave are dropped (call after undoing its allocations)."""
        self.pool.discard_pending()

    def usage(self) -> dict:
        return {"blocks_total": self.pool.num_blocks, "blocks_used": self.pool.num_used(),
                "blocks_cached_unused": len(self.pool.lru), "blocks_free": len(self.pool.free),
                "prefix_hit_rate": round(self.stats.hit_rate, 4), "evictions": self.pool.evictions}
