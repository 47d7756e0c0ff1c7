"""Tile sizes per target and kernel kind, with an autotuning hook.

`interpret` is for Triton's CPU interpreter (small tiles: it runs every lane in numpy).
sm90 (Hopper) wgmma wants M tiles of 64 per warpgroup; sm100 (Blackwell) tcgen05 MMAs are
128 rows. `rows` is the attention program's query rows (query block x padded GQA group).

By M bucket: a GEMM of at most DECODE_ROWS rows (the decode buckets 1, 2, 4, 8, 16, ..., 64)
takes `gemm_decode` (splitk.py: operands swapped, so the weight's rows fill the MMA's M side
and the step's rows its N side, plus a fixed split of K); larger ones `gemm`. Every decode
bucket gets the same tiles and split, so a row's sums are formed in the same order at any M
<= DECODE_ROWS. fused_moe's grouped GEMMs take `moe_decode` up to DECODE_ROWS tokens: blocks of
16 (token, expert) rows, tl.dot's least M (an mma.sync tile: wgmma and tcgen05 want 64 or
128 rows), since a decode step gives each expert a few rows. `attention_decode` is
split_kv.py's: `rows` per q tile, `keys` per key tile.
SMS: the streaming multiprocessors the split sizes aim to fill (H100/H200: 132, B200: 148;
the interpreter's 8 only makes the tests split).
"""
from __future__ import annotations

from collections.abc import Callable

from ...ir import Node

TILES: dict[str, dict[str, dict]] = {
    "sm90": {"gemm": {"BM": 64, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3},
             "gemm_decode": {"BM": 64, "BN": 64, "BK": 32, "num_warps": 4, "num_stages": 3},
             "moe_decode": {"BM": 16, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3},
             "attention_decode": {"rows": 64, "keys": 64, "num_warps": 4, "num_stages": 2},
             "attention": {"rows": 64, "block_size": 16, "num_warps": 4, "num_stages": 2},
             "row": {"num_warps": 4, "num_stages": 1}},
    "sm100": {"gemm": {"BM": 128, "BN": 128, "BK": 64, "num_warps": 4, "num_stages": 3},
              "gemm_decode": {"BM": 64, "BN": 64, "BK": 32, "num_warps": 4, "num_stages": 3},
              "moe_decode": {"BM": 16, "BN": 64, "BK": 64, "num_warps": 4, "num_stages": 3},
              "attention_decode": {"rows": 128, "keys": 64, "num_warps": 8, "num_stages": 2},
              "attention": {"rows": 128, "block_size": 16, "num_warps": 8, "num_stages": 2},
              "row": {"num_warps": 4, "num_stages": 1}},
    "interpret": {"gemm": {"BM": 16, "BN": 32, "BK": 32}, "gemm_decode": {"BM": 16, "BN": 32, "BK": 32},
                  "moe_decode": {"BM": 16, "BN": 16, "BK": 32},
                  "attention": {"rows": 16, "block_size": 16}, "attention_decode": {"rows": 16, "keys": 64}, "row": {}},
}
def pow2(n: int) -> int:
    """The least power of two >= n (tl.arange's lengths), 1 for n <= 1."""
    return 1 << max(0, (max(n, 1) - 1).bit_length())


SMS = {"sm90": 132, "sm100": 148, "interpret": 8}
DECODE_ROWS = 64

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
