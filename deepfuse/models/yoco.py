"""A hybrid model whose sliding-window layers take their keys and values from the embeddings.

Gemma 3's structure (sliding-window layers between full-attention ones, models/gemma3.py), except
that a sliding layer projects k and v from its input norm of the token embeddings rather than of
the layer's hidden state (YOCO-style: the sliding layers read a shared state that depends on
each position's own token only). Their cache at a position is then a function of that token, so
bounded replay (CacheConfig.swa_replay_tokens >= the window) rebuilds exactly the keys every
later query reads: the tokens after a replayed prefix equal those of a full prefill. In Gemma 3
itself a sliding layer's keys depend on everything before them and replay is an approximation.
Same weight names as Gemma 3.
"""
from __future__ import annotations

from dataclasses import dataclass

from .family import Family, register
from .gemma3 import Gemma3, Gemma3Config


@dataclass(frozen=True)
class YocoConfig(Gemma3Config):
    family: str = "yoco_swa"

    @property
    def swa_replay_exact(self) -> bool:
        """Bounded replay of at least one window gives exact KV (kv_cache.KVCacheManager)."""
        return True


class Yoco(Gemma3):
    sliding_kv_from_embeddings = True


register(Family("yoco_swa", YocoConfig, Yoco))  # random-weight tests only: no checkpoint formats
