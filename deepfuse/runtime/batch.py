"""Step inputs: turns (sequence, new tokens) pairs into the tensors the step graph takes.

Shapes follow models.llama.step_specs: tokens/positions/slot_mapping [T],
block_tables [S,B] (B: the longest table rounded up to a power of two; unused entries 0),
per-sequence [S] tensors, and the sampled rows [R]
with their sampling parameters (a chunk samples its last `samples` tokens: 1, k+1 when
k draft tokens are verified, or every row of a prompt chunk whose prompt logprobs are asked for)
and draft_tokens [R], the draft each sampled row verifies (-1: none).
StepBuffers holds them preallocated (numpy arrays shared with torch): no input tensor is
allocated per step.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from .kv_cache import KVCache, SeqBlocks


@dataclass
class SeqChunk:
    """tokens: the new token ids of one sequence; start: position of the first one;
    blocks: its block table (-1 = a block the window policy released)."""

    tokens: list[int]
    start: int
    blocks: list[int]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    samples: int = 1  # how many of its last tokens get a sampled next token
    verify: bool = True  # with samples > 1: each sampled row but the last verifies the next row's token as a draft
    sliding_blocks: list[int] | None = None  # a hybrid model's sliding-group table (kv_cache.SeqBlocks)
    sliding_start: int = 0  # the first position the sliding group holds (a multiple of the block size)
    replay_end: int = 0  # positions below it write their full-attention k/v to the scratch block

    @staticmethod
    def of(kv: SeqBlocks, tokens: list[int], start: int, **sampling) -> SeqChunk:
        """A chunk over a sequence's blocks in every cache group."""
        more = dict(sliding_blocks=kv.tables[1], sliding_start=kv.sliding_start) if len(kv.tables) > 1 else {}
        return SeqChunk(tokens, start, kv.tables[0], replay_end=kv.replay_end, **more, **sampling)


