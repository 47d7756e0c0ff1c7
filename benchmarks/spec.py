"""Speculative decoding on SmolLM2: output tokens/s without drafts, with the n-gram drafter at
fixed k, and with confidence-scheduled verification (at most k), on workloads where drafting
helps (repeat a passage, continue edited code), at
  batch 1         one request;
  batch 16        16 requests together (the batch thins out as requests finish);
  batch 16 full   48 requests, at most 16 running (max_num_seqs=16): a steady batch of 16;
each configuration once per run, --runs runs interleaved, medians reported (this machine is
noisy). "modelled": the same runs' tokens over the time the engine's (sequences, tokens)
latency grid, frozen, predicts for the steps each configuration took: free of the noise, and
deterministic but for the online latency correction's effect on the schedule. Then, once
each, the self-drafter and the MTP draft head (fixed k and confidence-scheduled). Greedy in
f32 (the default --dtype), where a verify row computes what a one-row step computes, so every
configuration produces the same tokens (checked); with --dtype bf16 verify rows can round
differently and the tokens can differ.
Writes benchmarks/results/spec.json. The MTP head is --mtp-head, or trained first
(`deepfuse train-drafter` defaults, ~8 minutes) into ~/.cache/deepfuse/drafters/ and reused.

    python benchmarks/spec.py [--dtype f32] [--tokens 128] [--k 5] [--runs 3] [--mtp-head FILE]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from results_file import write_result

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


class StepShapes:
    """Wraps a compiled model; records each step's (sequences, tokens)."""

    def __init__(self, model):
        self.model, self.shapes = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs):
        self._record(inputs)
        return self.model(inputs)

    def rerun(self, inputs):
        """A decode step rerunning the last step's calls (Engine.forward) is a step too."""
        out = self.model.rerun(inputs)
        if out is not None:
            self._record(inputs)
        return out

    def _record(self, inputs):
        q = inputs["query_lens"]
        self.shapes.append((int((q > 0).sum()), int(q.sum())))


def run(art, batch: list[list[int]], tokens: int, spec, draft=None, max_num_seqs: int = 64, grid=None
        ) -> tuple[float, list, dict]:
    """Output tokens/s, the tokens, and stats; with grid (a LatencyModel), stats["modelled_tok_s"]:
    tokens over the time the grid predicts for the steps taken (the same grid for every
    configuration: a comparison free of this machine's noise)."""
    from deepfuse.runtime.engine import Engine, SamplingParams

    eng = Engine(art, spec=spec, draft_model=draft, max_num_seqs=max_num_seqs)
    eng.generate(batch[:1], [SamplingParams(temperature=0, max_tokens=4)])  # warm-up
    eng.model = steps = StepShapes(eng.model)
    params = [SamplingParams(temperature=0, max_tokens=tokens) for _ in batch]
    t = time.perf_counter()
    outs = eng.generate(batch, params)
    dt = time.perf_counter() - t
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    s = eng.spec_stats
    stats = {"acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length,
             "verified_per_step": s.verified_per_step, "steps": eng.stats.steps}
    if grid is not None:
        stats["modelled_tok_s"] = gen / (sum(grid.predict(*shape) for shape in steps.shapes) / 1000)
    return gen / dt, [o.outputs[0].token_ids for o in outs], stats


