"""The disk tier of the prefix cache across a restart, on SmolLM2-135M (bf16).

A --prefix-token shared prefix (this repository's docs) is computed once by one process with
`CacheConfig(kv_store=DIR)`; then, in fresh processes (nothing in memory), the prefix + a
different question is run cold (store off) and with the store, --runs times each, alternating.
Reports the time to first token of both, their ratio, and whether the generated tokens are
identical; medians.

    python benchmarks/kv_store.py [--prefix-tokens 4096] [--runs 3]
Writes benchmarks/results/kv_store.json.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def prompt_ids(tok, prefix_tokens: int, question: int) -> list[int]:
    docs = sorted(glob.glob(os.path.join(HERE, "..", "docs", "*.md")))
    text = "\n\n".join(open(f, encoding="utf-8").read() for f in docs)
    return tok.encode(text)[:prefix_tokens] + tok.encode(f"\n\nQuestion {question}: what does section {question} say?")


def child(args) -> None:
    """One process: compile, run one request, print its TTFT and tokens as JSON."""
    import deepfuse
    from deepfuse.models import load_model
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig

    source, tok = load_model("smollm2")
    art = deepfuse.compile(source, dtype="bf16", tokenizer=tok)
    cache = CacheConfig(num_blocks=1024, kv_store=args.store or None)
    eng = Engine(art, cache, max_num_tokens=512)
    eng.generate([[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=2)])  # warm-up, nothing shared
    ids = prompt_ids(tok, args.prefix_tokens, args.question)
    out = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)])[0]
    if eng.kv.store is not None:
        eng.kv.store.flush()
    print(json.dumps({"ttft_s": out.metrics.ttft_s, "tokens": out.outputs[0].token_ids, "cached": out.num_cached_tokens,
                      "prompt_tokens": len(ids)}))


def run_child(args, store: str, question: int) -> dict:
    cmd = [sys.executable, __file__, "--child", "--store", store, "--question", str(question),
           "--prefix-tokens", str(args.prefix_tokens)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=HERE)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix-tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--store", default="")
    ap.add_argument("--question", type=int, default=0)
    args = ap.parse_args()
    if args.child:
        return child(args)
    from results_file import write_result

    with tempfile.TemporaryDirectory() as store:
        first = run_child(args, store, 0)  # computes the prefix, writes its blocks
        cold, warm, same = [], [], []
        for r in range(args.runs):
            c = run_child(args, "", r + 1)
            w = run_child(args, store, r + 1)
            cold.append(c["ttft_s"])
            warm.append(w["ttft_s"])
            same.append(c["tokens"] == w["tokens"])
            print(f"run {r + 1}: cold TTFT {c['ttft_s']:.3f} s, from the store {w['ttft_s']:.3f} s "
                  f"({w['cached']} of {w['prompt_tokens']} prompt tokens loaded), same tokens: {same[-1]}", flush=True)
        size = sum(os.path.getsize(f) for f in glob.glob(os.path.join(store, "*.kv")))
    result = {"model": "SmolLM2-135M bf16", "prefix_tokens": args.prefix_tokens, "first_ttft_s": first["ttft_s"],
              "cold_ttft_s": statistics.median(cold), "store_ttft_s": statistics.median(warm),
              "ratio": round(statistics.median(warm) / statistics.median(cold), 3), "identical_tokens": all(same),
              "cold_runs": cold, "store_runs": warm, "store_bytes": size}
    print(f"TTFT cold {result['cold_ttft_s']:.3f} s, after a restart from the store {result['store_ttft_s']:.3f} s: "
          f"ratio {result['ratio']}, identical tokens: {result['identical_tokens']}, store {size / 2 ** 20:.0f} MiB")
    write_result("kv_store.json", result)


if __name__ == "__main__":
    main()
