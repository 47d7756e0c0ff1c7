"""Batch-1 decode tok/s of one build by the thread that runs its steps, each mode in its own
process (an OpenMP thread pool, once made, stays for the life of its thread):
  main         built and run on the main thread (LLM.generate, as decode.py runs it)
  two pools    built on the main thread (compiling runs parallel torch ops there), run on a second
               thread: AsyncLLM over an LLM built by its caller
  one thread   built and run on a second thread, the main thread running no parallel region:
               AsyncLLM given the LLM's arguments, as `deepfuse serve` gives them
Rounds alternate the modes' order; the table shows medians and the per-round tok/s go to
benchmarks/results/<--result>.

    python benchmarks/engine_thread.py [--rounds 3] [--quants int4,int4-a8] [--result engine_thread.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time

from results_file import write_result

MODES = ("main", "two pools", "one thread")
PROMPT, TOKENS = "The history of the lighthouse", 128


def decode_tps(quant: str) -> float:
    """Builds the bf16 SmolLM2 build `quant` and returns its batch-1 decode tok/s (median of 3)."""
    from deepfuse import LLM, SamplingParams

    llm = LLM("smollm2", dtype="bf16", quant=quant)
    p = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    return _measure(llm, p)


def _measure(llm, p) -> float:
    llm.generate([PROMPT], p, use_tqdm=False)
    rates = []
    for _ in range(3):
        out = llm.generate([PROMPT], p, use_tqdm=False)[0]
        rates.append((TOKENS - 1) / (out.metrics.total_s - out.metrics.ttft_s))
    return statistics.median(rates)


def child(mode: str, quant: str) -> float:
    if mode == "main":
        return decode_tps(quant)
    result: list[float] = []
    if mode == "two pools":
        from deepfuse import LLM, SamplingParams

        llm = LLM("smollm2", dtype="bf16", quant=quant)
        p = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        work = lambda: result.append(_measure(llm, p))  # noqa: E731
    else:
        work = lambda: result.append(decode_tps(quant))  # noqa: E731
    t = threading.Thread(target=work)
    t.start()
    t.join()
    return result[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quants", default="int4,int4-a8")
    ap.add_argument("--result", default="engine_thread.json", help="the file under benchmarks/results/ to write")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "QUANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return
    runs: dict[str, dict[str, list[float]]] = {q: {m: [] for m in MODES} for q in a.quants.split(",")}
    for r in range(a.rounds):
        for q in runs:
            order = MODES[r % 3:] + MODES[:r % 3]
            for m in order:
                t = time.perf_counter()
                out = subprocess.run([sys.executable, __file__, "--child", m, q], capture_output=True, text=True)
                if out.returncode != 0:
                    raise SystemExit(f"{m} {q} failed:\n{out.stderr[-2000:]}")
                runs[q][m].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}, {q}, {m}: {runs[q][m][-1]:.1f} tok/s ({time.perf_counter() - t:.0f} s)",
                      flush=True)
    print(f"\nbatch-1 decode tok/s by the thread that runs the steps (bf16 builds, median of {a.rounds} rounds)")
    print(f"{'build':8s} {'main':>8s} {'two pools':>10s} {'one thread':>11s}")
    for q, by in runs.items():
        med = {m: statistics.median(v) for m, v in by.items()}
        print(f"{q:8s} {med['main']:8.1f} {med['two pools']:10.1f} {med['one thread']:11.1f}")
    write_result(a.result, {"rounds": a.rounds, "tokens": TOKENS, "decode_tps_per_round": runs,
                            "decode_tps_median": {q: {m: statistics.median(v) for m, v in by.items()}
                                                  for q, by in runs.items()}})


if __name__ == "__main__":
    main()
