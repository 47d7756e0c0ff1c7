"""Hybrid KV cache and SWA bounded replay on Gemma 3 270M (the packaged Q4_K_M GGUF, dequantized).

1. Memory: KV bytes one sequence holds at 1k/4k/8k context, hybrid (the sliding layers keep
   ceil(512/16) + 1 blocks) against one table for all layers (every block of every layer), and a
   sequence longer than an all-full cache of the same bytes could hold, run through the engine.
2. Validity of replay by R: --prompts real texts of 2-6k tokens (license texts and Python's own
   documentation strings on this machine), each split into a cached prefix and --new new tokens.
   Exact: a cold prefill of the whole prompt. Replay R: the prefix cached by an earlier request,
   the sliding-window blocks not kept (swa_replay_tokens > 0 keeps none), so the engine recomputes
   the last R cached positions plus the new ones. Reported per R: top-1 agreement of --gen greedy
   tokens with the exact run (the share of positions with the same token, and the mean length of
   the identical start), and the KL divergence exact || replay of the first generated token's
   distribution. Compiled batch-invariant, so the exact run does not depend on how its prompt is
   chunked: every difference is replay's.
3. Work: a --work-prefix cached prefix + --new new tokens, replayed with R = 512, against a full
   re-prefill: tokens x layers computed (counted by the engine) and time to first token
   (median of --runs).

    python benchmarks/swa_replay.py [--prompts 20] [--gen 128] [--new 256] [--runs 3]
Writes benchmarks/results/swa_replay.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import statistics
import sys
import time

import torch
from results_file import write_result

import deepfuse
from deepfuse.models import load_model
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig, kv_bytes_per_sequence

REPLAYS = (128, 256, 512, 1024)
NEAR_DUPLICATES = ("GFDL-1.2", "LGPL-2")  # older versions of GFDL-1.3 and LGPL-2.1, nearly the same text


def texts() -> list[tuple[str, str]]:
    """(source, text) of long real documents on this machine: license texts, then the longest
    docstrings of Python's standard library."""
    out = []
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.basename(path) in NEAR_DUPLICATES or os.path.islink(path):
            continue
        if os.path.isfile(path) and os.path.getsize(path) > 12000:
            out.append((path, open(path, encoding="utf-8", errors="replace").read()))
    import ast

    docs = []
    for path in sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py"))):
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        text = "\n\n".join(d for node in ast.walk(tree) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                           for d in [ast.get_docstring(node)] if d)
        if len(text) > 12000:
            docs.append((len(text), path, text))
    out += [(p, t) for _, p, t in sorted(docs, reverse=True)]
    return out


def prompts(tok, count: int) -> list[tuple[str, list[int]]]:
    """count prompts of 2k-6k tokens (lengths spread evenly), one per document while they last."""
    out = []
    for source, text in texts():
        if len(out) == count:
            break
        ids = tok.encode(text)
        want = 2048 + (4096 * len(out)) // max(count - 1, 1)
        if len(ids) >= 2048:
            out.append((source, ids[:want]))
    if len(out) < count:
        sys.exit(f"only {len(out)} documents of >= 2048 tokens found on this machine")
    return out


class FirstTokenLogprobs:
    """Wraps an engine's step to keep, per request id, the log-probabilities [V] (f32) of its
    first generated token: the row that samples it in the step that ends its prompt."""

    def __init__(self, eng: Engine):
        self.by_request: dict[str, torch.Tensor] = {}
        run_step = eng._run_step

        def wrapped():
            ran = run_step()
            if ran is not None:
                row = 0
                for (req, n), chunk in zip(ran.scheduled, ran.chunks):
                    row += chunk.samples
                    if not req.generated and req.computed + n >= len(req.tokens):
                        self.by_request[req.request_id] = torch.log_softmax(ran.logits[row - 1].float(), -1)
            return ran

        eng._run_step = wrapped


