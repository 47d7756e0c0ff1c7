"""Prefill/decode disaggregation against one engine, under a mixed workload: requests arrive over
time (Poisson, --rate per second), most with short prompts, every --long-every-th with a long one
(--long-tokens), each generating --tokens tokens (EOS ignored).

  single       one Engine in this process, all of this machine's threads, chunked prefill mixed
               with decode in its steps; requests are added between steps as they arrive
  disaggregated  runtime/disaggregated.py: a prefill worker and a decode worker, half the threads
               each; requests are sent as they arrive

Both run the default bf16 + int4 build of SmolLM2 with the same cache and step budget. Reported,
from the caller's side: time to first token (from each request's scheduled arrival) and time per
output token (p50, p99), and output tok/s; --rounds rounds alternate the two (medians). Writes
benchmarks/results/disaggregated.json.

    python benchmarks/disaggregated.py [--requests 48] [--rate 1.5] [--tokens 64] [--rounds 3]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from results_file import write_result
from throughput import make_prompts, summary


def workload(tok, n: int, long_every: int, long_tokens: int, rate: float, seed: int):
    """(prompts, arrival offsets in seconds): Poisson arrivals, every long_every-th prompt long."""
    rng = random.Random(seed)
    prompts = make_prompts(tok, n, seed=seed)
    for i in range(0, n, long_every):
        prompts[i] = (prompts[i] * (long_tokens // len(prompts[i]) + 1))[:long_tokens]
    t, arrivals = 0.0, []
    for _ in range(n):
        arrivals.append(t)
        t += rng.expovariate(rate)
    return prompts, arrivals


def measured(outs, index: dict[str, int], arrivals: list[float], t0: float, wall: float) -> dict:
    """summary() with each request's time to first token counted from its scheduled arrival
    (t0 + arrivals[i], time.time()), not from when the loop got round to adding it."""
    bad = [o for o in outs if o.error is not None]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed: {bad[0].error}")
    ttft = [o.metrics.first_token_time - (t0 + arrivals[index[o.request_id]]) for o in outs]
    return summary(wall, ttft, [o.metrics.tpot_s for o in outs], sum(len(o.outputs[0].token_ids) for o in outs))


def run(engine, prompts, arrivals, params, advance) -> dict:
    """Adds each request at its arrival time; between arrivals, advance(engine, seconds to the next
    arrival or None) returns the requests that finished meanwhile."""
    outs, index, i, t0, start = [], {}, 0, time.time(), time.perf_counter()
    while len(outs) < len(prompts):
        now = time.perf_counter() - start
        while i < len(prompts) and arrivals[i] <= now:
            index[engine.add_request(prompts[i], params[i])] = i
            i += 1
        outs += advance(engine, arrivals[i] - now if i < len(prompts) else None)
    return measured(outs, index, arrivals, t0, time.perf_counter() - start)


def step_single(engine, wait: float | None) -> list:
    """One step of the in-process engine, or a short sleep while it has nothing to run."""
    if engine.has_unfinished():
        return engine.step()
    time.sleep(max(0.0, min(0.01, wait if wait is not None else 0.01)))
    return []


def poll_disaggregated(engine, wait: float | None) -> list:
    """What the workers finished, waiting at most until the next arrival (1 s at most)."""
    return engine.get_finished(timeout_s=max(0.001, min(wait if wait is not None else 1.0, 1.0)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.5, help="arrivals per second")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--long-every", type=int, default=4)
    ap.add_argument("--long-tokens", type=int, default=1500)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quant", default="int4")
    args = ap.parse_args()
    import deepfuse
    from deepfuse import SamplingParams
    from deepfuse.models import load_model
    from deepfuse.runtime.disaggregated import DisaggregatedEngine, WorkerOptions
    from deepfuse.runtime.engine import Engine
    from deepfuse.runtime.kv_cache import CacheConfig

    model, tok = load_model("smollm2")
    threads = torch.get_num_threads()
    blocks, budget, seqs = 2048, 512, 64
    single = Engine(deepfuse.compile(model, dtype=args.dtype, quant=args.quant, tokenizer=tok),
                    CacheConfig(16, blocks), budget, seqs)
    pd = DisaggregatedEngine("smollm2", WorkerOptions(args.dtype, args.quant, True, 16, blocks, budget, seqs,
                                                      max(1, threads // 2)))
    try:
        warm = make_prompts(tok, 4, seed=99)
        single.generate(warm, [SamplingParams(max_tokens=4)] * 4)
        pd.generate(warm, [SamplingParams(max_tokens=4)] * 4)
        runs = {"single": [], "disaggregated": []}
        for r in range(args.rounds):  # fresh prompts each round: no prefix is cached from an earlier one
            prompts, arrivals = workload(tok, args.requests, args.long_every, args.long_tokens, args.rate, seed=r)
            params = [SamplingParams(temperature=0.8, seed=i, max_tokens=args.tokens, ignore_eos=True)
                      for i in range(len(prompts))]
            runs["single"].append(run(single, prompts, arrivals, params, step_single))
            runs["disaggregated"].append(run(pd, prompts, arrivals, params, poll_disaggregated))
            print(f"round {r + 1}: " + ", ".join(f"{k} TTFT p50 {v[-1]['ttft_p50_s']:.2f}s TPOT p50 "
                                                 f"{1000 * v[-1]['tpot_p50_s']:.0f}ms" for k, v in runs.items()),
                  flush=True)
    finally:
        pd.close()
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in runs.items()}
    print(f"\n{args.requests} requests at {args.rate}/s, every {args.long_every}th prompt {args.long_tokens} tokens, "
          f"{args.tokens} output tokens; medians of {args.rounds} rounds")
    print(f"{'engine':14s} {'out tok/s':>9s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}")
    for name, r in med.items():
        print(f"{name:14s} {r['output_tps']:9.1f} {r['ttft_p50_s']:8.2f}s {r['ttft_p99_s']:8.2f}s "
              f"{1000 * r['tpot_p50_s']:7.1f}ms {1000 * r['tpot_p99_s']:7.1f}ms")
    s, d = med["single"], med["disaggregated"]
    ratios = {m: d[m] / s[m] for m in ("output_tps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s")}
    print("disaggregated / single: " + ", ".join(f"{m} {v:.2f}x" for m, v in ratios.items()))
    write_result("disaggregated.json", {"requests": args.requests, "rate": args.rate, "tokens": args.tokens,
                                        "long_every": args.long_every, "long_tokens": args.long_tokens,
                                        "rounds": args.rounds, "dtype": args.dtype, "quant": args.quant,
                                        "threads": {"single": threads, "each_worker": max(1, threads // 2)},
                                        "runs": runs, "medians": med, "disaggregated_vs_single": ratios})


if __name__ == "__main__":
    main()