def sample_keys(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Counter-based RNG keys for (request seed, position): splitmix64 of seed * golden + position + 1,
    kept to 63 bits. seeds [R] uint64 (each seed mod 2^64), positions [R] -> int64 [R] (uint64
    arithmetic wraps mod 2^64)."""
    z = seeds * np.uint64(0x9E3779B97F4A7C15) + positions.astype(np.uint64) + np.uint64(1)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return ((z ^ (z >> np.uint64(31))) & np.uint64(0x7FFFFFFFFFFFFFFF)).astype(np.int64)


U64 = 0xFFFFFFFFFFFFFFFF


def sample_key(seed: int, position: int) -> int:
    """sample_keys for one row in Python integers (seed taken mod 2^64)."""
    z = ((seed & U64) * 0x9E3779B97F4A7C15 + position + 1) & U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & U64
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


class StepBuffers:
    """Preallocated step inputs for up to max_tokens tokens, max_seqs sequences and
    max_blocks blocks per sequence; fill() writes one step and returns views. arrays: buffers to
    write some inputs into instead of new ones (graphed_decode.py's staging views), of these shapes
    and dtypes. incremental: a decode step after one of the same sequences writes only what moves
    (tokens, positions, slots, seq_lens, seeds), for an owner that writes nothing else into the
    buffers between fills."""

    # incremental decode steps of at most this many sequences are written row by row in Python
    # (memoryview stores, no numpy calls): after a step's weights have swept the caches each numpy
    # call costs microseconds, and at one sequence the whole-step numpy write took ~75 us
    ROW_WRITES = 8

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, arrays: dict[str, np.ndarray] | None = None,
                 incremental: bool = False):
        if incremental and arrays:
            raise ValueError("incremental buffers must be the fill's own: arrays are written by their owner too")
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        i64 = lambda *shape: np.zeros(shape, dtype=np.int64)
        self.np = {"tokens": i64(max_tokens), "positions": i64(max_tokens), "slot_mapping": i64(max_tokens),
                   "block_tables": i64(max_seqs, max_blocks), "seq_lens": i64(max_seqs),
                   "query_lens": i64(max_seqs), "sample_rows": i64(max_tokens),
                   "temperature": np.zeros(max_tokens, dtype=np.float32), "top_k": i64(max_tokens),
                   "top_p": np.zeros(max_tokens, dtype=np.float32), "seeds": i64(max_tokens),
                   "draft_tokens": i64(max_tokens), "slot_mapping.sliding": i64(max_tokens),
                   "block_tables.sliding": i64(max_seqs, max_blocks), "seq_lens.sliding": i64(max_seqs)}
        for k, a in (arrays or {}).items():
            if a.shape != self.np[k].shape or a.dtype != self.np[k].dtype:
                raise ValueError(f"{k}: {a.dtype}{list(a.shape)} given, {self.np[k].dtype}{list(self.np[k].shape)} needed")
            self.np[k] = a
        self.torch = {k: torch.from_numpy(v) for k, v in self.np.items()}
        # the last fill's decode step: (cache, per chunk (blocks, temperature, top_k, top_p, seed),
        # seeds uint64[S], table width); None when it was no plain decode step
        self._decode: tuple | None = None
        self._last: dict[str, torch.Tensor] | None = None  # the last fill's inputs (refill: a decode step's only)
        self._last_shape: tuple | None = None  # (t, s, r, width, cache) of the last fill
        self.incremental = incremental
        self._kv_names: list[str] = []  # "kv_cache.{i}" for each layer of the last cache filled
        self._rows = {k: memoryview(self.np[k].reshape(-1)) for k in  # flat views of the fill's own buffers
                      ("tokens", "positions", "slot_mapping", "seq_lens", "seeds", "block_tables")} if incremental else {}

    def fill(self, chunks: list[SeqChunk], cache: KVCache) -> dict[str, torch.Tensor]:
        """Writes the step's chunks (whole-step numpy operations, no per-chunk ones: a decode
        step of 64 sequences took ~0.7 ms chunk by chunk) and returns the inputs as views. A
        decode step that follows one of the same sequences writes only what moved (_next_decode)."""
        if self._next_decode(chunks, cache):
            return self._views(len(chunks), len(chunks), len(chunks), self._decode[3], cache)
        self._decode = self._last = None  # until this fill has written its whole step
        b, bs, s = self.np, cache.block_size, len(chunks)
        lens, widths, ks, starts, top_k = np.array(
            [(len(c.tokens), len(c.blocks), c.samples, c.start, c.top_k) for c in chunks], dtype=np.int64).reshape(s, 5).T
        t, width, r = int(lens.sum()), int(widths.max()), int(ks.sum())
        if t > self.max_tokens or s > self.max_seqs or width > self.max_blocks:
            raise ValueError(f"step of {t} tokens, {s} sequences, {width} blocks exceeds the buffers "
                             f"({self.max_tokens}, {self.max_seqs}, {self.max_blocks})")
        bad = np.flatnonzero((ks < 1) | (ks > lens))
        if len(bad):
            raise ValueError(f"a chunk of {lens[bad[0]]} tokens cannot sample its last {ks[bad[0]]}")
        # the table width rounded up to a power of two: a decode step whose sequences gain a block
        # mostly keeps its layout, and the executor the calls it bound for it (codegen/cpu/bound.py)
        width = min(self.max_blocks, 1 << (max(width, 1) - 1).bit_length())
        tables = b["block_tables"][:s, :width]
        tables[...] = 0
        tables[np.arange(width) < widths[:, None]] = np.fromiter(
            chain.from_iterable(c.blocks for c in chunks), dtype=np.int64, count=int(widths.sum()))
        np.maximum(tables, 0, out=tables)  # -1: a block the window policy released
        seq = np.repeat(np.arange(s), lens)  # each token's chunk
        first = np.cumsum(lens) - lens  # each chunk's first row
        pos = starts[seq] + np.arange(t) - first[seq]
        block = pos // bs
        past = block >= widths[seq]
        if past.any():
            i = int(seq[np.argmax(past)])
            raise ValueError(f"a chunk at positions {starts[i]}..{starts[i] + lens[i] - 1} has a table of "
                             f"{widths[i]} blocks of {bs}")
        tokens = np.fromiter(chain.from_iterable(c.tokens for c in chunks), dtype=np.int64, count=t)
        b["tokens"][:t] = tokens
        b["positions"][:t] = pos
        slots = tables[seq, block] * bs + pos % bs
        replay_end = np.array([c.replay_end for c in chunks], dtype=np.int64)
        if replay_end.any():  # replayed positions: their full-attention k/v are cached already
            if cache.scratch_block is None:
                raise ValueError("a replayed chunk needs a cache with a scratch block (swa_replay_tokens > 0)")
            slots = np.where(pos < replay_end[seq], cache.scratch_block * bs + pos % bs, slots)
        b["slot_mapping"][:t] = slots
        if len(cache.groups) > 1:
            self._fill_sliding(chunks, pos, seq, starts + lens, width, bs)
        b["seq_lens"][:s], b["query_lens"][:s] = starts + lens, lens
        # sampled rows: a chunk's last k tokens; the row at position p samples position p + 1's token
        sseq = np.repeat(np.arange(s), ks)
        j = np.arange(r) - (np.cumsum(ks) - ks)[sseq]  # 0 .. k-1 within the chunk
        rows = first[sseq] + lens[sseq] - ks[sseq] + j
        b["sample_rows"][:r] = rows
        temperature, top_p = np.array([(c.temperature, c.top_p) for c in chunks], dtype=np.float32).reshape(s, 2).T
        b["temperature"][:r], b["top_k"][:r], b["top_p"][:r] = temperature[sseq], top_k[sseq], top_p[sseq]
        seeds = np.array([c.seed & 0xFFFFFFFFFFFFFFFF for c in chunks], dtype=np.uint64)
        b["seeds"][:r] = sample_keys(seeds[sseq], pos[rows] + 1)
        # each row but its chunk's last verifies the draft the next row was fed (chunks that verify)
        verify = np.array([c.verify for c in chunks], dtype=bool)
        b["draft_tokens"][:r] = np.where((j < ks[sseq] - 1) & verify[sseq], tokens[np.minimum(rows + 1, t - 1)], -1)
        if self.incremental and t == s == r and len(cache.groups) == 1 and not replay_end.any():  # decode
            self._decode = (cache, [(list(c.blocks), c.temperature, c.top_k, c.top_p, c.seed) for c in chunks],
                            seeds, width)
        return self._views(t, s, r, width, cache)

    def refill(self, chunks: list[SeqChunk], cache: KVCache) -> dict[str, torch.Tensor] | None:
        """A decode step of the last fill's sequences (as fill's incremental case: the same cache,
        one cache group, the same blocks, sampling and seeds, one token each, no replay) written
        into the memory of the last fill's inputs, and those inputs returned: the same dict and
        tensors, for an owner that reruns the last step's prepared calls over them (the engine's
        one-step decode, CpuExecutor.rerun), which fresh views would make it look up again. None
        (nothing written) for any other step. A caller that then cannot rerun takes fresh_views()."""
        if self._last is None or not self._next_decode(chunks, cache):
            return None
        return self._last

    def fresh_views(self) -> dict[str, torch.Tensor]:
        """New views of the step the last fill or refill wrote (the same memory), as fill returns
        them (kernels key per-step work on their inputs' identity); they become the last fill's."""
        return self._views(*self._last_shape)

    def advance_decode(self, tokens: list[int]) -> bool:
        """The last decode step's sequences one position on, each fed its token of `tokens`, for an
        owner that reruns the last step's tensors (runtime/decode_burst.py, the executor's rerun):
        writes tokens, positions, slots, seq_lens and seeds into the memory the last fill's views
        show. False (nothing written) where the last fill was no incremental decode step of
        len(tokens) sequences, or where a sequence's next position lies past its table."""
        last = self._decode
        if last is None or len(tokens) != len(last[1]):
            return False
        s = len(tokens)
        if s <= self.ROW_WRITES:
            positions = [p + 1 for p in self._rows["positions"][:s]]
        else:
            positions = self.np["positions"][:s] + 1
        return self._write_decode(tokens, positions, last)

    def _next_decode(self, chunks: list[SeqChunk], cache: KVCache) -> bool:
        """Writes a decode step whose chunks are those of the last fill at any position their
        tables cover (same blocks, sampling and seed, one token, one sample): tokens, positions,
        slots, seq_lens and seeds; every other input stays as the last fill wrote it. False
        (nothing written) for any other step."""
        last = self._decode
        if last is None or last[0] is not cache or len(cache.groups) != 1 or len(chunks) != len(last[1]):
            return False
        for c, (blocks, temperature, top_k, top_p, seed) in zip(chunks, last[1]):
            if (len(c.tokens) != 1 or c.samples != 1 or c.replay_end or c.temperature != temperature
                    or c.top_k != top_k or c.top_p != top_p or c.seed != seed or c.blocks != blocks):
                return False
        s = len(chunks)
        tokens = [c.tokens[0] for c in chunks]
        if s <= self.ROW_WRITES:
            positions = [c.start for c in chunks]
        else:
            positions = np.fromiter((c.start for c in chunks), dtype=np.int64, count=s)
        return self._write_decode(tokens, positions, last)

    def _write_decode(self, tokens: list[int], positions, last: tuple) -> bool:
        """Writes a decode step of the last fill's sequences (`last`: its tables, sampling and
        seeds), sequence i fed tokens[i] at positions[i]: tokens, positions, slots, seq_lens and
        seeds. Up to ROW_WRITES sequences row by row (positions: a list), numpy beyond (positions:
        int64[S]). False (nothing written) where a position lies outside its sequence's table."""
        s, bs = len(tokens), last[0].block_size
        if s <= self.ROW_WRITES:
            if any(not 0 <= p // bs < len(chunk[0]) for p, chunk in zip(positions, last[1])):
                return False
            self._decode = None  # until the step is written (an interrupted one leaves the next a whole fill)
            m, width = self._rows, self.max_blocks
            tables = m["block_tables"]
            for i, (tok, p, chunk) in enumerate(zip(tokens, positions, last[1])):
                m["tokens"][i], m["positions"][i] = tok, p
                m["slot_mapping"][i] = tables[i * width + p // bs] * bs + p % bs
                m["seq_lens"][i] = p + 1
                m["seeds"][i] = sample_key(chunk[4], p + 1)
        else:
            block = positions // bs
            if ((block < 0) | (block >= np.array([len(chunk[0]) for chunk in last[1]]))).any():
                return False
            self._decode = None  # until the step is written
            b = self.np
            b["tokens"][:s] = tokens
            b["positions"][:s] = positions
            b["slot_mapping"][:s] = b["block_tables"][np.arange(s), block] * bs + positions % bs
            b["seq_lens"][:s] = positions + 1
            b["seeds"][:s] = sample_keys(last[2], positions + 1)
        self._decode = last
        return True

    def _views(self, t: int, s: int, r: int, width: int, cache: KVCache) -> dict[str, torch.Tensor]:
        """The step's inputs as fresh views of the buffers (kernels key per-step work on the
        identity of their input tensors: RopeTables.per_step, attention's layouts), and the
        cache's layers; they become the last fill's (refill, fresh_views)."""
        self._last_shape = (t, s, r, width, cache)
        v = self.torch
        inputs = {k: v[k][:t] for k in ("tokens", "positions", "slot_mapping")}
        inputs["block_tables"] = v["block_tables"][:s, :width]
        inputs.update({k: v[k][:s] for k in ("seq_lens", "query_lens")})
        inputs.update({k: v[k][:r] for k in ("sample_rows", "temperature", "top_k", "top_p", "seeds", "draft_tokens")})
        if len(cache.groups) > 1:
            inputs.update({"slot_mapping.sliding": v["slot_mapping.sliding"][:t],
                           "block_tables.sliding": v["block_tables.sliding"][:s, :width],
                           "seq_lens.sliding": v["seq_lens.sliding"][:s]})
        if len(self._kv_names) != len(cache.layers):
            self._kv_names = [f"kv_cache.{i}" for i in range(len(cache.layers))]
        inputs.update(zip(self._kv_names, cache.layers))
        self._last = inputs
        return inputs

    def _fill_sliding(self, chunks: list[SeqChunk], pos: np.ndarray, seq: np.ndarray, ends: np.ndarray, width: int,
                      bs: int) -> None:
        """The sliding group's inputs: its table from the chunk's sliding_start on, so its positions
        (and seq_lens.sliding) count from there."""
        if any(c.sliding_blocks is None for c in chunks):
            raise ValueError("a hybrid model's step needs every chunk's sliding_blocks")
        b, s = self.np, len(chunks)
        first = np.array([c.sliding_start // bs for c in chunks], dtype=np.int64)
        widths = np.array([len(c.sliding_blocks) for c in chunks], dtype=np.int64) - first
        tables = b["block_tables.sliding"][:s, :width]
        tables[...] = 0
        tables[np.arange(width) < widths[:, None]] = np.fromiter(
            chain.from_iterable(c.sliding_blocks[f:] for c, f in zip(chunks, first.tolist())), dtype=np.int64,
            count=int(widths.sum()))
        np.maximum(tables, 0, out=tables)
        local = pos - first[seq] * bs
        block = local // bs
        if (local < 0).any() or (block >= widths[seq]).any():
            i = int(seq[np.argmax((local < 0) | (block >= widths[seq]))])
            raise ValueError(f"a chunk's sliding table ({widths[i]} blocks from position {first[i] * bs}) does not "
                             "cover its positions")
        b["slot_mapping.sliding"][:len(pos)] = tables[seq, block] * bs + local % bs
        b["seq_lens.sliding"][:s] = ends - first * bs


def build_step(chunks: list[SeqChunk], cache: KVCache) -> dict[str, torch.Tensor]:
    """One step's inputs in fresh buffers, growing each chunk's block table as needed. A hybrid
    model's chunk without sliding_blocks uses its table's ids in the sliding group too (a cache
    whose sliding group has as many blocks as group 0, used by no one else)."""
    for c in chunks:
        cache.ensure_capacity(c.blocks, c.start + len(c.tokens))
        if len(cache.groups) > 1 and c.sliding_blocks is None:
            if cache.pools[1].num_blocks < cache.pool.num_blocks:
                raise ValueError("build_step shares a chunk's block ids with the sliding group: it needs as many blocks")
            c.sliding_blocks = c.blocks
    bufs = StepBuffers(sum(len(c.tokens) for c in chunks), len(chunks), max(len(c.blocks) for c in chunks))
    return bufs.fill(chunks, cache)
