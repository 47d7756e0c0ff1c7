"""What the runtime's per-request settings cost: 64 requests (throughput.py's prompts) of --tokens
output tokens each, EOS ignored, on SmolLM2 with one engine, run once plain (seeded sampling at
temperature 0.8) and once per setting, in --runs interleaved rounds (each round starting one
setting later than the one before, so none always runs first); prints each setting's
tok/s and its ratio to the plain run of the same round (medians over rounds). The settings:
  stop string    one that never matches, so every token's new text is searched (detokenize.py)
  penalties      repetition 1.1 + frequency 0.2 (host_sampling.py: the rows drawn on the host)
  min_p          0.05 (host_sampling.py)
  logit_bias     ten ids (host_sampling.py)
  logprobs 5     the top 5 of every token (a log_softmax per token)
The prefix cache is off, so every round computes the same prompts. Writes
benchmarks/results/sampling.json.

    python benchmarks/sampling.py [--runs 3] [--tokens 256] [--dtype bf16] [--quant int4]
"""
from __future__ import annotations

import argparse
import statistics
import time

from results_file import write_result
from throughput import make_prompts

SETTINGS = {
    "plain": {},
    "stop string": {"stop": ["no such text appears here"]},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "min_p": {"min_p": 0.05},
    "logit_bias": {"logit_bias": {i: 0.5 for i in range(100, 110)}},
    "logprobs 5": {"logprobs": 5},
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quant", default="int4")
    args = ap.parse_args()
    import deepfuse
    from deepfuse.models import load_model
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig

    model, tok = load_model("smollm2")
    prompts = make_prompts(tok, 64)
    art = deepfuse.compile(model, dtype=args.dtype, quant=args.quant, tokenizer=tok)
    eng = Engine(art, CacheConfig(num_blocks=4096, enable_prefix_caching=False), max_num_tokens=1024, max_num_seqs=64)
    eng.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2)  # warm-up
    tps: dict[str, list[float]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for round_ in range(args.runs):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # each round starts one later
            extra = SETTINGS[name]
            p = SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, ignore_eos=True, **extra)
            t = time.perf_counter()
            outs = eng.generate(prompts, [p] * len(prompts))
            tps[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
            print(f"round {round_ + 1}, {name}: {tps[name][-1]:.1f} tok/s", flush=True)
    print(f"\n64 requests x {args.tokens} tokens, {args.dtype}{'+' + args.quant if args.quant else ''}, "
          f"medians of {args.runs} round(s)")
    print(f"{'setting':14s} {'tok/s':>8s} {'vs plain':>9s}  per round")
    results = {}
    for name in SETTINGS:
        ratios = [a / b for a, b in zip(tps[name], tps["plain"])]
        results[name] = {"tok_s": statistics.median(tps[name]), "vs_plain": statistics.median(ratios), "rounds": ratios}
        print(f"{name:14s} {results[name]['tok_s']:8.1f} {results[name]['vs_plain']:8.3f}x  "
              + ", ".join(f"{r:.3f}" for r in ratios))
    write_result("sampling.json", {"runs": args.runs, "tokens": args.tokens, "dtype": args.dtype, "quant": args.quant,
                                   "results": results})


if __name__ == "__main__":
    main()
