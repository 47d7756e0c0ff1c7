"""Why the sm90 GEMMs are slower inside a whole step than alone (docs/targets.md): each
kernel of a 30-layer SmolLM2-shaped bf16 step timed three ways on one GPU:

  in step    CUDA events around each launch while the whole step runs, every layer's own weights
  same op    one op's launches of all 30 layers back to back (each with its own weights), per launch
  alone      triton.testing.do_bench on layer 0's launch: one input, repeated (weights stay in L2)

for the source's JIT build, then "in step" and "alone" again for the artifact's AOT cubins
(what Engine launches),

for a decode step of 64 sequences at position 300 and a 1024-token prefill step.

    python benchmarks/gpu_kernel_times.py [--out FILE] [--dry-run]

--dry-run: 2 layers of a tiny shape, f32, in Triton's interpreter (TRITON_INTERPRET=1), no timing.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from device_check import step  # noqa: E402
from gpu_throughput import refuse_wrong_machine, smollm2_shaped  # noqa: E402

from deepfuse.codegen.triton.runner import TritonRunner, as_list  # noqa: E402


def timed_step(runner, plan, inputs, dry: bool) -> tuple[dict, list]:
    """Runs the step launch by launch; {kernel names: [µs per launch]} (empty when dry) and the
    launches with their inputs."""
    env = list(runner.base)
    for name, s in plan["inputs"].items():
        env[s] = inputs[name]
    times, launches, events = defaultdict(list), [], []
    for p, kernels, ref in runner.launches:
        ins = [env[i] for i in p["in"]]
        key = p["op"] + " " + "+".join(spec["name"].rsplit("_", 1)[-1] for spec, _ in kernels)
        if kernels:
            start, end = (None, None) if dry else (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if start:
                start.record()
            outs = runner._run(p, kernels, ins)
            if end:
                end.record()
                events.append((key, start, end))
            launches.append((key, p, kernels, ins))
        else:
            outs = as_list(ref(*ins, **p["attrs"]))
        for s, t in zip(p["out"], outs):
            env[s] = t
    if not dry:
        torch.cuda.synchronize()
        for key, start, end in events:
            times[key].append(start.elapsed_time(end) * 1000)
    return times, launches


def same_op_back_to_back(runner, launches, key: str) -> float:
    """µs per launch of all of `key`'s launches run one after another, median of 5 passes."""
    mine = [(p, kernels, ins) for k, p, kernels, ins in launches if k == key]
    passes = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for p, kernels, ins in mine:
            runner._run(p, kernels, ins)
        end.record()
        torch.cuda.synchronize()
        passes.append(start.elapsed_time(end) * 1000 / len(mine))
    return statistics.median(passes[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_kernel_times.json"))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dry = args.dry_run
    refuse_wrong_machine(dry)
    import deepfuse
    from deepfuse.models import load_model

    dtype, tdt = ("f32", torch.float32) if dry else ("bf16", torch.bfloat16)
    device = torch.device("cpu" if dry else "cuda")
    with tempfile.TemporaryDirectory() as path:
        smollm2_shaped(path, dry)
        model = load_model(path, with_tokenizer=False)[0]
    art = deepfuse.compile(model, target="sm90", dtype=dtype)  # the artifact's AOT cubins: what Engine launches
    runners = {"jit": TritonRunner(art.plan, art.graph.weights), "cubin": art.runner}
    steps = {"decode x64 at 300": (0, 64, 300), "prefill 1024": (1024, 0, 0)}
    if dry:
        steps = {"decode x2 at 20": (0, 2, 20), "prefill 20": (20, 0, 0)}
    result = {"device": "cpu (dry run)" if dry else torch.cuda.get_device_name(), "layers": model.config.num_layers,
              "cubin_runner": art.runner.kernel_source, "steps": {}, "complete": False}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save() -> None:  # after every step: a run stopped by its time limit still leaves what it timed
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    columns = ("in_step_us", "same_op_us", "alone_us", "cubin_in_step_us", "cubin_alone_us")
    for name, (prefill, decodes, pos) in steps.items():
        inputs = step(model.config, tdt, device, prefill, decodes, pos)
        rows: dict[str, dict] = {}
        for which, runner in runners.items():
            prefix = "" if which == "jit" else "cubin_"
            for _ in range(1 if dry else 2):  # JIT and warm-up
                timed_step(runner, art.plan, inputs, dry)
            times, launches = defaultdict(list), []
            for _ in range(1 if dry else 3):
                t, launches = timed_step(runner, art.plan, inputs, dry)
                for k, v in t.items():
                    times[k] += v
            for key in dict.fromkeys(k for k, *_ in launches):
                p, kernels, ins = next((p, kernels, ins) for k, p, kernels, ins in launches if k == key)
                row = rows.setdefault(key, {"launches_per_step": sum(1 for k, *_ in launches if k == key)})
                if dry:
                    continue
                import triton.testing

                row[prefix + "in_step_us"] = statistics.median(times[key])
                if which == "jit":
                    row["same_op_us"] = same_op_back_to_back(runner, launches, key)
                row[prefix + "alone_us"] = triton.testing.do_bench(
                    lambda runner=runner, p=p, kernels=kernels, ins=ins: runner._run(p, kernels, ins),
                    warmup=10, rep=50) * 1000
        result["steps"][name] = rows
        save()
        print(f"\n{name}: µs per launch{' (dry run: not timed)' if dry else ''}; JIT build, then the artifact's "
              f"{art.runner.kernel_source}")
        print(f"{'op + kernels':40s} {'per step':>8s} {'in step':>9s} {'same op':>9s} {'alone':>9s} "
              f"{'in step':>9s} {'alone':>9s}")
        for key, r in rows.items():
            cells = " ".join(f"{r[c]:9.1f}" if c in r else f"{'-':>9s}" for c in columns)
            print(f"{key:40s} {r['launches_per_step']:8d} {cells}")
    result["complete"] = True
    save()


if __name__ == "__main__":
    main()
