"""Paged KV cache: per-layer block tensors and a block allocator.

Layer i's cache is one tensor [2, N, BS, Hkv, hd] (k and v). A sequence owns a list
of block ids (its block table); token at position p lives in slot
block_table[p // BS] * BS + p % BS. This module owns memory; it does not schedule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import DeepfuseError


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 512  # total tokens cached = num_blocks * block_size

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.num_blocks < 1:
            raise DeepfuseError(f"cache block_size and num_blocks must be >= 1, got {self.block_size}, {self.num_blocks}")


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise DeepfuseError(f"KV cache exhausted: need {n} more blocks, {len(self.free)} free; "
                                "raise num_blocks or lower max_tokens")
        return [self.free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self.free.extend(reversed(blocks))


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, config: CacheConfig):
        self.config = config
        shape = (2, config.num_blocks, config.block_size, num_kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.allocator = BlockAllocator(config.num_blocks)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def ensure_capacity(self, blocks: list[int], num_tokens: int) -> None:
        """Grows `blocks` in place so it covers num_tokens positions."""
        need = -(-num_tokens // self.block_size) - len(blocks)
        if need > 0:
            blocks.extend(self.allocator.allocate(need))

    def slot(self, blocks: list[int], position: int) -> int:
        return blocks[position // self.block_size] * self.block_size + position % self.block_size
