"""Engine replicas behind the prefix-cache-aware router against round-robin, on a workload of
shared prefixes: --prefixes system prompts of --prefix-tokens tokens, each followed by
--questions different questions of --question-tokens tokens (random token ids), --tokens output
tokens each (EOS ignored). All requests of a run are added at once, in a shuffled order, to
--replicas Ray actors on this machine (each with torch threads = cores / replicas).

Per run: output tok/s (all output tokens / wall time from the first request added to the last
finished) and the prefix hit rate (prompt tokens the replicas' prefix caches served / prompt tokens
looked up, over this run). Each run uses prefixes of its own (a seed per run), so no run finds
another's blocks; the two policies alternate, --runs each, on the same replicas (a fresh router
per run). Prints a table and writes benchmarks/results/replicas.json (or --result; medians and every run).

    python benchmarks/replicas.py [--replicas 2] [--runs 3] [--prefixes 8] [--questions 12]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from results_file import write_result

import deepfuse
from deepfuse import SamplingParams
from deepfuse.models import load_model
from deepfuse.runtime.replicas import Replicas
from deepfuse.runtime.router import PrefixRouter

POLICIES = ("prefix", "round_robin")


def workload(seed: int, args) -> list[list[int]]:
    """The run's prompts, shuffled: each prefix followed by each of its questions."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1000, 40000) for _ in range(n)]
    prompts = [prefix + ids(args.question_tokens) for prefix in [ids(args.prefix_tokens) for _ in range(args.prefixes)]
               for _ in range(args.questions)]
    rng.shuffle(prompts)
    return prompts


async def run_all(replicas: Replicas, prompts: list[list[int]], params: SamplingParams, tag: str) -> list:
    async def one(i: int):
        outs = [o async for o in replicas.generate(prompts[i], params, f"{tag}-{i}", stream=False)]
        return outs[-1]

    return await asyncio.gather(*[one(i) for i in range(len(prompts))])


def one_run(replicas: Replicas, policy: str, seed: int, args) -> dict:
    replicas.router = PrefixRouter(args.replicas, replicas.block_size, policy, args.max_imbalance)
    counts = [0] * args.replicas
    started = replicas.router.started

    def count(r, rid, names):
        counts[r] += 1
        started(r, rid, names)

    replicas.router.started = count
    prompts = workload(seed, args)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    before = replicas.stats()
    t0 = time.perf_counter()
    outs = asyncio.run(run_all(replicas, prompts, params, f"{policy}-{seed}"))
    wall = time.perf_counter() - t0
    after = replicas.stats()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * args.tokens, "a request ended early"
    queries, hits = after.prefix_queries - before.prefix_queries, after.prefix_hits - before.prefix_hits
    return {"policy": policy, "seed": seed, "wall_s": wall, "output_tps": tokens / wall,
            "prefix_hit_rate": hits / queries, "prompt_tokens": queries, "prompt_tokens_cached": hits,
            "requests_per_replica": counts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3, help="runs per policy (medians reported)")
    ap.add_argument("--prefixes", type=int, default=8)
    ap.add_argument("--prefix-tokens", type=int, default=512)
    ap.add_argument("--questions", type=int, default=12, help="requests per prefix")
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per replica")
    ap.add_argument("--max-imbalance", type=int, default=8, help="the router's PrefixRouter.max_imbalance")
    ap.add_argument("--result", default="replicas.json", help="the file written under benchmarks/results/")
    args = ap.parse_args()

    source, tok = load_model("smollm2")
    model = deepfuse.compile(source, target="cpu", dtype="bf16", quant="int4", tokenizer=tok)
    replicas = Replicas(args.replicas, model, num_blocks=args.num_blocks)
    try:
        one_run(replicas, "prefix", 10_000, args)  # warm-up (kernels, caches, page faults): not reported
        # every run its own seed, hence its own prefixes: no run finds another's blocks cached
        runs = [one_run(replicas, policy, len(POLICIES) * i + j, args) for i in range(args.runs)
                for j, policy in enumerate(POLICIES)]
    finally:
        replicas.shutdown()

    results = {}
    print(f"{'policy':<12} {'output tok/s':>12} {'hit rate':>9} {'wall s':>7}   requests per replica (each run)")
    for policy in POLICIES:
        mine = [r for r in runs if r["policy"] == policy]
        med = {k: statistics.median(r[k] for r in mine) for k in ("output_tps", "prefix_hit_rate", "wall_s")}
        results[policy] = {**med, "runs": mine}
        print(f"{policy:<12} {med['output_tps']:12.1f} {med['prefix_hit_rate']:9.3f} {med['wall_s']:7.2f}   "
              f"{[r['requests_per_replica'] for r in mine]}")
    ratio = results["prefix"]["output_tps"] / results["round_robin"]["output_tps"]
    print(f"prefix-aware / round-robin output tok/s: {ratio:.2f}x (medians of {args.runs} runs each)")
    meta = {k: getattr(args, k) for k in ("replicas", "runs", "prefixes", "prefix_tokens", "questions", "question_tokens",
                                          "tokens", "num_blocks", "max_imbalance")}
    meta.update(build="bf16+int4", model="smollm2", threads_per_replica=max(1, replicas_threads(args.replicas)))
    path = write_result(args.result, {"meta": meta, "results": results, "speedup_output_tps": ratio})
    print(f"wrote {path}")


def replicas_threads(n: int) -> int:
    import torch

    return torch.get_num_threads() // n


if __name__ == "__main__":
    main()
