"""A/B of the CPU build: this checkout against an earlier commit, in alternating processes on the
same machine. By default only the native sources differ (deepfuse/codegen/cpu/*.cpp and *.h at
--base, built as their own extension module; the Python is this checkout's for both, so --base
must be a commit whose kernels this Python can call). With --python the base side runs the whole
deepfuse package of --base (its Python and its native sources, built as that package builds them):
for a change to the Python around the kernels.

Each process loads SmolLM2 and its Q4_1 GGUF, compiles a bf16 build (--quant: int4-a8 by
default), warms it up and then
measures batch-1 decode tok/s (decode.py's runner, --new-tokens, median of --runs runs) and,
in as many runs again with each step program timing its ops (StepProgram.profile), the decode
program's mean ms per step by op. With --workload throughput it measures instead the throughput
benchmark's workload (throughput.py's run_deepfuse: 64 requests, 128 output tokens each, a new
build each run; --kv-cache-dtype int8 for its int8 KV cache) in output tok/s, without op times.
Rounds alternate which side runs first; the table shows medians
over the rounds and the per-round ratios go to benchmarks/results/<--result>.

    python benchmarks/native_ab.py --base cbe7833 [--python] [--quant int4] [--rounds 5] [--runs 3] [--result native_ab.json]
    python benchmarks/native_ab.py --base f256449 --python --workload throughput --quant w8a8 --kv-cache-dtype int8
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict

from results_file import write_result

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CPU = "deepfuse/codegen/cpu"


def base_sources(commit: str) -> str:
    """The native sources at commit, in a directory of their own (made once): its path."""
    sha = subprocess.run(["git", "rev-parse", "--short=12", commit], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    from deepfuse.codegen.cpu.native import build_tag

    where = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "ab", f"{build_tag()}_{sha}")
    if not os.path.exists(os.path.join(where, "complete")):
        os.makedirs(where, exist_ok=True)
        names = subprocess.run(["git", "ls-tree", "--name-only", f"{sha}:{CPU}"], cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout.split()
        for name in names:
            if name.endswith((".cpp", ".h")):
                data = subprocess.run(["git", "show", f"{sha}:{CPU}/{name}"], cwd=ROOT, capture_output=True,
                                      check=True).stdout
                with open(os.path.join(where, name), "wb") as f:
                    f.write(data)
        open(os.path.join(where, "complete"), "w").close()
    return where


def base_package(commit: str) -> str:
    """The deepfuse package at commit, in a directory of its own (made once): the directory to put
    first on sys.path."""
    sha = subprocess.run(["git", "rev-parse", "--short=12", commit], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    where = os.path.join(os.path.expanduser("~"), ".cache", "deepfuse", "ab", f"package_{sha}")
    if not os.path.exists(os.path.join(where, "complete")):
        os.makedirs(where, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "deepfuse"], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", where], input=archive, check=True)
        open(os.path.join(where, "complete"), "w").close()
    return where


def use_package(where: str) -> None:
    """Makes `import deepfuse` take the package in `where` (before this checkout's)."""
    sys.path.insert(0, where)
    import deepfuse

    if not os.path.abspath(deepfuse.__file__).startswith(os.path.abspath(where) + os.sep):
        raise SystemExit(f"deepfuse came from {deepfuse.__file__}, not from {where}")


def use_sources(where: str) -> None:
    """Makes deepfuse's native kernels the module built from the sources in `where`."""
    from torch.utils.cpp_extension import load

    from deepfuse.codegen.cpu import native

    missing = [s for s in native.SOURCES if not os.path.exists(os.path.join(where, s))]
    if missing:
        raise SystemExit(f"the base commit lacks {missing}: pick a commit whose kernels this checkout's Python calls")
    name = "deepfuse_ab_" + os.path.basename(where).replace("-", "_")
    os.makedirs(os.path.join(where, "build"), exist_ok=True)
    module = load(name=name, sources=[os.path.join(where, s) for s in native.SOURCES],
                  build_directory=os.path.join(where, "build"),
                  extra_cflags=["-O3", "-march=native", "-fopenmp", f"-DDEEPFUSE_SOURCES={name}"],
                  extra_ldflags=["-fopenmp"], verbose=False)
    native.build = lambda: module


def measure(quant: str, new_tokens: int, runs: int) -> dict:
    """One process's figures: decode tok/s per run, and the decode program's mean ms per step by op."""
    from decode import PROMPT, deepfuse_runner

    import deepfuse.codegen.cpu.program as program
    from deepfuse.models import load_model

    segments: list[program.Segments] = []
    make_segments = program.Segments.__init__

    def kept(self, *args, **kwargs):
        make_segments(self, *args, **kwargs)
        segments.append(self)

    program.Segments.__init__ = kept
    model, tok = load_model("smollm2")
    run = deepfuse_runner("bf16", tok.encode(PROMPT), new_tokens, model, quant)
    run()
    tps = [run()["decode_tps"] for _ in range(runs)]
    if not all(hasattr(s, "profile") for s in segments):  # (--python: a package from before op timing)
        return {"tps": tps, "ops_ms": {}}
    for s in segments:
        s.profile(True)
    for _ in range(runs):
        run()
    _, by_op = max((s.op_seconds() for s in segments), key=lambda r: r[0])  # the decode step's program
    ops: dict[str, float] = defaultdict(float)
    for name, sec in by_op:
        ops[name] += sec * 1e3
    return {"tps": tps, "ops_ms": dict(ops)}


def measure_throughput(quant: str, kv_cache_dtype: str | None, runs: int) -> dict:
    """One process's figures: the throughput workload's output tok/s per run (no op times: a step's
    program differs with its batch)."""
    from throughput import make_prompts, run_deepfuse

    from deepfuse.models import load_model

    model, tok = load_model("smollm2")
    prompts, warmup = make_prompts(tok, 64), make_prompts(tok, 2, seed=1)
    tps = [run_deepfuse(model, prompts, warmup, "bf16", quant, kv_cache_dtype=kv_cache_dtype)["output_tps"]
           for _ in range(runs)]
    return {"tps": tps, "ops_ms": {}}


def child(a) -> None:
    if a.child.startswith("package:"):
        use_package(a.child[len("package:"):])
    elif a.child != "tree":
        use_sources(a.child)
    figures = (measure_throughput(a.quant, a.kv_cache_dtype, a.runs) if a.workload == "throughput"
               else measure(a.quant, a.new_tokens, a.runs))
    print("RESULT " + json.dumps(figures), flush=True)


def parent(a) -> None:
    base = "package:" + base_package(a.base) if a.python else base_sources(a.base)
    sides = {a.base: base, "this checkout": "tree"}
    what = "output" if a.workload == "throughput" else "decode"
    got: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(a.rounds):
        for side, spec in list(sides.items())[::1 if r % 2 == 0 else -1]:  # each side first in every other round
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", spec, "--runs", str(a.runs),
                                  "--new-tokens", str(a.new_tokens), "--quant", a.quant, "--workload", a.workload,
                                  *(["--kv-cache-dtype", a.kv_cache_dtype] if a.kv_cache_dtype else [])],
                                 capture_output=True, text=True)
            line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"the {side} process failed:\n{out.stderr[-3000:]}")
            got[side].append(json.loads(line[len("RESULT "):]))
            ops_ms = got[side][-1]["ops_ms"]
            print(f"round {r + 1} {side:14s} {what} {statistics.median(got[side][-1]['tps']):6.1f} tok/s"
                  + (f", program {sum(ops_ms.values()):.3f} ms" if ops_ms else ""), flush=True)
    summary = {}
    for side, rounds in got.items():
        tps = [statistics.median(x["tps"]) for x in rounds]
        names = list(rounds[0]["ops_ms"])
        summary[side] = {f"{what}_tps_median": statistics.median(tps), f"{what}_tps_rounds": tps}
        if names:  # (the throughput workload has no op times)
            summary[side] |= {"program_ms_median": statistics.median(sum(x["ops_ms"].values()) for x in rounds),
                              "ops_ms_median": {n: statistics.median(x["ops_ms"].get(n, 0.0) for x in rounds)
                                                for n in names}}
    old, new = summary[a.base], summary["this checkout"]
    ratios = [n / o for n, o in zip(new[f"{what}_tps_rounds"], old[f"{what}_tps_rounds"])]
    kv = f", {a.kv_cache_dtype} KV" if a.kv_cache_dtype else ""
    print(f"\nbf16 + {a.quant}{kv} {'throughput workload' if a.workload == 'throughput' else 'batch-1 decode'}, "
          f"medians over {a.rounds} rounds" + (" (the op times: each op's own, as the program times it; entering and"
                                               " leaving a team's region falls between them, so compare the tok/s):"
                                               if "ops_ms_median" in new else ":"))
    print(f"  {'':28s} {a.base:>12s} {'this checkout':>14s}")
    print(f"  {what + ' tok/s':28s} {old[what + '_tps_median']:12.1f} {new[what + '_tps_median']:14.1f}")
    if "ops_ms_median" in new:
        print(f"  {'decode program ms':28s} {old['program_ms_median']:12.3f} {new['program_ms_median']:14.3f}")
    for n in new.get("ops_ms_median", {}):
        print(f"  {n:28s} {old['ops_ms_median'].get(n, 0.0):12.3f} {new['ops_ms_median'][n]:14.3f}")
    print(f"  per-round tok/s ratio (this checkout / base): {', '.join(f'{x:.3f}' for x in ratios)}")
    new_tokens = a.new_tokens if a.workload == "decode" else 128  # (throughput.py's OUT_TOKENS a request)
    path = write_result(a.result, {"config": {"base": a.base, "python": a.python, "rounds": a.rounds, "runs": a.runs,
                                              "new_tokens": new_tokens, "quant": a.quant,
                                              "workload": a.workload, "kv_cache_dtype": a.kv_cache_dtype},
                                   "sides": summary, "tps_ratio_rounds": ratios,
                                   "tps_ratio_median": statistics.median(ratios)})
    print("wrote", path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="the commit whose native sources to compare against")
    ap.add_argument("--python", action="store_true", help="the base side runs the base commit's whole package")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=128, help="decode workload only (throughput: 128 a request)")
    ap.add_argument("--quant", default="int4-a8", help="the build's quant: int4-a8, int4 (bf16+int4), int4-head8, ...")
    ap.add_argument("--workload", choices=("decode", "throughput"), default="decode",
                    help="batch-1 decode (decode.py's runner), or throughput.py's 64-request workload")
    ap.add_argument("--kv-cache-dtype", help="the build's KV cache dtype (int8); the throughput workload only")
    ap.add_argument("--result", default="native_ab.json", help="the file under benchmarks/results/ to write")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # a measuring process: "tree", a sources directory or
    # "package:" and a package's directory
    a = ap.parse_args()
    if a.kv_cache_dtype and a.workload != "throughput":
        ap.error("--kv-cache-dtype is for --workload throughput (the decode runner builds a bf16 cache)")
    if a.child:
        child(a)
    elif not a.base:
        ap.error("--base is required")
    else:
        parent(a)


if __name__ == "__main__":
    main()