def run_batch(eng: Engine, firsts: FirstTokenLogprobs, prompts: list[list[int]], params: SamplingParams):
    """Every prompt in one generate call (the build is batch-invariant: each gets the tokens it
    would get alone): ([tokens], [first token's log-probabilities])."""
    outs = eng.generate(prompts, [params] * len(prompts))
    return [o.outputs[0].token_ids for o in outs], [firsts.by_request.pop(o.request_id) for o in outs]


def memory(config) -> dict:
    row = config.head_dim * 2  # bf16
    all_full = dataclasses.replace(config, sliding_window=0, full_attention_layers=())
    out = {}
    for ctx in (1024, 4096, 8192):
        hybrid, full = kv_bytes_per_sequence(config, ctx, 16, row), kv_bytes_per_sequence(all_full, ctx, 16, row)
        out[ctx] = {"hybrid_full_group": hybrid["full"], "hybrid_sliding_group": hybrid["sliding"],
                    "hybrid_total": sum(hybrid.values()), "all_full": full["full"],
                    "ratio": round(sum(hybrid.values()) / full["full"], 3)}
    return out


def long_sequence(art, config, budget_tokens: int, length: int) -> dict:
    """A cache with the bytes of an all-full cache of budget_tokens: the hybrid layout's full group
    gets what the sliding group (one sequence's window and chunk) leaves."""
    bs, layers = 16, config.num_layers
    full_layers = len(config.full_attention_layers)
    sliding = -(-config.sliding_window // bs) + 2 + -(-512 // bs)
    num_blocks = (budget_tokens // bs * layers - sliding * (layers - full_layers)) // full_layers
    eng = Engine(art, CacheConfig(block_size=bs, num_blocks=num_blocks, sliding_blocks=sliding), max_num_tokens=512,
                 max_num_seqs=1)
    ids = [2] + [(i * 7919) % 200000 + 1000 for i in range(length - 1)]
    t0 = time.perf_counter()
    out = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])[0]
    return {"all_full_cache_tokens": budget_tokens, "hybrid_full_group_blocks": num_blocks,
            "hybrid_sliding_group_blocks": sliding, "sequence_tokens": length + 8, "finish_reason": out.outputs[0].finish_reason,
            "seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--work-prefix", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--replays", type=lambda v: [int(x) for x in v.split(",")], default=list(REPLAYS))
    ap.add_argument("--long-tokens", type=int, default=6000, help="0: skip the long-sequence run")
    args = ap.parse_args()
    source, tok = load_model("gemma3")
    config = source.config
    art = deepfuse.compile(source, target="cpu", dtype=args.dtype, tokenizer=tok, batch_invariant=True)
    result = {"model": "gemma-3-270m Q4_K_M (dequantized)", "dtype": args.dtype, "memory_bytes_per_sequence": memory(config)}
    print("KV bytes per sequence (bf16):", result["memory_bytes_per_sequence"])
    if args.long_tokens:
        result["long_sequence"] = long_sequence(art, config, 2048, args.long_tokens)
        print("long sequence:", result["long_sequence"])

    ids = max(prompts(tok, args.prompts), key=lambda c: len(c[1]))[1][:args.work_prefix + args.new]
    one = SamplingParams(temperature=0, max_tokens=1)
    plain = deepfuse.compile(source, target="cpu", dtype=args.dtype, tokenizer=tok)  # the default build, timed
    full_eng = Engine(plain, CacheConfig(num_blocks=1024, enable_prefix_caching=False), max_num_tokens=512)
    replay_eng = Engine(plain, CacheConfig(num_blocks=1024, swa_replay_tokens=512), max_num_tokens=512)
    full_eng.generate([ids[:64]], [one]), replay_eng.generate([ids[-64:]], [one])  # warm-up
    cold_t, replay_t, computed = [], [], {}
    for _ in range(args.runs):
        before = full_eng.stats.prompt_tokens_computed
        cold_t.append(full_eng.generate([ids], [one])[0].metrics.ttft_s)
        computed["full"] = full_eng.stats.prompt_tokens_computed - before
        replay_eng.generate([ids[:args.work_prefix]], [one])
        before = replay_eng.stats.prompt_tokens_computed
        replay_t.append(replay_eng.generate([ids], [one])[0].metrics.ttft_s)
        computed["replay"] = replay_eng.stats.prompt_tokens_computed - before
    layers = config.num_layers
    result["work"] = {"cached_prefix": args.work_prefix, "new_tokens": args.new, "replay_tokens": 512,
                      "full_token_layers": computed["full"] * layers, "replay_token_layers": computed["replay"] * layers,
                      "work_ratio": round(computed["replay"] / computed["full"], 3),
                      "full_ttft_s": round(statistics.median(cold_t), 3), "replay_ttft_s": round(statistics.median(replay_t), 3),
                      "time_ratio": round(statistics.median(replay_t) / statistics.median(cold_t), 3)}
    print("work:", result["work"])
    write_result("swa_replay.json", result)

    greedy = SamplingParams(temperature=0, max_tokens=args.gen, ignore_eos=True)
    chosen = prompts(tok, args.prompts)
    ids_all = [ids for _, ids in chosen]
    cold = Engine(art, CacheConfig(num_blocks=8192, enable_prefix_caching=False), max_num_tokens=512)
    cold_firsts = FirstTokenLogprobs(cold)
    want, want_lp = run_batch(cold, cold_firsts, ids_all, greedy)
    print("exact runs done", flush=True)
    warm = Engine(art, CacheConfig(num_blocks=16384, swa_replay_tokens=args.replays[0]), max_num_tokens=512)
    warm_firsts = FirstTokenLogprobs(warm)
    warm.generate([ids[:-args.new] for ids in ids_all], [SamplingParams(temperature=0, max_tokens=1)] * len(ids_all))
    rows = {}
    for r in args.replays:
        warm.kv.replay_tokens = r
        before = warm.kv.stats.replay_hits
        got, lp = run_batch(warm, warm_firsts, ids_all, greedy)
        assert warm.kv.stats.replay_hits - before == len(ids_all), "every prompt replays over its cached prefix"
        same = [[a == b for a, b in zip(g, w)] for g, w in zip(got, want)]
        rows[r] = {"agree": [sum(x) / len(x) for x in same],
                   "identical_start": [x.index(False) if False in x else len(x) for x in same],
                   "kl": [float((w.exp() * (w - g)).sum()) for w, g in zip(want_lp, lp)]}
        partial = {"replay_tokens_done": list(rows)}
        write_result("swa_replay.json", {**result, **partial, "rows_so_far": rows})
        print(f"R={r}: agreement per prompt {[round(a, 2) for a in rows[r]['agree']]}", flush=True)
    result["validity"] = {
        "prompts": [{"source": s, "tokens": len(i)} for s, i in chosen], "new_tokens": args.new, "generated": args.gen,
        "by_replay_tokens": {r: {"top1_agreement": round(statistics.mean(v["agree"]), 4),
                                 "mean_identical_start": round(statistics.mean(v["identical_start"]), 1),
                                 "all_identical": sum(x == args.gen for x in v["identical_start"]),
                                 "kl_first_token_mean": statistics.mean(v["kl"]),
                                 "kl_first_token_median": statistics.median(v["kl"]),
                                 "kl_first_token_max": max(v["kl"]), "per_prompt": v} for r, v in rows.items()}}

    for r, v in result["validity"]["by_replay_tokens"].items():
        print(f"R={r:5d}  top-1 agreement {v['top1_agreement']:.3f}  identical start {v['mean_identical_start']:6.1f}"
              f"  all identical {v['all_identical']}/{len(chosen)}  KL mean {v['kl_first_token_mean']:.2e}"
              f" max {v['kl_first_token_max']:.2e}")
    write_result("swa_replay.json", result)


if __name__ == "__main__":
    main()
