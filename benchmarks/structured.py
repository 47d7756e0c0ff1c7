"""Structured outputs on SmolLM2: do constrained outputs hold, with and without speculative
decoding, and what does the grammar's mask cost?

50 chat requests asking for JSON, 10 for each of 5 schemas (nested objects, enums, arrays,
bounded numbers), seeded sampling at temperature 0.8, plus 10 regex and 10 choice requests;
run once in a plain engine and once in one speculating with n-gram drafts (k = 3). Every JSON
output is checked with `jsonschema`, every regex output with re.fullmatch. The cost: the time
spent filling and applying masks and advancing and rolling back matchers (structured.py), per
constrained token and as a share of the run; and the run's tok/s against the same requests
unconstrained (EOS ignored, each as long as its constrained twin), the two alternating for
--runs rounds (medians). Speculating, constrained requests verify drafts the grammar allows:
their drafted and accepted counts are reported. Writes benchmarks/results/structured.json.

    python benchmarks/structured.py [--dtype bf16] [--quant int4] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time

from results_file import write_result

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "address": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 16},
                                          "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                          "required": ["city", "zip"], "additionalProperties": False}},
     "required": ["name", "age", "address"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
     "required": ["color", "bright"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                               "minItems": 1, "maxItems": 4}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"type": "number", "minimum": -100, "maximum": 100},
                                      "y": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["x", "y"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "votes": {"type": "array", "items": {"enum": ["up", "down"]}, "maxItems": 5}},
     "required": ["score", "votes"], "additionalProperties": False},
]
REGEX = r"[A-Z]{3}-[0-9]{2,4}"
CHOICES = ["positive", "negative", "neutral"]


class Timed:
    """Wraps structured.Matcher's mask and accept, adding up their seconds and calls."""

    def __init__(self, cls):
        self.seconds, self.tokens = 0.0, 0
        for name in ("mask", "accept", "rollback", "allowed_prefix"):
            setattr(cls, name, self.wrap(getattr(cls, name), name == "accept"))

    def wrap(self, fn, counts: bool):
        def timed(*a):
            t = time.perf_counter()
            out = fn(*a)
            self.seconds += time.perf_counter() - t
            self.tokens += counts
            return out
        return timed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import jsonschema

    import deepfuse
    from deepfuse import SamplingParams, StructuredOutputsParams
    from deepfuse.models import load_model
    from deepfuse.runtime import structured
    from deepfuse.runtime.engine import Engine
    from deepfuse.runtime.kv_cache import CacheConfig
    from deepfuse.runtime.spec import SpecConfig

    model, tok = load_model("smollm2")
    art = deepfuse.compile(model, dtype=args.dtype, quant=args.quant, tokenizer=tok)
    chat = lambda text: tok.encode(tok.render_chat([{"role": "user", "content": text}]))
    prompts, params = [], []
    for i in range(50):
        prompts.append(chat(f"Reply in JSON. Example {i}: describe something about the number {i}."))
        params.append(StructuredOutputsParams(json=SCHEMAS[i % 5]))
    for i in range(10):
        prompts.append(chat(f"Give a product code for item {i}."))
        params.append(StructuredOutputsParams(regex=REGEX))
        prompts.append(chat(f"What is the mood of review number {i}?"))
        params.append(StructuredOutputsParams(choice=CHOICES))
    timer = Timed(structured.Matcher)
    results = {}
    for name, spec in (("plain", None), ("speculative", SpecConfig(num_draft_tokens=3, schedule="fixed"))):
        eng = Engine(art, CacheConfig(num_blocks=2048), max_num_tokens=1024, max_num_seqs=64, spec=spec)
        eng.grammars()  # built once per engine (the tokenizer's vocabulary, ~2 s): not part of the run
        eng.generate(prompts, [SamplingParams(max_tokens=1)] * len(prompts))  # every round finds the prompts cached
        sampling = [SamplingParams(temperature=0.8, seed=i, max_tokens=128, structured_outputs=s)
                    for i, s in enumerate(params)]
        walls, free_walls, masks = [], [], []
        for _ in range(args.runs):  # constrained and unconstrained alternate: the machine's drift hits both
            timer.seconds = timer.tokens = 0
            drafted, accepted = eng.spec_stats.drafted, eng.spec_stats.accepted
            t = time.perf_counter()
            outs = eng.generate(prompts, sampling)
            walls.append(time.perf_counter() - t)
            masks.append((timer.seconds, timer.tokens))
            drafted, accepted = eng.spec_stats.drafted - drafted, eng.spec_stats.accepted - accepted
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            # the same requests unconstrained, each as long as its constrained run (EOS ignored)
            free = [SamplingParams(temperature=0.8, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(lengths)]
            t = time.perf_counter()
            eng.generate(prompts, free)
            free_walls.append(time.perf_counter() - t)
        texts = [o.outputs[0].text for o in outs]
        valid = 0
        for i, (text, s) in enumerate(zip(texts, params)):
            try:
                if s.json is not None:
                    jsonschema.validate(json.loads(text), s.json)
                    ok = True
                else:
                    ok = bool(re.fullmatch(REGEX, text)) if s.regex else text in CHOICES
            except (ValueError, jsonschema.ValidationError):
                ok = False
            valid += ok
            if not ok:
                print(f"  {name} request {i} invalid ({outs[i].outputs[0].finish_reason}): {text!r}")
        tokens = sum(lengths)
        wall, free_wall = statistics.median(walls), statistics.median(free_walls)
        mask_s, masked = masks[walls.index(sorted(walls)[len(walls) // 2])]
        results[name] = {"requests": len(outs), "valid": valid, "tokens": tokens, "runs": args.runs,
                         "tok_s": tokens / wall, "unconstrained_tok_s": tokens / free_wall,
                         "ratio_median": statistics.median(f / w for f, w in zip(free_walls, walls)),
                         "ratios": [f / w for f, w in zip(free_walls, walls)],
                         "mask_us_per_token": 1e6 * mask_s / max(masked, 1), "mask_share": mask_s / wall,
                         "drafted": drafted, "accepted": accepted}
        r = results[name]
        print(f"{name:12s} valid {valid}/{len(outs)}  {tokens} tokens  {r['tok_s']:.1f} tok/s constrained, "
              f"{r['unconstrained_tok_s']:.1f} unconstrained ({r['ratio_median']:.2f}x, rounds "
              f"{', '.join(f'{x:.2f}' for x in r['ratios'])})  mask + accept {r['mask_us_per_token']:.0f} us/token, "
              f"{100 * r['mask_share']:.1f}% of the run  drafts {drafted}, kept {accepted}", flush=True)
    write_result("structured.json", {"dtype": args.dtype, "quant": args.quant, "results": results})


if __name__ == "__main__":
    main()
