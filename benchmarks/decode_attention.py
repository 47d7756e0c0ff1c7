"""Batch-1 decode attention at long contexts: the native paged kernel (paged_decode.cpp) with its
positions split over the threads where a row's kv heads do not share out evenly over them (the
default), the same kernel batch-invariant (never split), and torch's scaled_dot_product_attention
(enable_gqa) on the same keys and values laid out contiguously, in one process.

Shapes: SmolLM2-135M (9 query heads on 3 kv heads, head size 64) and Gemma 3 1B (4 on 1, head
size 256), bf16 cache in blocks of 16 positions at scattered block ids. One call is one layer;
each measurement runs 30 layers, each with its own cache (the caches together outgrow L2, as a
model's do): ours as one step program (one native call), torch's as 30 calls from Python.
Rounds alternate the three; the table shows medians of the rounds' per-layer microseconds and the
per-round ratios go to benchmarks/results/<--result>.

    python benchmarks/decode_attention.py [--rounds 5] [--contexts 256,1024,4096] [--result decode_attention.json]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from results_file import write_result

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Gemma 3 1B": (4, 1, 256)}  # query heads, kv heads, head size
LAYERS, BLOCK = 30, 16


def layers(h: int, hkv: int, d: int, length: int, seed: int) -> list[dict]:
    """LAYERS layers' query, paged cache (scattered blocks), table and the same keys and values
    contiguous [1, Hkv, L, D] for torch."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-length // BLOCK)
    out = []
    for _ in range(LAYERS):
        cache = torch.randn(2, blocks + 8, BLOCK, hkv, d, generator=g).bfloat16()
        table = torch.randperm(blocks + 8, generator=g)[:blocks].view(1, blocks)
        kv = cache[:, table[0]].reshape(2, blocks * BLOCK, hkv, d)[:, :length]
        out.append({"q": torch.randn(1, h * d, generator=g).bfloat16(), "cache": cache, "table": table,
                    "lens": torch.tensor([length]), "out": torch.empty(1, h * d, dtype=torch.bfloat16),
                    "k": kv[0].permute(1, 0, 2).contiguous()[None], "v": kv[1].permute(1, 0, 2).contiguous()[None]})
    return out


def timed(fn, reps: int) -> float:
    """Median seconds of fn() over reps calls, after a few unmeasured ones."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--contexts", default="256,1024,4096", help="comma-separated context lengths")
    ap.add_argument("--result", default="decode_attention.json", help="the file under benchmarks/results/ to write")
    a = ap.parse_args()
    from deepfuse.codegen.cpu.native import kernels

    native = kernels()
    if native is None:
        raise SystemExit("the native CPU kernels did not build on this machine")
    rows, table = [], []
    for model, (h, hkv, d) in SHAPES.items():
        for length in (int(c) for c in a.contexts.split(",")):
            ls = layers(h, hkv, d, length, seed=length)
            programs = {}
            for split in (True, False):
                p = native.StepProgram()
                for x in ls:
                    p.paged_decode(x["q"], x["cache"], x["table"], x["lens"], h, 0, d ** -0.5, x["out"], 2, not split)
                programs[split] = p
            with torch.inference_mode():
                want = F.scaled_dot_product_attention(ls[0]["q"].view(1, h, 1, d), ls[0]["k"], ls[0]["v"],
                                                      enable_gqa=True).reshape(1, h * d)
            programs[True].run()
            torch.testing.assert_close(ls[0]["out"].float(), want.float(), atol=2e-2, rtol=2e-2)  # the same attention

            def torch_layers(ls=ls, h=h, d=d):
                with torch.inference_mode():
                    for x in ls:
                        F.scaled_dot_product_attention(x["q"].view(1, h, 1, d), x["k"], x["v"], enable_gqa=True)

            reps = max(20, 4000 // length)
            us = {"split": [], "never split": [], "torch sdpa": []}
            for r in range(a.rounds):
                order = [("split", programs[True].run), ("never split", programs[False].run),
                         ("torch sdpa", torch_layers)]
                for name, fn in order[r % 3:] + order[:r % 3]:
                    us[name].append(timed(fn, reps) / LAYERS * 1e6)
            med = {k: statistics.median(v) for k, v in us.items()}
            row = {"model": model, "heads": h, "kv_heads": hkv, "head_size": d, "context": length,
                   "us_per_layer": med, "us_per_layer_per_round": us,
                   "split_vs_never_per_round": [b / s for s, b in zip(us["split"], us["never split"])],
                   "split_vs_torch_per_round": [t / s for s, t in zip(us["split"], us["torch sdpa"])]}
            rows.append(row)
            table.append(f"{model:14s} {length:7d} {med['split']:9.2f} {med['never split']:12.2f} "
                         f"{med['torch sdpa']:11.2f} {med['never split'] / med['split']:10.2f}x "
                         f"{med['torch sdpa'] / med['split']:9.2f}x")
    print(f"batch-1 decode attention, bf16, {torch.get_num_threads()} threads, us per layer "
          f"(median of {a.rounds} rounds of {LAYERS} layers)")
    print(f"{'model':14s} {'context':>7s} {'split':>9s} {'never split':>12s} {'torch sdpa':>11s} "
          f"{'vs never':>11s} {'vs torch':>10s}")
    print("\n".join(table))
    path = write_result(a.result, {"config": {"rounds": a.rounds, "layers": LAYERS, "block": BLOCK,
                                              "threads": torch.get_num_threads()}, "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
