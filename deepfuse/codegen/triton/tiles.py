"""Tile sizes per target and kernel kind, with an autotuning hook.

`interpret` is for Triton's CPU interpreter (small tiles: it runs every lane in numpy).
sm90 (Hopper) wgmma wants M tiles of 64 per warpgroup; sm100 (Blackwell) tcgen05 MMAs are
128 rows. `rows` is the attention program's query rows (query block x padded GQA group).
"""
from __future__ import annotations

from collections.abc import Callable

from ...ir import Node

TILES: dict[str, dict[str, dict]] = {
    "sm90": {"gemm": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3},
             "attention": {"rows": 64, "block_size": 16, "num_warps": 4, "num_stages": 2},
             "row": {"num_warps": 4, "num_stages": 1}},
    "sm100": {"gemm": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3},
              "attention": {"rows": 128, "block_size": 16, "num_warps": 8, "num_stages": 2},
              "row": {"num_warps": 4, "num_stages": 1}},
    "interpret": {"gemm": {"BM": 16, "BN": 32, "BK": 32}, "attention": {"rows": 16, "block_size": 16}, "row": {}},
}

# hooks(arch, kind, node) -> overrides or None, tried in order: an autotuner plugs in here
TUNE_HOOKS: list[Callable[[str, str, Node], dict | None]] = []


def tiles_for(arch: str, kind: str, node: Node) -> dict:
    tiles = dict(TILES[arch][kind])
    for hook in TUNE_HOOKS:
        override = hook(arch, kind, node)
        if override:
            tiles.update(override)
            break
    return tiles
