"""KV cache groups: the layers that share one block table.

A model whose layers all attend the same way has one group. A hybrid model (Gemma 3: sliding-window
layers between full-attention ones) has two: the full-attention layers keep every position, the
sliding layers only their window, so each group has its own blocks, block tables and pool
(runtime/kv_cache.py). The first group's step inputs are `slot_mapping`, `block_tables` and
`seq_lens`; the sliding group of a hybrid model adds `slot_mapping.sliding`, `block_tables.sliding`
and `seq_lens.sliding`, and its layers' caches have their own block count (dim "NW").

The sliding group's positions may start later than the sequence's (`seq_lens.sliding` =
seq_lens - start): bounded replay rebuilds a sliding window from a cached prefix's last tokens only,
and the keys before the replayed span do not exist for those layers.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import DeepfuseError


@dataclass(frozen=True)
class CacheGroup:
    window: int  # 0: full causal attention
    layers: tuple[int, ...]
    suffix: str  # "" or ".sliding": the group's step inputs are slot_mapping{suffix}, ...
    blocks_dim: str  # the symbolic block count of its layers' caches: "N" or "NW"


def cache_groups(config) -> list[CacheGroup]:
    """config: any family's config with num_layers and window_of(i)."""
    windows = [config.window_of(i) for i in range(config.num_layers)]
    distinct = sorted(set(windows))
    if len(distinct) == 1:
        return [CacheGroup(distinct[0], tuple(range(config.num_layers)), "", "N")]
    if len(distinct) > 2 or distinct[0] != 0:
        raise DeepfuseError(f"layers with attention windows {distinct}: one sliding window besides full "
                            "attention is supported")
    layers = lambda w: tuple(i for i, x in enumerate(windows) if x == w)
    return [CacheGroup(0, layers(0), "", "N"), CacheGroup(distinct[1], layers(distinct[1]), ".sliding", "NW")]


def is_hybrid(config) -> bool:
    return len(cache_groups(config)) > 1


def layer_inputs(config, slot_mapping, block_tables, seq_lens, rest) -> tuple[list[tuple], list]:
    """Splits a step's trailing inputs `rest` (the sliding group's slot_mapping, block_tables and
    seq_lens for a hybrid model, then one cache per layer) into each layer's (slot_mapping,
    block_tables, seq_lens) and the caches."""
    groups = cache_groups(config)
    own = [(slot_mapping, block_tables, seq_lens)] + [tuple(rest[3 * j:3 * j + 3]) for j in range(len(groups) - 1)]
    caches = list(rest[3 * (len(groups) - 1):])
    if len(caches) != config.num_layers:
        raise DeepfuseError(f"step got {len(caches)} caches for {config.num_layers} layers")
    of_layer = [None] * config.num_layers
    for g, group in enumerate(groups):
        for i in group.layers:
            of_layer[i] = own[g]
    return of_layer, caches
