"""Batch-1 prefill and decode tokens/s: deepfuse vs HF transformers eager, same weights, one run.

Both load SmolLM2-135M-Instruct from the same Q4_1 GGUF (dequantized; "bf16+int4" keeps
the projections in 4-bit groups, which reproduce Q4_1 up to bf16 rounding; "int4 inv." is that
build compiled batch-invariant). Each config runs
`--runs` times; the table shows medians. Writes benchmarks/results/decode.json.

    python benchmarks/decode.py [--runs 3] [--new-tokens 64]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
from results_file import write_result

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should be warm, a little mysterious, and end with a surprise. ") * 3


def bench_deepfuse(dtype: str, ids: list[int], n: int, runs: int, model, quant: str | None = None,
                   batch_invariant: bool = False) -> list[dict]:
    import deepfuse
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig

    art = deepfuse.compile(model, dtype=dtype, quant=quant, batch_invariant=batch_invariant)
    eng = Engine(art, CacheConfig(enable_prefix_caching=False))  # every run prefills the whole prompt
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    eng.generate([ids], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])  # warm-up
    out = []
    for _ in range(runs):
        r = eng.generate([ids], [p])[0]
        out.append({"prefill_tps": len(ids) / r.metrics.ttft_s,
                    "decode_tps": (n - 1) / (r.metrics.total_s - r.metrics.ttft_s)})
    return out


def bench_hf(dtype: torch.dtype, ids: list[int], n: int, runs: int) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from deepfuse.models import smollm2_gguf_path

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=dtype).eval()
    x = torch.tensor([ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(k: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=k, min_new_tokens=k, **kw)
        assert out.shape[1] == len(ids) + k
        return time.perf_counter() - t

    gen(4)  # warm-up
    out = []
    for _ in range(runs):
        prefill = statistics.median(gen(1) for _ in range(3))
        total = gen(n)
        out.append({"prefill_tps": len(ids) / prefill, "decode_tps": (n - 1) / (total - prefill)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    from deepfuse.codegen.cpu.executor import ALLOCATOR_TUNED
    from deepfuse.models import load_model

    model, tok = load_model("smollm2")
    ids = tok.encode(PROMPT)
    results = {}
    for name, fn in [("deepfuse f32", lambda: bench_deepfuse("f32", ids, args.new_tokens, args.runs, model)),
                     ("deepfuse bf16", lambda: bench_deepfuse("bf16", ids, args.new_tokens, args.runs, model)),
                     ("deepfuse bf16+int4", lambda: bench_deepfuse("bf16", ids, args.new_tokens, args.runs, model, "int4")),
                     ("deepfuse int4 inv.", lambda: bench_deepfuse("bf16", ids, args.new_tokens, args.runs, model, "int4",
                                                                    batch_invariant=True)),
                     ("HF eager f32", lambda: bench_hf(torch.float32, ids, args.new_tokens, args.runs)),
                     ("HF eager bf16", lambda: bench_hf(torch.bfloat16, ids, args.new_tokens, args.runs))]:
        runs = fn()
        results[name] = {"runs": runs, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}
    base = results["HF eager bf16"]["decode_tps"]
    print(f"\nSmolLM2-135M, batch 1, prompt {len(ids)} tokens, {args.new_tokens} new tokens, "
          f"median of {args.runs} runs, {torch.get_num_threads()} threads")
    print(f"{'engine':20s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'decode vs HF bf16':>18s}")
    for name, r in results.items():
        print(f"{name:20s} {r['prefill_tps']:14.1f} {r['decode_tps']:13.1f} {r['decode_tps'] / base:17.2f}x")
    meta = {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "runs": args.runs,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
            "allocator": "glibc mallopt(M_MMAP_THRESHOLD=1GiB, M_TRIM_THRESHOLD=2GiB) in-process, for both engines"
            if ALLOCATOR_TUNED else "default"}
    write_result("decode.json", {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
