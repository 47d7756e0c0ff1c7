"""Step inputs: turns (sequence, new tokens) pairs into the tensors the step graph takes.

Shapes follow models.llama.step_specs: tokens/positions/slot_mapping [T],
block_tables [S,B] (padded with 0), per-sequence [S] tensors.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_cache import KVCache


@dataclass
class SeqChunk:
    """tokens: the new token ids of one sequence; start: position of the first one."""

    tokens: list[int]
    start: int
    blocks: list[int]
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


def sample_key(seed: int, position: int) -> int:
    """Counter-based RNG key for (request seed, position): splitmix64, kept to 63 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def build_step(chunks: list[SeqChunk], cache: KVCache) -> dict[str, torch.Tensor]:
    tokens, positions, slots = [], [], []
    for c in chunks:
        cache.ensure_capacity(c.blocks, c.start + len(c.tokens))
        for j, t in enumerate(c.tokens):
            tokens.append(t)
            positions.append(c.start + j)
            slots.append(cache.slot(c.blocks, c.start + j))
    width = max(len(c.blocks) for c in chunks)
    tables = torch.zeros(len(chunks), width, dtype=torch.int64)
    for i, c in enumerate(chunks):
        tables[i, : len(c.blocks)] = torch.tensor(c.blocks, dtype=torch.int64)
    i64 = lambda xs: torch.tensor(xs, dtype=torch.int64)
    inputs = {
        "tokens": i64(tokens), "positions": i64(positions), "slot_mapping": i64(slots),
        "block_tables": tables,
        "seq_lens": i64([c.start + len(c.tokens) for c in chunks]),
        "query_lens": i64([len(c.tokens) for c in chunks]),
        "temperature": torch.tensor([c.temperature for c in chunks], dtype=torch.float32),
        "top_k": i64([c.top_k for c in chunks]),
        "top_p": torch.tensor([c.top_p for c in chunks], dtype=torch.float32),
        "seeds": i64([sample_key(c.seed, c.start + len(c.tokens)) for c in chunks]),
    }
    for i, layer in enumerate(cache.layers):
        inputs[f"kv_cache.{i}"] = layer
    return inputs
