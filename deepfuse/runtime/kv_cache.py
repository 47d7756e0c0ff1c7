"""Paged KV cache: per-layer block tensors, one block pool per cache group (block_pool.py: reference
counts, prefix names, LRU eviction), and the manager that gives sequences their blocks.

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

from dataclasses import dataclass, field

import torch

from ..errors import DeepfuseError
from ..models.cache_groups import CacheGroup, cache_groups
from .block_pool import BlockPool, block_hash, zeros_on_huge_pages
from .kv_store import DiskKVStore

__all__ = ["BlockPool", "CacheConfig", "KVCache", "KVCacheManager", "SeqBlocks", "block_hash", "kv_bytes_per_sequence"]


@dataclass(frozen=True)
class CacheConfig:
    """block_size: positions per block; num_blocks: blocks of the full-attention layers (the
    context the cache holds is num_blocks * block_size tokens); sliding_blocks: blocks of a hybrid
    model's sliding-window layers (0: the engine sizes them to hold max_num_seqs windows and one
    step's chunk, never more than num_blocks); swa_replay_tokens: bounded replay for hybrid
    models (0: off): a prefix hit whose sliding-window blocks are gone recomputes only the last R
    cached positions (R rounded up to whole blocks) instead of the whole prefix (kv_cache.py's
    module docstring); kv_store: a directory where full blocks also go to disk (kv_store.py),
    found again by prefix after eviction or a restart, at most kv_store_gb GiB."""

    block_size: int = 16
    num_blocks: int = 512
    enable_prefix_caching: bool = True
    sliding_blocks: int = 0
    swa_replay_tokens: int = 0
    kv_store: str | None = None
    kv_store_gb: float = 4.0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise DeepfuseError(f"cache block_size and num_blocks must be >= 1, got {self.block_size}, {self.num_blocks}")
        if self.kv_store is not None and not self.kv_store_gb > 0:
            raise DeepfuseError(f"kv_store_gb must be > 0, got {self.kv_store_gb}")
        if self.sliding_blocks < 0 or self.swa_replay_tokens < 0:
            raise DeepfuseError(f"sliding_blocks and swa_replay_tokens must be >= 0, got {self.sliding_blocks}, "
                                f"{self.swa_replay_tokens}")


class KVCache:
    """The cache tensors of every layer plus one block pool per cache group (models/cache_groups.py).
    Group 0 has config.num_blocks blocks, plus one scratch block when bounded replay is on: a
    replayed position's full-attention k/v go there, so the cached prefix's own stay as they are;
    a hybrid model's sliding group has `sliding_blocks` (its layers' caches are [2,NW,BS,...]).
    With scratch=True every group has a scratch block (the padding rows of graphed decode steps
    write there: runtime/graphed_decode.py)."""

    def __init__(self, num_layers: int, num_kv_heads: int, row: int, dtype: torch.dtype, config: CacheConfig,
                 device: torch.device | str = "cpu", groups: list[CacheGroup] | None = None, sliding_blocks: int = 0,
                 scratch: bool = False):
        """row: elements of one (position, kv head) row: head_dim, or head_dim + 4 for int8 rows
        that end in their scale (ir.opdefs_llm.kv_row_size). device: where the step's kernels
        run (CompiledModel.device); the step writes the cache in place, so it lives there.
        groups: the model's cache groups (default: one group of every layer); sliding_blocks:
        the second group's block count (when 0: config.sliding_blocks, or else num_blocks);
        scratch: reserve a scratch block in every group."""
        self.config = config
        self.groups = groups or [CacheGroup(0, tuple(range(num_layers)), "", "N")]
        counts = [config.num_blocks] + [sliding_blocks or config.sliding_blocks or config.num_blocks] * (len(self.groups) - 1)
        replay = config.swa_replay_tokens > 0 and len(self.groups) > 1
        extra = [int(replay or scratch)] + [int(scratch)] * (len(self.groups) - 1)
        # one past each pool's ids: never handed out (group 0's is scratch_block)
        self.scratch_blocks = [n if e else None for n, e in zip(counts, extra)]
        self.scratch_block = self.scratch_blocks[0]
        self.pools = [BlockPool(n) for n in counts]
        self.pool = self.pools[0]
        self.layers: list[torch.Tensor] = [None] * num_layers
        for group, n, e in zip(self.groups, counts, extra):
            n += e
            shape = (2, n, config.block_size, num_kv_heads, row)
            if torch.device(device).type == "cpu":
                tensors = zeros_on_huge_pages(len(group.layers), shape, dtype)
            else:
                tensors = [torch.zeros(shape, dtype=dtype, device=device) for _ in group.layers]
            for i, t in zip(group.layers, tensors):
                self.layers[i] = t

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def ensure_capacity(self, blocks: list[int], num_tokens: int) -> None:
        """Grows `blocks` (a group-0 table) in place so it covers num_tokens positions."""
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.pool.allocate(need))

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size

    def read_rows(self, table: list[int], num_tokens: int) -> torch.Tensor:
        """The KV of positions [0, num_tokens) under a one-group sequence's block table, as
        [L, 2, num_tokens, kv heads, row] on the host (a copy)."""
        slots = self._slots(table, num_tokens)
        return torch.stack([layer.flatten(1, 2)[:, slots].cpu() for layer in self.layers])

    def write_rows(self, table: list[int], rows: torch.Tensor) -> None:
        """Writes rows [L, 2, T, kv heads, row] (read_rows' layout) into positions [0, T) under table."""
        slots = self._slots(table, rows.shape[2])
        for layer, r in zip(self.layers, rows):
            layer.flatten(1, 2)[:, slots] = r.to(layer.device, layer.dtype)

    def _slots(self, table: list[int], num_tokens: int) -> torch.Tensor:
        if len(self.groups) != 1:
            raise DeepfuseError("KV rows move between caches of one cache group only (not a hybrid model's)")
        pos = torch.arange(num_tokens)
        return torch.tensor(table, dtype=torch.long)[pos // self.block_size] * self.block_size + pos % self.block_size

    def bytes_per_block(self, group: int) -> int:
        """Bytes one block of `group` takes over all its layers."""
        layer = self.layers[self.groups[group].layers[0]]
        return layer[:, 0].numel() * layer.element_size() * len(self.groups[group].layers)


@dataclass
class CacheStats:
    prefix_queries: int = 0  # prompt tokens looked up
    prefix_hits: int = 0  # of which not computed: found cached (or, with replay, before the replayed span)
    replay_hits: int = 0  # prefix hits that rebuilt a sliding window by bounded replay
    replayed_tokens: int = 0  # cached positions recomputed by those
    store_blocks: int = 0  # blocks brought back from the disk store

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


@dataclass
class SeqBlocks:
    """One sequence's share of the cache: a block table per cache group (entry j holds positions
    [j*BS, (j+1)*BS); -1: a block released by the window policy or never held) and the names of
    its full blocks. boundary: the tokens it arrived with, whose last window of sliding blocks
    stays cached after use; sliding_start (a multiple of BS): the first position the sliding
    group holds (> 0 after bounded replay); replay_end: positions below it are replayed, their
    full-attention k/v already cached; named_limit: blocks from this one on are not offered to
    prefix caching (their KV follows an inexact replay)."""

    tables: list[list[int]] = field(default_factory=lambda: [[]])
    names: list[bytes] = field(default_factory=list)
    boundary: int = 0
    sliding_start: int = 0
    replay_end: int = 0
    named_limit: int | None = None
    cached: int = 0  # positions it did not compute at admission (a prefix hit's)

    @property
    def table(self) -> list[int]:
        return self.tables[0]



class KVCacheManager:
    """Gives sequences blocks in every cache group. A group with a window keeps only the blocks
    its future queries can see: blocks wholly before the window are handed back as the sequence
    grows (a full-attention group keeps all). Prefix caching names full blocks by their hash
    chain in every group; a sliding group's released blocks keep their name only where an exact
    hit needs them, the window before the sequence's boundary (the tokens it arrived with), and
    the rest are freed at once. With bounded replay (CacheConfig.swa_replay_tokens) a hybrid
    model's sliding blocks are never cached: a prefix hit rebuilds the window instead."""

    def __init__(self, cache: KVCache, exact_replay: bool = False, store: DiskKVStore | None = None):
        """exact_replay: the model's sliding layers do not depend on positions before a replayed
        span of at least one window (models/yoco.py), so bounded replay gives exact KV. store: a
        disk tier for group 0's blocks (kv_store.py), used where they make a hit on their own: one
        full-attention group, or a hybrid model with bounded replay."""
        self.cache, self.pool, self.pools, self.groups = cache, cache.pool, cache.pools, cache.groups
        self.bs = cache.block_size
        self.window = self.groups[0].window  # of group 0: a one-group model's sliding window
        self.exact_replay = exact_replay
        # with bounded replay a sliding group's blocks are never cached: a hit rebuilds them
        replay = cache.config.swa_replay_tokens and len(self.groups) > 1
        self.replay_tokens = cache.config.swa_replay_tokens if replay else 0  # R; may change between admissions
        self.cached_groups = [g for g, group in enumerate(self.groups) if not (replay and group.window)]
        # the store holds group 0's blocks: enough for a hit where that group attends to
        # everything and is the only one, or where bounded replay rebuilds the sliding group
        usable = (store is not None and store.enabled and not self.groups[0].window
                  and cache.config.enable_prefix_caching and (len(self.groups) == 1 or self.replay_tokens))
        self.store = store if usable else None
        self.stats = CacheStats()

    def new_seq(self, tokens: list[int]) -> SeqBlocks:
        return SeqBlocks([[] for _ in self.groups], boundary=len(tokens))

    def first_needed(self, computed: int, group: int = 0, start: int = 0) -> int:
        """The first block of `group` a sequence with `computed` positions cached still reads: its
        next query, at position `computed`, sees the positions after computed - window (all
        from `start` on without a window)."""
        w = self.groups[group].window
        return max(start, computed + 1 - w) // self.bs if w else start // self.bs

    def _exact_count(self, names: list[bytes]) -> int:
        """The most leading blocks every group holds as an exact hit needs them."""
        count = len(names)
        for g, group in enumerate(self.groups):
            if not group.window:
                count = next((i for i in range(count) if not self.pools[g].holds(names[i])), count)
        while count:  # a missing block j of a sliding group rules out every longer prefix whose window reaches it
            missing = [i for g, group in enumerate(self.groups) if group.window
                       for i in range(self.first_needed(count * self.bs, g), count) if not self.pools[g].holds(names[i])]
            if not missing:
                break
            count = max(missing)
        return count

    def match_prefix(self, tokens: list[int]) -> SeqBlocks:
        """Cached full blocks of `tokens`' prefix, references taken; seq.cached positions need
        no computing. At least the last token is always left to compute (its logits are needed).
        A sliding group's table holds -1 before the window its first query sees. With bounded
        replay (hybrid models), where the full-attention blocks reach further than an exact hit,
        the match keeps them all and starts computing R positions before their end: the sliding
        group holds positions from there on (sliding_start), and the replayed positions' own
        full-attention k/v stay as cached."""
        seq = self.new_seq(tokens)
        if not self.cache.config.enable_prefix_caching:
            return seq
        names, parent = [], b""
        for i in range((len(tokens) - 1) // self.bs):
            parent = block_hash(parent, tokens[i * self.bs:(i + 1) * self.bs])
            names.append(parent)
        if self.store is not None:
            self._load_from_store(names)
        count = self._exact_count(names)
        full = self._replay_reach(names)
        replay = -(-self.replay_tokens // self.bs) * self.bs
        if full and full * self.bs - replay > count * self.bs:
            start = full * self.bs - replay
            seq.tables[0] = [self.pools[0].lookup(n) for n in names[:full]]
            for g in range(1, len(self.groups)):
                seq.tables[g] = [-1] * (start // self.bs)
            seq.names, seq.sliding_start, seq.replay_end = names[:full], start, full * self.bs
            exact = self.exact_replay and replay >= self.groups[1].window
            seq.named_limit = None if exact else full
            seq.cached = start
            return seq
        for g in range(len(self.groups)):
            first = self.first_needed(count * self.bs, g)
            seq.tables[g] = [-1] * first + [self.pools[g].lookup(n) for n in names[first:count]]
        seq.names = names[:count]
        seq.cached = count * self.bs
        return seq

    def _load_from_store(self, names: list[bytes]) -> None:
        """Brings the blocks after the memory cache's run of `names` back from the disk store while
        it has them (and blocks are available): written into group 0's layers, named, unreferenced."""
        pool = self.pools[0]
        i = next((i for i in range(len(names)) if not pool.holds(names[i])), len(names))
        layers = [self.cache.layers[j] for j in self.groups[0].layers]
        while i < len(names) and pool.num_available() and self.store.has(names[i]):
            payload = self.store.load(names[i])
            if payload is None or len(payload) != sum(layer[:, 0].numel() * layer.element_size() for layer in layers):
                break
            block = pool.allocate(1)[0]
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            at = 0
            for layer in layers:
                view = layer[:, block]
                n = view.numel() * view.element_size()
                view.copy_(raw[at:at + n].view(layer.dtype).view(view.shape))
                at += n
            pool.adopt(block, names[i])
            self.stats.store_blocks += 1
            i += 1

    def _store_blocks(self, committed: list[tuple[int, bytes]]) -> None:
        """Queues the blocks a step completed for the disk store (a copy of their rows now)."""
        layers = [self.cache.layers[j] for j in self.groups[0].layers]
        for block, name in committed:
            if not self.store.has(name):
                rows = torch.cat([layer[:, block].contiguous().view(-1).view(torch.uint8) for layer in layers])
                self.store.put(name, rows.cpu().numpy().tobytes())

    def _replay_reach(self, names: list[bytes]) -> int:
        """Leading blocks the full-attention group holds, where bounded replay may use them (0: off)."""
        if not self.replay_tokens:
            return 0
        return next((i for i in range(len(names)) if not self.pools[0].holds(names[i])), len(names))

    def blocks_needed(self, seq: SeqBlocks, num_tokens: int, group: int = 0) -> int:
        return max(0, -(-num_tokens // self.bs) - len(seq.tables[group]))

    def can_allocate(self, seq: SeqBlocks, num_tokens: int) -> bool:
        return all(self.blocks_needed(seq, num_tokens, g) <= p.num_available() for g, p in enumerate(self.pools))

    def allocate(self, seq: SeqBlocks, tokens: list[int], num_tokens: int) -> None:
        """Grows seq's tables to cover positions [0, num_tokens) of `tokens`, which the step being
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
                if seq.named_limit is None or i < seq.named_limit:
                    for g in self.cached_groups:
                        self.pools[g].name(seq.tables[g][i], name)
                seq.names.append(name)

    def reserve(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Grows seq's tables to cover positions [0, num_tokens) without naming any block (for
        writes the target's step does not make, such as a draft model's, or of tokens the host
        does not have yet: an overlapped step's, overlap.py)."""
        for g, pool in enumerate(self.pools):
            seq.tables[g].extend(pool.allocate(self.blocks_needed(seq, num_tokens, g)))

    def computed(self, seq: SeqBlocks, num_computed: int) -> None:
        """Applies the window policy once `num_computed` tokens have their KV: blocks no future
        query can see go back to their pool (the table keeps -1 in their place); those outside
        the window before seq.boundary lose their name."""
        boundary = seq.boundary // self.bs
        for g, group in enumerate(self.groups):
            if not group.window:
                continue
            table, keep_from = seq.tables[g], self.first_needed(boundary * self.bs, g)
            for i in range(self.first_needed(num_computed, g)):
                if table[i] >= 0:
                    self.pools[g].release([table[i]], forget=not keep_from <= i < boundary)
                    table[i] = -1

    def free(self, seq: SeqBlocks) -> None:
        """Releases seq's blocks in every group (a sequence never admitted has one empty table)."""
        for pool, table in zip(self.pools, seq.tables):
            pool.release([b for b in reversed(table) if b >= 0])
        seq.tables, seq.names = [[] for _ in self.groups], []

    def truncate(self, seq: SeqBlocks, num_blocks: list[int], num_names: int) -> None:
        """Shrinks each of seq's tables back to num_blocks[group] blocks and its names to num_names
        (undoing a step's growth)."""
        for g, pool in enumerate(self.pools):
            pool.release([b for b in reversed(seq.tables[g][num_blocks[g]:]) if b >= 0])
            del seq.tables[g][num_blocks[g]:]
        del seq.names[num_names:]

    def commit(self) -> None:
        """The step has completed: its blocks' names become findable by prefix lookup (and go to
        the disk store, if there is one)."""
        committed = [pool.commit() for pool in self.pools]
        if self.store is not None and committed[0]:
            self._store_blocks(committed[0])

    def discard_pending(self) -> None:
        """The step failed: the names it gave are dropped (call after undoing its allocations)."""
        for pool in self.pools:
            pool.discard_pending()

    def num_used(self) -> int:
        return sum(p.num_used() for p in self.pools)

    def usage(self) -> dict:
        out = {"blocks_total": self.pool.num_blocks, "blocks_used": self.pool.num_used(),
               "blocks_cached_unused": len(self.pool.lru), "blocks_free": len(self.pool.free),
               "prefix_hit_rate": round(self.stats.hit_rate, 4), "evictions": self.pool.evictions}
        for g in range(1, len(self.groups)):
            p, name = self.pools[g], self.groups[g].suffix.lstrip(".")
            out[name] = {"blocks_total": p.num_blocks, "blocks_used": p.num_used(),
                         "blocks_cached_unused": len(p.lru), "evictions": p.evictions}
        if self.store is not None:
            out["kv_store"] = {"blocks": len(self.store.files), "bytes": self.store.bytes,
                               "blocks_loaded": self.stats.store_blocks, "write_errors": self.store.write_errors,
                               "corrupt_dropped": self.store.dropped_corrupt}
        if self.stats.replay_hits:
            out["replay_hits"], out["replayed_tokens"] = self.stats.replay_hits, self.stats.replayed_tokens
        return out


def kv_bytes_per_sequence(config, context: int, block_size: int, row_bytes: int) -> dict[str, int]:
    """Bytes of KV cache one sequence of `context` positions holds at decode, by cache group
    ("full", "sliding"): every block in a full-attention group, at most ceil(W/BS) + 1 in a
    sliding one. row_bytes: one (position, kv head) row of k or v."""
    out = {}
    for group in cache_groups(config):
        blocks = -(-context // block_size)
        if group.window:
            blocks = min(blocks, -(-group.window // block_size) + 1)
        key = "sliding" if group.window else "full"
        out[key] = len(group.layers) * blocks * block_size * 2 * config.num_kv_heads * row_bytes
    return out
