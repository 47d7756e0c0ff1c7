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
  top-k+top-p    top-k 40 and top-p 0.9 (the step's own sampler, sample.cpp)
With --reference-sampler, "plain" and "top-k+top-p" run again on a second engine of the same
build whose native sampler is off (benchmarks/sampler_switch.py: its steps stop before the
sampler and the op's reference draws from Python), as "... ref. sampler".
The prefix cache is off, so every round computes the same prompts. Writes
benchmarks/results/sampling.json (or --result).

    python benchmarks/sampling.py [--runs 3] [--tokens 256] [--dtype bf16] [--quant int4]
    python benchmarks/sampling.py --settings "plain,top-k+top-p" --reference-sampler --result sampling_native.json
"""
from __future__ import annotations

import argparse
import statistics
import time

from results_file import write_result
from sampler_switch import reference_sampler
from throughput import make_prompts

SETTINGS = {
    "plain": {},
    "stop string": {"stop": ["no such text appears here"]},
    "penalties": {"repetition_penalty": 1.1, "frequency_penalty": 0.2},
    "min_p": {"min_p": 0.05},
    "logit_bias": {"logit_bias": {i: 0.5 for i in range(100, 110)}},
    "logprobs 5": {"logprobs": 5},
    "top-k+top-p": {"top_k": 40, "top_p": 0.9},
}
REF = " ref. sampler"  # the suffix of a setting run with the native sampler off


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--settings", default=",".join(SETTINGS), help="comma-separated names (plain always runs)")
    ap.add_argument("--reference-sampler", action="store_true", help="adds plain and top-k+top-p with it")
    ap.add_argument("--result", default="sampling.json")
    args = ap.parse_args()
    wanted = ["plain"] + [n for n in SETTINGS if n != "plain" and n in args.settings.split(",")]
    if args.reference_sampler:
        wanted += [n + REF for n in ("plain", "top-k+top-p") if n in wanted]
    import deepfuse
    from deepfuse.models import load_model
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig

    model, tok = load_model("smollm2")
    prompts = make_prompts(tok, 64)

    def engine(reference: bool) -> Engine:
        art = deepfuse.compile(model, dtype=args.dtype, quant=args.quant, tokenizer=tok)
        eng = Engine(art, CacheConfig(num_blocks=4096, enable_prefix_caching=False), max_num_tokens=1024,
                     max_num_seqs=64)
        with reference_sampler(reference):
            eng.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2)  # warm-up
        return eng

    engines = {False: engine(False)}
    if args.reference_sampler:
        engines[True] = engine(True)  # its own bound steps: those made with the sampler off stay so
    tps: dict[str, list[float]] = {name: [] for name in wanted}
    names = wanted
    for round_ in range(args.runs):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # each round starts one later
            reference = name.endswith(REF)
            extra = SETTINGS[name.removesuffix(REF)]
            p = SamplingParams(temperature=0.8, seed=1, max_tokens=args.tokens, ignore_eos=True, **extra)
            t = time.perf_counter()
            with reference_sampler(reference):
                outs = engines[reference].generate(prompts, [p] * len(prompts))
            tps[name].append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t))
            print(f"round {round_ + 1}, {name}: {tps[name][-1]:.1f} tok/s", flush=True)
    print(f"\n64 requests x {args.tokens} tokens, {args.dtype}{'+' + args.quant if args.quant else ''}, "
          f"medians of {args.runs} round(s)")
    print(f"{'setting':26s} {'tok/s':>8s} {'vs plain':>9s}  per round")
    results = {}
    for name in wanted:
        ratios = [a / b for a, b in zip(tps[name], tps["plain"])]
        results[name] = {"tok_s": statistics.median(tps[name]), "vs_plain": statistics.median(ratios), "rounds": ratios}
        print(f"{name:26s} {results[name]['tok_s']:8.1f} {results[name]['vs_plain']:8.3f}x  "
              + ", ".join(f"{r:.3f}" for r in ratios))
    write_result(args.result, {"runs": args.runs, "tokens": args.tokens, "dtype": args.dtype, "quant": args.quant,
                                   "results": results})


if __name__ == "__main__":
    main()