def mtp_head(art, dtype: str) -> str:
    """The cached head for SmolLM2 at this dtype, trained with train-drafter's defaults if missing."""
    from deepfuse.runtime.train_drafter import TrainConfig, train_drafter

    path = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "drafters", f"smollm2-{dtype}.safetensors")
    if not os.path.exists(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        m = train_drafter(art, path, TrainConfig())
        print(f"trained {path}: held-out {m['heldout']}")
    return path


WORKLOADS = (("batch 1", 1, 64), ("batch 16", 16, 64), ("batch 16 full", 48, 16))  # name, requests, max_num_seqs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="f32")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
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
    ngram = {"none": None, "fixed": SpecConfig(num_draft_tokens=args.k, schedule="fixed"),
             "confidence": SpecConfig(num_draft_tokens=args.k)}
    speeds = {(w, c): [] for w, _, _ in WORKLOADS for c in ngram}
    from deepfuse.runtime.engine import Engine
    grid = copy.deepcopy(Engine(art, spec=SpecConfig()).latency)  # measured once (or cached), then frozen
    stats, same = {}, True
    for r in range(args.runs):
        for name, n, seqs in WORKLOADS:
            batch = prompts(tok, n)
            outs = {}
            for c, spec in ngram.items():
                tps, outs[c], stats[name, c] = run(art, batch, args.tokens, spec, max_num_seqs=seqs, grid=grid)
                speeds[name, c].append(tps)
            same &= outs["fixed"] == outs["none"] == outs["confidence"]
            print(f"run {r + 1} {name}: " + ", ".join(f"{c} {speeds[name, c][-1]:.1f}" for c in ngram) + " tok/s",
                  flush=True)
    med = {key: statistics.median(v) for key, v in speeds.items()}
    results = {"dtype": args.dtype, "tokens": args.tokens, "k": args.k, "runs": args.runs,
               "identical_outputs": same, "ngram": {}}
    print(f"\nSmolLM2-135M {args.dtype}, up to {args.tokens} new tokens per request (greedy, stops at EOS), "
          f"n-gram drafter, k={args.k}, {torch.get_num_threads()} threads, medians of {args.runs} runs")
    print(f"{'workload':>13s} {'none tok/s':>11s} {'fixed tok/s':>12s} {'conf tok/s':>11s} {'fixed/none':>11s} "
          f"{'conf/none':>10s} {'conf/fixed':>11s} {'conf/fixed per run':>19s} {'accept f/c':>11s} "
          f"{'verified/seq f/c':>17s} {'modelled conf/fixed':>20s}")
    for name, _, _ in WORKLOADS:
        base, fixed, conf = (med[name, c] for c in ngram)
        f, c = stats[name, "fixed"], stats[name, "confidence"]
        per_run = [cv / fv for cv, fv in zip(speeds[name, "confidence"], speeds[name, "fixed"])]
        print(f"{name:>13s} {base:11.1f} {fixed:12.1f} {conf:11.1f} {fixed / base:10.2f}x {conf / base:9.2f}x "
              f"{conf / fixed:10.2f}x {' '.join(f'{x:.2f}' for x in per_run):>19s} "
              f"{f['acceptance_rate']:5.2f}/{c['acceptance_rate']:4.2f} "
              f"{f['verified_per_step']:8.2f}/{c['verified_per_step']:<8.2f} "
              f"{c['modelled_tok_s'] / f['modelled_tok_s']:19.2f}x")
        results["ngram"][name] = {"tok_s": {c: speeds[name, c] for c in ngram}, "median_tok_s": {c: med[name, c] for c in ngram},
                                  "fixed_vs_none": fixed / base, "confidence_vs_none": conf / base,
                                  "confidence_vs_fixed": conf / fixed, "confidence_vs_fixed_per_run": per_run,
                                  "modelled_confidence_vs_fixed": c["modelled_tok_s"] / f["modelled_tok_s"],
                                  "fixed": f, "confidence": c}
    print(f"identical outputs in every configuration: {same}")

    print(f"\nself-drafter (first {args.draft_layers} of {model.config.num_layers} layers + head, k <= 3, "
          f"confidence-scheduled) and MTP draft head ({head}, k <= {args.k}), one run each:")
    for name, n, _ in WORKLOADS[:2]:
        batch = prompts(tok, n)
        base, base_tokens, _ = run(art, batch, args.tokens, None)
        selfd, self_tokens, sstats = run(art, batch, args.tokens, SpecConfig(method="draft", num_draft_tokens=3), draft)
        mtp = {}
        for schedule in ("fixed", "confidence"):
            mtp[schedule] = run(art, batch, args.tokens, SpecConfig(method="mtp", draft_head=head,
                                                                    num_draft_tokens=args.k, schedule=schedule))
        ok = self_tokens == base_tokens and all(m[1] == base_tokens for m in mtp.values())
        print(f"  {name}: self-drafter {selfd / base:.2f}x no spec (accept {sstats['acceptance_rate']:.2f}); "
              f"MTP fixed {mtp['fixed'][0] / base:.2f}x (accept {mtp['fixed'][2]['acceptance_rate']:.2f}, "
              f"{mtp['fixed'][2]['mean_accepted_length']:.2f} tokens per verification), confidence "
              f"{mtp['confidence'][0] / base:.2f}x (accept {mtp['confidence'][2]['acceptance_rate']:.2f}, "
              f"{mtp['confidence'][2]['verified_per_step']:.2f} verified per sequence); same tokens: {ok}")
        results[f"{name} self-drafter"] = {"tok_s": selfd, "vs_none": selfd / base, **sstats}
        results[f"{name} mtp"] = {s: {"tok_s": m[0], "vs_none": m[0] / base, **m[2]} for s, m in mtp.items()}
        results[f"{name} others identical"] = ok
    write_result("spec.json", {"results": results})


if __name__ == "__main__":
    main()
