"""SmolLM2 (f32) seeded sampled decoding on the device targets against the CPU target: three
sequences with different temperature / top-k / top-p / seed, N tokens each, through each target's
runner here (sm90 / sm100 in Triton's CPU interpreter: start with TRITON_INTERPRET=1; ascend950
in the AscendC emulator). Asserts the plans have no host steps; prints and records whether the
tokens equal the CPU target's. Writes benchmarks/results/sampled_on_devices.json.

    TRITON_INTERPRET=1 python benchmarks/sampled_on_devices.py --targets ascend950,sm90 --tokens 3
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from results_file import write_result  # noqa: E402

import deepfuse  # noqa: E402
from deepfuse.models import load_model  # noqa: E402
from tests.helpers import sampled_with  # noqa: E402

PROMPTS = ["The capital of France is", "Write a haiku about the sea", "1, 2, 3,"]
PARAMS = [{"temperature": 0.8, "top_k": 0, "top_p": 1.0, "seed": 1},
          {"temperature": 1.0, "top_k": 50, "top_p": 0.9, "seed": 7},
          {"temperature": 0.7, "top_k": 20, "top_p": 0.95, "seed": 42}]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--targets", default="ascend950,sm90")
    ap.add_argument("--tokens", type=int, default=3)
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    prompts = [tok.encode(p) for p in PROMPTS]
    want = sampled_with(deepfuse.compile(model, target="cpu"), model.config, prompts, args.tokens, PARAMS)
    print(f"{'cpu':10s} {want}")
    rows = []
    for target in args.targets.split(","):
        art = deepfuse.compile(model, target=target)
        assert art.plan["host_steps"] == [], art.plan["host_steps"]
        kinds: dict[str, int] = {}
        for p in art.plan["launches"]:
            kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
        t0 = time.perf_counter()
        got = sampled_with(art, model.config, prompts, args.tokens, PARAMS)
        seconds = time.perf_counter() - t0
        print(f"{target:10s} {got} {'equal' if got == want else 'DIFFERENT'} launches {kinds} ({seconds:.0f} s)")
        rows.append({"target": target, "tokens": got, "equal": got == want, "launches": kinds, "seconds": round(seconds, 1)})
    write_result("sampled_on_devices.json", {"prompts": PROMPTS, "params": PARAMS, "cpu_tokens": want, "targets": rows})


if __name__ == "__main__":
    main()
