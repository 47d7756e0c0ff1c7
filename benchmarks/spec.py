"""Speculative decoding on SmolLM2, one run: output tokens/s without drafts, with the n-gram
drafter at fixed k, and with confidence-scheduled verification (at most k), at batch 1 and
batch 16, on workloads where drafting helps (repeat a passage, continue edited code); then the
self-drafter and the MTP draft head (fixed k and confidence-scheduled). Same process; greedy,
so every configuration produces the same tokens (checked). Writes benchmarks/results/spec.json.
The MTP head is --mtp-head, or trained first (`deepfuse train-drafter` defaults, ~8 minutes)
into ~/.cache/deepfuse/drafters/ and reused.

    python benchmarks/spec.py [--dtype f32] [--tokens 128] [--k 5] [--mtp-head FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

PASSAGES = [
    "The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away into the forest, "
    "where it met a wise old owl who told it a story about the moon and the stars.",
    "Paris is the capital of France. It is known for the Eiffel Tower, the Louvre museum, and its cafes. "
    "Millions of tourists visit the city every year to enjoy its art, food and history.",
    "Water boils at one hundred degrees Celsius at sea level. At higher altitudes the air pressure is lower, "
    "so water boils at a lower temperature, which is why cooking takes longer in the mountains.",
    "A binary search finds an item in a sorted list by repeatedly halving the range that could contain it, "
    "comparing the middle element with the target and discarding the half that cannot hold it.",
]
CODE = ("def add(a, b):\n    return a + b\n\n\ndef subtract(a, b):\n    return a - b\n\n\n"
        "def multiply(a, b):\n    return a * b\n\n\ndef divide(a, b):\n")


def prompts(tok, n: int) -> list[list[int]]:
    """Half rewrite-a-passage chats, half code continuation."""
    out = []
    for i in range(n):
        if i % 2 == 0:
            text = PASSAGES[(i // 2) % len(PASSAGES)]
            out.append(tok.encode(tok.render_chat([{"role": "user", "content": "Repeat this text exactly:\n" + text}])))
        else:
            out.append(tok.encode(CODE.replace("a, b", f"x{i}, y{i}").replace("a + b", f"x{i} + y{i}")
                                  .replace("a - b", f"x{i} - y{i}").replace("a * b", f"x{i} * y{i}")))
    return out


def run(art, batch: list[list[int]], tokens: int, spec, draft=None) -> tuple[float, list, dict]:
    from deepfuse.runtime.engine import Engine, SamplingParams

    eng = Engine(art, spec=spec, draft_model=draft)
    eng.generate(batch[:1], [SamplingParams(temperature=0, max_tokens=4)])  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=tokens) for _ in batch]
    t = time.perf_counter()
    outs = eng.generate(batch, params)
    dt = time.perf_counter() - t
    # decode throughput: tokens after each request's first, over the time after the first token
    gen = sum(len(o.token_ids) for o in outs)
    s = eng.spec_stats
    stats = {"acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
             "verified_per_step": s.verified_per_step, "steps": eng.stats.steps}
    return gen / dt, [o.token_ids for o in outs], stats


def mtp_head(art, dtype: str) -> str:
    """The cached head for SmolLM2 at this dtype, trained with train-drafter's defaults if missing."""
    from deepfuse.runtime.train_drafter import TrainConfig, train_drafter

    path = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "drafters", f"smollm2-{dtype}.safetensors")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        m = train_drafter(art, path, TrainConfig())
        print(f"trained {path}: held-out {m['heldout']}")
    return path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--draft-layers", type=int, default=8, help="the self-drafter: the target's first N layers")
    ap.add_argument("--mtp-head", help="an MTP head file (default: train one, cached)")
    args = ap.parse_args()
    import deepfuse
    from deepfuse.models import load_model
    from deepfuse.runtime.spec import SpecConfig

    model, tok = load_model("smollm2")
    art = deepfuse.compile(model, dtype=args.dtype, tokenizer=tok)
    draft = deepfuse.compile(model.first_layers(args.draft_layers), dtype=args.dtype)
    head = args.mtp_head or mtp_head(art, args.dtype)
    rows, results, self_rows, mtp_rows = [], {}, [], []
    for bs in (1, 16):
        batch = prompts(tok, bs)
        base, base_tokens, _ = run(art, batch, args.tokens, None)
        fixed, fixed_tokens, fstats = run(art, batch, args.tokens, SpecConfig(num_draft_tokens=args.k, schedule="fixed"))
        conf, conf_tokens, cstats = run(art, batch, args.tokens, SpecConfig(num_draft_tokens=args.k))
        selfd, self_tokens, sstats = run(art, batch, args.tokens, SpecConfig(method="draft", num_draft_tokens=3), draft)
        mtp_fixed, mtp_fixed_tokens, mfstats = run(art, batch, args.tokens, SpecConfig(
            method="mtp", draft_head=head, num_draft_tokens=args.k, schedule="fixed"))
        mtp_conf, mtp_conf_tokens, mcstats = run(art, batch, args.tokens, SpecConfig(
            method="mtp", draft_head=head, num_draft_tokens=args.k))
        same = all(t == base_tokens for t in (fixed_tokens, conf_tokens, self_tokens, mtp_fixed_tokens,
                                               mtp_conf_tokens))
        mtp_rows.append((bs, mtp_fixed / base, mtp_conf / base, mfstats, mcstats))
        results[f"batch {bs} mtp"] = {"fixed_tok_s": mtp_fixed, "confidence_tok_s": mtp_conf,
                                      "fixed_vs_none": mtp_fixed / base, "confidence_vs_none": mtp_conf / base,
                                      "fixed": mfstats, "confidence": mcstats}
        results[f"batch {bs} self-drafter"] = {"tok_s": selfd, "vs_none": selfd / base, **sstats}
        self_rows.append((bs, selfd, selfd / base, sstats))
        results[f"batch {bs}"] = {"no_spec_tok_s": base, "fixed_tok_s": fixed, "confidence_tok_s": conf,
                                  "fixed_vs_none": fixed / base, "confidence_vs_none": conf / base,
                                  "confidence_vs_fixed": conf / fixed, "identical_outputs": same,
                                  "fixed": fstats, "confidence": cstats}
        rows.append((bs, base, fixed, conf, fstats, cstats, same))
    print(f"\nSmolLM2-135M {args.dtype}, up to {args.tokens} new tokens per request (greedy, stops at EOS), "
          f"n-gram drafter, k={args.k}, "
          f"{torch.get_num_threads()} threads, one run")
    print(f"{'batch':>5s} {'none tok/s':>11s} {'fixed tok/s':>12s} {'conf tok/s':>11s} {'fixed/none':>11s} "
          f"{'conf/none':>10s} {'conf/fixed':>11s} {'accept f/c':>11s} {'verified/seq f/c':>17s} {'same':>5s}")
    for bs, base, fixed, conf, f, c, same in rows:
        print(f"{bs:5d} {base:11.1f} {fixed:12.1f} {conf:11.1f} {fixed / base:10.2f}x {conf / base:9.2f}x "
              f"{conf / fixed:10.2f}x {f['acceptance_rate']:5.2f}/{c['acceptance_rate']:4.2f} "
              f"{f['verified_per_step']:8.2f}/{c['verified_per_step']:<8.2f} {str(same):>5s}")
    print(f"\nself-drafter (first {args.draft_layers} of {model.config.num_layers} layers + head, k <= 3, "
          f"confidence-scheduled):")
    for bs, tps, ratio, s in self_rows:
        print(f"  batch {bs:2d}: {tps:6.1f} tok/s, {ratio:.2f}x no spec, accept {s['acceptance_rate']:.2f}, "
              f"{s['mean_accepted_length']:.2f} tokens per verification")
    print(f"\nMTP draft head ({head}), k <= {args.k}:")
    for bs, fx, cf, f, c in mtp_rows:
        print(f"  batch {bs:2d}: fixed {fx:.2f}x no spec (accept {f['acceptance_rate']:.2f}, "
              f"{f['mean_accepted_length']:.2f} tokens per verification), confidence {cf:.2f}x "
              f"(accept {c['acceptance_rate']:.2f}, {c['verified_per_step']:.2f} verified per sequence)")
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "results", "spec.json"), "w") as f:
        json.dump({"dtype": args.dtype, "tokens": args.tokens, "k": args.k, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
