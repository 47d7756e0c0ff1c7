"""Host time of a decode step: how much of an engine step is not kernel time, with the bound
step run as one native program (the default) and with its bound calls made one by one from
Python (`StepBinder(programs=False)`, as before step programs), in one process, interleaved.

For batch 1 and batch 64 (SmolLM2-135M, bf16 + int4 by default), each mode decodes `--tokens`
tokens a request, `--runs` times; per decode step (every sequence one token) it records the
engine's whole `step()`, the compiled model's call inside it (or its rerun of the last call's
prepared calls, for a decode step after one of the same sequences: Engine.forward), and the native program's run
(kernels plus their C++ dispatch). Host time = step - program time (the program time of the
same batch measured in native mode is used for the Python mode, whose kernels are the same; each
mode's own program time, and the host time less it, are reported beside).
Medians over all decode steps of all runs (a step() call's time over the decode steps it made),
and means (all decode time over all decode steps: a burst's first steps, slower after the prefill
or a rebind, weigh as they do in a run). Writes benchmarks/results/step_host.json
(step_host_overlap.json with --overlap).
--overlap adds a third mode, the native program in an engine with Engine(overlap=True)
(runtime/overlap.py: each step() launches the next decode step, then reads the last one's
tokens): its step still holds one model call, so on the CPU, where the call returns only once
the step has run, the host time is not hidden; the row shows what the overlapped loop's own
bookkeeping (the feed, token copies, undo records) costs a step.
--decode-steps K adds the native program in an engine with Engine(decode_steps=K)
(runtime/decode_burst.py: a step() runs up to K decode steps before the host takes their tokens,
the steps after the first rerunning the executor's prepared calls; step_host_burst.json): with
a few calls a run, its means say more than its medians.
--fresh-calls adds the native program in an engine whose decode steps are each a new model call
(the fill's fresh views and the executor's layout lookup, instead of StepBuffers.refill and
CpuExecutor.rerun; step_host_fresh_calls.json): what the one-step engine's rerun saves.

    python benchmarks/step_host.py [--runs 3] [--tokens 32] [--quant int4] [--overlap | --decode-steps 8 | --fresh-calls]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_file import write_result

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


class Timer:
    """Records the wall time of each call of cls.name, for each of names (patched on the class),
    into self.times."""

    def __init__(self, cls, *names: str):
        self.times: list[float] = []
        for name in names:
            setattr(cls, name, self._timed(getattr(cls, name)))

    def _timed(self, real):
        def timed(*args, **kw):
            t = time.perf_counter()
            try:
                return real(*args, **kw)
            finally:
                self.times.append(time.perf_counter() - t)

        return timed


def decode_steps(eng, prompts, params, model_timer: Timer, program_timer: Timer, batch: int) -> list[tuple]:
    """(step, model calls, program runs, decode steps) of each step() call in which `batch`
    sequences decode: seconds, and how many decode steps (program runs) it made (a burst's K)."""
    for ids in prompts:
        eng.add_request(ids, params)
    out = []
    while eng.has_unfinished():
        running = [r for r in eng.scheduler.running]
        decoding = len(running) == batch and all(r.remaining == 1 for r in running)
        m, p = len(model_timer.times), len(program_timer.times)
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        runs = len(program_timer.times) - p
        if decoding and len(model_timer.times) > m and runs:
            out.append((dt, sum(model_timer.times[m:]), sum(program_timer.times[p:]), runs))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quant", default="int4")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--overlap", action="store_true", help="also the native program with Engine(overlap=True)")
    ap.add_argument("--fresh-calls", action="store_true", help="also the native program with every decode step "
                    "a new model call (no rerun of the last step's prepared calls)")
    ap.add_argument("--decode-steps", type=int, default=1, help="K > 1: also the native program with "
                    "Engine(decode_steps=K)")
    args = ap.parse_args()
    import deepfuse
    from deepfuse.codegen.cpu.bound import StepBinder
    from deepfuse.codegen.cpu.executor import CpuExecutor
    from deepfuse.codegen.cpu.program import Segments
    from deepfuse.models import load_model
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig

    model, tok = load_model("smollm2")
    art = deepfuse.compile(model, dtype="bf16", quant=args.quant or None)
    model_timer, program_timer = Timer(CpuExecutor, "__call__", "rerun"), Timer(Segments, "run")
    ids = tok.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    results = {}
    for batch in (int(b) for b in args.batches.split(",")):
        prompts = [ids[: len(ids) - i % 7] for i in range(batch)]
        # (mode, step programs, engine: its overlap, decode_steps and whether a decode step reruns the last)
        modes = [("native program", True, (False, 1, True)), ("python calls", False, (False, 1, True))]
        modes += [("native, fresh calls", True, (False, 1, False))] if args.fresh_calls else []
        modes += [("native, overlapped", True, (True, 1, True))] if args.overlap else []
        modes += [(f"native, burst {args.decode_steps}", True, (False, args.decode_steps, True))] \
            if args.decode_steps > 1 else []
        engines = {}
        for kind in sorted({m[2] for m in modes}):
            engines[kind] = Engine(art, CacheConfig(enable_prefix_caching=False), max_num_seqs=max(batch, 1),
                                   overlap=kind[0], decode_steps=kind[1])
            if not kind[2]:  # every decode step a new model call (fill's fresh views, the layout lookup)
                engines[kind].buffers.refill = lambda chunks, cache: None
            engines[kind].generate(prompts[:1], [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)])
        steps = {mode: [] for mode, _, _ in modes}
        for _ in range(args.runs):
            for mode, programs, kind in modes:
                art.runner.binder = StepBinder(programs=programs)
                steps[mode] += decode_steps(engines[kind], prompts, params, model_timer, program_timer, batch)
        native = steps["native program"]
        kernels = statistics.median(p / k for _, _, p, k in native)
        kernels_mean = sum(p for _, _, p, _ in native) / sum(k for *_, k in native)
        row = {}
        for mode, got in steps.items():
            step = statistics.median(s / k for s, _, _, k in got)  # a step() call's time per decode step
            mean = sum(s for s, *_ in got) / sum(k for *_, k in got)  # all decode time over all decode steps
            call = statistics.median(c / k for _, c, _, k in got)  # the model calls' time per decode step
            own = statistics.median(p / k for _, _, p, k in got)  # this mode's own program runs (its kernels
            # where it runs a native program; its calls from Python in the Python mode)
            row[mode] = {"own_program_ms": own * 1e3, "host_us_own_program": (step - own) * 1e6,
                         "steps": sum(k for *_, k in got), "calls": len(got), "step_ms": step * 1e3,
                         "mean_step_ms": mean * 1e3, "model_call_ms": call * 1e3, "program_ms": kernels * 1e3,
                         "mean_program_ms": kernels_mean * 1e3, "host_us": (step - kernels) * 1e6,
                         "mean_host_us": (mean - kernels_mean) * 1e6, "host_in_model_call_us": (call - kernels) * 1e6}
        results[f"batch {batch}"] = row
    print(f"\nSmolLM2-135M bf16{'+' + args.quant if args.quant else ''}, decode steps, medians of all steps "
          f"of {args.runs} runs, {torch.get_num_threads()} threads")
    print(f"{'batch':8s} {'mode':18s} {'steps':>5s} {'step ms':>8s} {'model ms':>9s} {'kernels ms':>10s} "
          f"{'host us':>8s} {'host in model us':>16s} {'mean step ms':>12s} {'mean host us':>12s} "
          f"{'own program ms':>14s} {'host us (own)':>13s}")
    for batch, row in results.items():
        for mode, r in row.items():
            print(f"{batch:8s} {mode:18s} {r['steps']:5d} {r['step_ms']:8.3f} {r['model_call_ms']:9.3f} "
                  f"{r['program_ms']:10.3f} {r['host_us']:8.0f} {r['host_in_model_call_us']:16.0f} "
                  f"{r['mean_step_ms']:12.3f} {r['mean_host_us']:12.0f} {r['own_program_ms']:14.3f} "
                  f"{r['host_us_own_program']:13.0f}")
    meta = {"runs": args.runs, "tokens": args.tokens, "quant": args.quant, "threads": torch.get_num_threads(),
            "overlap": args.overlap, "decode_steps": args.decode_steps, "fresh_calls": args.fresh_calls}
    name = "step_host_overlap.json" if args.overlap else "step_host_burst.json" if args.decode_steps > 1 \
        else "step_host_fresh_calls.json" if args.fresh_calls else "step_host.json"
    write_result(name, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
