"""What a precision mode costs: SmolLM2-135M's perplexity on held-out text, per compile mode.

The text is this repository's own documentation (README.md and docs/*.md, the first --tokens
tokens): English prose that ships with every checkout, so the run needs no download. Each mode
is deepfuse's compiled CPU step, teacher-forced over the text in chunks of --chunk tokens (every
row's logits: a chunk samples all its rows), continuing one sequence through the paged cache.

Modes: f32 (the GGUF's Q4_1 weights dequantized, f32 activations: the reference), bf16 (weights
and activations in bf16), bf16+int4 (the same Q4_1 weights, bf16 activations), w8a8 in f32 and
bf16 (weights re-quantized to int8 per output row, activations to int8 per row and group of 64),
bf16+int4-head8 (bf16+int4 with the LM head as w8a8's), bf16+int4-a8 (the same int4 weights times
activations quantized to int8 per row and group of 32, the LM head as w8a8's);
"-kv8": with the int8 KV cache (each cached k and v row as int8 with its scale).
Printed: perplexity, its change against f32, and how often each mode's top-1 token agrees with
f32's. Written to benchmarks/results/quality.json.

    python benchmarks/quality.py [--tokens 4096] [--chunk 512] [--modes f32,bf16-int4,bf16-int4-kv8]
"""
from __future__ import annotations

import argparse
import glob
import math
import os

import torch
from results_file import write_result

import deepfuse
from deepfuse.ir.types import DTYPES
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache

# mode: (dtype, quant, kv_cache_dtype)
MODES = {"f32": ("f32", None, None), "bf16": ("bf16", None, None), "bf16-int4": ("bf16", "int4", None),
         "bf16-int4-head8": ("bf16", "int4-head8", None), "bf16-int4-a8": ("bf16", "int4-a8", None),
         "f32-w8a8": ("f32", "w8a8", None), "bf16-w8a8": ("bf16", "w8a8", None),
         "bf16-kv8": ("bf16", None, "int8"), "bf16-int4-kv8": ("bf16", "int4", "int8"),
         "bf16-w8a8-kv8": ("bf16", "w8a8", "int8")}


def held_out_text() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [os.path.join(root, "README.md")] + sorted(glob.glob(os.path.join(root, "docs", "*.md")))
    return "\n\n".join(open(f, encoding="utf-8").read() for f in files)


def teacher_forced_logits(compiled, config, ids: list[int], chunk: int) -> torch.Tensor:
    """Logits [len(ids) - 1, V] (f32) of every next token, the text fed in chunks."""
    kv = compiled.kv_cache_type
    cache = KVCache(config.num_layers, config.num_kv_heads, kv.shape[4], DTYPES[kv.dtype],
                    CacheConfig(block_size=16, num_blocks=-(-len(ids) // 16) + 1))
    blocks, out = [], []
    for start in range(0, len(ids) - 1, chunk):
        tokens = ids[start:min(start + chunk, len(ids) - 1)]
        logits, _, _ = compiled(build_step([SeqChunk(tokens, start, blocks, samples=len(tokens))], cache))
        out.append(logits.float())
    return torch.cat(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--modes", default="f32,bf16,bf16-int4,f32-w8a8,bf16-w8a8")
    args = ap.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)} (available: {', '.join(MODES)})")
    from deepfuse.models import load_model

    model, tok = load_model("smollm2")
    ids = tok.encode(held_out_text())[: args.tokens]
    target = torch.tensor(ids[1:])
    results, ref_top = {}, None
    for mode in args.modes.split(","):
        dtype, quant, kv_cache_dtype = MODES[mode]
        compiled = deepfuse.compile(model, dtype=dtype, quant=quant, kv_cache_dtype=kv_cache_dtype)
        logits = teacher_forced_logits(compiled, model.config, ids, args.chunk)
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="mean").item()
        top = logits.argmax(-1)
        ref_top = top if ref_top is None else ref_top
        results[mode] = {"perplexity": math.exp(nll), "top1_agreement_with_first": float((top == ref_top).float().mean())}
        print(f"{mode:10s} perplexity {math.exp(nll):8.4f}   top-1 agreement with {args.modes.split(',')[0]}: "
              f"{results[mode]['top1_agreement_with_first']:.4f}", flush=True)
    first = next(iter(results.values()))["perplexity"]
    for mode, r in results.items():
        r["perplexity_change"] = r["perplexity"] / first - 1
        print(f"{mode:10s} {100 * r['perplexity_change']:+.2f}% perplexity")
    write_result("quality.json", {"tokens": len(ids), "chunk": args.chunk, "results": results})


if __name__ == "__main__":
    main()
