"""Step inputs: turns (sequence, new tokens) pairs into the tensors the step graph takes.

Shapes follow models.llama.step_specs: tokens/positions/slot_mapping [T],
block_tables [S,B] (unused entries 0), per-sequence [S] tensors, and the sampled rows [R]
with their sampling parameters (a chunk samples its last `samples` tokens: 1, or k+1 when
k draft tokens are verified) and draft_tokens [R], the draft each sampled row verifies.
StepBuffers holds them preallocated (numpy arrays shared with torch): no input tensor is
allocated per step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kv_cache import KVCache


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


def sample_key(seed: int, position: int) -> int:
    """Counter-based RNG key for (request seed, position): splitmix64, kept to 63 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


class StepBuffers:
    """Preallocated step inputs for up to max_tokens tokens, max_seqs sequences and
    max_blocks blocks per sequence; fill() writes one step and returns views."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        i64 = lambda *shape: np.zeros(shape, dtype=np.int64)
        self.np = {"tokens": i64(max_tokens), "positions": i64(max_tokens), "slot_mapping": i64(max_tokens),
                   "block_tables": i64(max_seqs, max_blocks), "seq_lens": i64(max_seqs),
                   "query_lens": i64(max_seqs), "sample_rows": i64(max_tokens),
                   "temperature": np.zeros(max_tokens, dtype=np.float32), "top_k": i64(max_tokens),
                   "top_p": np.zeros(max_tokens, dtype=np.float32), "seeds": i64(max_tokens),
                   "draft_tokens": i64(max_tokens)}
        self.torch = {k: torch.from_numpy(v) for k, v in self.np.items()}

    def fill(self, chunks: list[SeqChunk], cache: KVCache) -> dict[str, torch.Tensor]:
        b, bs = self.np, cache.block_size
        t, s = sum(len(c.tokens) for c in chunks), len(chunks)
        width = max(len(c.blocks) for c in chunks)
        if t > self.max_tokens or s > self.max_seqs or width > self.max_blocks:
            raise ValueError(f"step of {t} tokens, {s} sequences, {width} blocks exceeds the buffers "
                             f"({self.max_tokens}, {self.max_seqs}, {self.max_blocks})")
        a = r = 0
        for i, c in enumerate(chunks):
            n = len(c.tokens)
            table = np.maximum(np.asarray(c.blocks, dtype=np.int64), 0)
            pos = np.arange(c.start, c.start + n)
            b["tokens"][a:a + n] = c.tokens
            b["positions"][a:a + n] = pos
            b["slot_mapping"][a:a + n] = table[pos // bs] * bs + pos % bs
            b["block_tables"][i, : len(table)] = table
            b["block_tables"][i, len(table):width] = 0
            b["seq_lens"][i], b["query_lens"][i] = c.start + n, n
            k = c.samples
            if not 1 <= k <= n:
                raise ValueError(f"a chunk of {n} tokens cannot sample its last {k}")
            b["sample_rows"][r:r + k] = np.arange(a + n - k, a + n)
            b["temperature"][r:r + k], b["top_k"][r:r + k], b["top_p"][r:r + k] = c.temperature, c.top_k, c.top_p
            # the row at position p samples the token of position p + 1
            b["seeds"][r:r + k] = [sample_key(c.seed, p + 1) for p in range(c.start + n - k, c.start + n)]
            # each row but the last verifies the draft the next row was fed
            b["draft_tokens"][r:r + k - 1] = c.tokens[n - k + 1:]
            b["draft_tokens"][r + k - 1] = -1
            a += n
            r += k
        v = self.torch
        inputs = {k: v[k][:t] for k in ("tokens", "positions", "slot_mapping")}
        inputs["block_tables"] = v["block_tables"][:s, :width]
        inputs.update({k: v[k][:s] for k in ("seq_lens", "query_lens")})
        inputs.update({k: v[k][:r] for k in ("sample_rows", "temperature", "top_k", "top_p", "seeds", "draft_tokens")})
        for i, layer in enumerate(cache.layers):
            inputs[f"kv_cache.{i}"] = layer
        return inputs


def build_step(chunks: list[SeqChunk], cache: KVCache) -> dict[str, torch.Tensor]:
    """One step's inputs in fresh buffers, growing each chunk's block table as needed."""
    for c in chunks:
        cache.ensure_capacity(c.blocks, c.start + len(c.tokens))
    bufs = StepBuffers(sum(len(c.tokens) for c in chunks), len(chunks), max(len(c.blocks) for c in chunks))
    return bufs.fill(chunks, cache)
