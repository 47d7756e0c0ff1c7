"""Where a batch-1 decode step's time goes: timers around the engine's step, the compiled
model's call (or its rerun of the last call's prepared calls), the native step program (every
layer; for a build with a W8A8 head, the head and the sampling tail too), the W8A8 LM head where
it runs from Python, and the input fill (or refill), for the int4-a8 build of SmolLM2 (decode.py's
prompt and engine), in one process.

Per decode step (the prompt's prefill step left out; a part timed twice in a step counts as
their sum) it reports the medians of each part and
what is left: Python in the model call (binding the inputs, any launches run from Python) and in
the engine's step (scheduling, outputs). Then, in as many runs again with each step program
timing its ops (StepProgram.profile), the decode program's mean time per step by op kind (the
kernel and its forks and joins; entering and leaving the region of a run of ops that shares a
thread team falls between ops, so the ops sum to a little less than the program), from the program
that ran the most steps (a program first bound during these runs is not timed). Writes
benchmarks/results/decode_split.json.

    python benchmarks/decode_split.py [--runs 3] [--new-tokens 128] [--quant int4-a8] [--result decode_split.json]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

from results_file import write_result


def timed(owner, name: str, key: str, times: dict) -> None:
    """Wraps owner.name so that each call's seconds go to times[key]."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[key].append(time.perf_counter() - t)

    setattr(owner, name, wrapper)


def one_per_step(engine_cls, times: dict) -> None:
    """Wraps engine_cls.step so that each key's times from one step() become one entry, their
    sum (a refill and then a fill, a rerun that gave None and then a call)."""
    step = engine_cls.step

    def summed(*args, **kwargs):
        marks = {k: len(v) for k, v in times.items()}
        try:
            return step(*args, **kwargs)
        finally:
            for k, v in times.items():
                n = marks.get(k, 0)
                if len(v) > n + 1:
                    v[n:] = [sum(v[n:])]

    engine_cls.step = summed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--quant", default="int4-a8")
    ap.add_argument("--result", default="decode_split.json", help="the file under benchmarks/results/ to write")
    a = ap.parse_args()

    from decode import PROMPT, deepfuse_runner

    import deepfuse.codegen.artifact as artifact
    import deepfuse.codegen.cpu.program as program
    import deepfuse.codegen.cpu.w8a8_kernels as w8a8_kernels
    import deepfuse.runtime.batch as batch
    import deepfuse.runtime.engine as engine
    from deepfuse.models import load_model

    segments: list[program.Segments] = []  # every bound step's, to profile
    make_segments = program.Segments.__init__

    def kept(self, *args, **kwargs):
        make_segments(self, *args, **kwargs)
        segments.append(self)

    program.Segments.__init__ = kept
    times: dict[str, list[float]] = defaultdict(list)
    timed(engine.Engine, "step", "step", times)
    timed(artifact.CompiledModel, "__call__", "model call", times)
    timed(artifact.CompiledModel, "rerun", "model call", times)  # a decode step after one of the same sequences
    timed(program.Segments, "run", "native program", times)
    timed(w8a8_kernels, "w8a8_logits", "LM head from Python (W8A8)", times)
    timed(batch.StepBuffers, "fill", "input fill", times)
    timed(batch.StepBuffers, "refill", "input fill", times)
    one_per_step(engine.Engine, times)

    model, tok = load_model("smollm2")
    ids = tok.encode(PROMPT)
    run = deepfuse_runner("bf16", ids, a.new_tokens, model, a.quant)
    run()
    decode: dict[str, list[float]] = defaultdict(list)
    for _ in range(a.runs):
        times.clear()
        run()
        for k, v in times.items():
            decode[k] += v[1:]  # the first step of a run is its prompt's prefill
    ms = {k: statistics.median(v) * 1e3 for k, v in decode.items() if v}  # the head runs from Python at prefill only
    ms["model call, other (Python)"] = ms["model call"] - ms["native program"] - ms.get("LM head from Python (W8A8)", 0.0)
    ms["step, outside the model call (host)"] = ms["step"] - ms["model call"]
    print(f"SmolLM2-135M bf16+{a.quant}, batch-1 decode steps, medians over {a.runs} x {a.new_tokens - 1} steps")
    for k, v in ms.items():
        print(f"  {k:40s} {v:7.3f} ms")
    for s in segments:
        s.profile(True)
    for _ in range(a.runs):
        run()
    steps, by_op = max((s.op_seconds() for s in segments), key=lambda r: r[0])  # the decode step's program
    ops: dict[str, dict] = {}
    for name, sec in by_op:
        op = ops.setdefault(name, {"ms": 0.0, "per_step": 0})
        op["ms"] += sec * 1e3
        op["per_step"] += 1
    print(f"decode program by op, mean ms per step over {steps} steps (the op and its parallel region):")
    for name, op in sorted(ops.items(), key=lambda kv: -kv[1]["ms"]):
        print(f"  {name:24s} {op['ms']:7.3f} ms  {op['per_step']:4d} per step, {op['ms'] / op['per_step'] * 1e3:7.1f} us each")
    print(f"  {'all ops':24s} {sum(op['ms'] for op in ops.values()):7.3f} ms")
    path = write_result(a.result, {"config": {k: v for k, v in vars(a).items() if k != "result"}, "median_ms": ms,
                                   "steps": len(decode["step"]), "program_by_op_mean_ms": ops,
                                   "profiled_steps": steps})
    print("wrote", path)


if __name__ == "__main__":
    main()
