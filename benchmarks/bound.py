"""The least time benchmarks/throughput.py's workload can take on this CPU, per kind of arithmetic.

Counts the run's multiply-adds from SmolLM2's config and the prompt lengths that throughput.py
wrote to benchmarks/results/throughput.json, measures the CPU's instruction peaks (peak.cpp,
compiled here with g++: `vdpbf16ps` for bf16, `vpdpbusd` for int8) on as many threads as torch
uses, and sets each engine's measured tok/s from that file against the most its arithmetic allows.

The bound is generous: every multiply-add at the instruction's peak, and nothing else (norms,
RoPE, softmax, int4 unpacking, sampling, scheduling) costing any time. Each output token after
the first goes through the model once; each prompt token once (no prefix is shared).

    python benchmarks/throughput.py --engines deepfuse-int4,deepfuse-w8a8-kv8,hf   # first
    python benchmarks/bound.py

With --decode, the bandwidth bound of batch-1 decode instead (benchmarks/decode.py's run): the
bytes one token reads (decode_bytes: an int4 build's projections, its LM head in the engine's
format, its KV rows) against this machine's read bandwidth (read_bw.cpp), set against each
int4 engine of decode.json (llama.cpp's Q4_1 file with its Q8_0 head included). decode.py reads
the bandwidth in each of its rounds, beside the engines' runs (this VM's moves by half within an
hour): each round's tok/s is set against that round's bandwidth, and the median of those shares
reported (so it need not equal the median tok/s over the bound at the median bandwidth).
It reads twice a round: over 1 GiB, and over each head's working set (the bytes one token reads,
read again and again as decoding does); the bound takes the working-set reading where the run has
it. On a CPU whose last-level cache holds much of a token's ~100 MB (a Xeon reporting 480 MB of
L3: 47 GB/s over 96 MiB against 25 GB/s over 1 GiB) the 1 GiB sweep is no bound at all.
Generous too: every byte at the best measured bandwidth, no arithmetic or dispatch costing time.

    python benchmarks/decode.py --engines "deepfuse bf16+int4,llama.cpp Q4_1"   # first
    python benchmarks/bound.py --decode
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile

from results_file import write_result

HERE = os.path.dirname(os.path.abspath(__file__))


def workload_macs(config, prompt_lens: list[int], out_tokens: int) -> dict[str, float]:
    """Multiply-adds of the whole run: 'projections' (q, k, v, o, gate, up, down of every token
    through every layer), 'lm_head' (one row per output token), 'attention' (q.k and p.v of every
    causal pair, each query head)."""
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_token = layers * (d * q + 2 * d * kv + q * d + 3 * d * f)
    tokens = [p + out_tokens - 1 for p in prompt_lens]  # the prompt, then each output but the last as input
    pairs = sum(n * (n + 1) // 2 for n in tokens)  # the token at position i attends to i + 1 keys
    return {"projections": sum(tokens) * per_token,
            "lm_head": len(prompt_lens) * out_tokens * d * config.vocab_size,
            "attention": pairs * layers * 2 * q}


def instruction_peaks(threads: int, iterations: int = 100_000_000) -> dict[str, float]:
    """{'bf16': G multiply-adds/s, 'int8': ...} over `threads` threads (peak.cpp, best of 5 trials
    of `iterations` rounds of 12 instructions a thread)."""
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "peak")
        subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", os.path.join(HERE, "peak.cpp"), "-o", exe],
                       check=True)
        out = subprocess.run([exe, str(iterations)], check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    return {kind: float(rate) for kind, rate in (line.split() for line in out.splitlines())}


HEAD_BYTES = {"bf16": 2.0, "int8": 1.0, "q8_0": 34 / 32}  # per LM-head weight (int8: and an f32 scale per row)


def decode_bytes(config, context: float, head: str = "bf16") -> dict[str, float]:
    """Bytes one batch-1 decode token of an int4 build reads: 'projections' (int4 groups of 32,
    each 16 bytes of nibbles and a 4-byte scale and offset: Q4_1's 20 bytes), 'lm_head' (bf16;
    int8 with an f32 scale per row, as int4-head8's and int4-a8's; or Q8_0, 34 bytes per 32, as llama.cpp's
    file), 'kv' (bf16 keys and values of `context` positions, every layer)."""
    d, f, layers = config.hidden_size, config.intermediate_size, config.num_layers
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    weights = layers * (d * q + 2 * d * kv + q * d + 3 * d * f)
    head_bytes = config.vocab_size * (d * HEAD_BYTES[head] + (4 if head == "int8" else 0))
    return {"projections": weights * 20 / 32, "lm_head": head_bytes, "kv": layers * 2 * kv * 2 * context}


def head_of(engine: str) -> str | None:
    """The LM head format of a decode.py engine whose projections are int4 (None: not an int4 build)."""
    if engine.startswith("llama.cpp"):
        return "q8_0"
    if "int4-head8" in engine or "int4-a8" in engine:
        return "int8"
    return "bf16" if "int4" in engine else None


class ReadBandwidth:
    """read_bw.cpp compiled once (g++); calling it -> GB/s read over `threads` threads, best of 7
    passes over `mib` MiB (or the call's own mib)."""

    def __init__(self, threads: int, mib: int = 1024):
        self.threads, self.mib = threads, mib
        self.dir = tempfile.TemporaryDirectory()
        self.exe = os.path.join(self.dir.name, "read_bw")
        try:
            subprocess.run(["g++", "-O2", "-march=native", "-fopenmp", os.path.join(HERE, "read_bw.cpp"), "-o",
                            self.exe], check=True, capture_output=True, text=True)
        except (OSError, subprocess.CalledProcessError) as e:
            detail = getattr(e, "stderr", None) or str(e)
            raise SystemExit(f"read_bw.cpp did not compile with g++ -fopenmp: {detail.strip().splitlines()[-1]}") from e

    def __call__(self, mib: int | None = None) -> float:
        out = subprocess.run([self.exe, str(mib or self.mib)], check=True, capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": str(self.threads)}).stdout
        return float(out.split()[1])


def read_bandwidth(threads: int, mib: int = 1024) -> float:
    """GB/s read over `threads` threads (read_bw.cpp, best of 7 passes over `mib` MiB)."""
    return ReadBandwidth(threads, mib)()


def decode_bound(path: str) -> None:
    """The batch-1 decode bandwidth bound against the engines of decode.py's file at path; writes
    decode_bound.json for decode.json, else <its name>_bound.json (decode_xeon.json: decode_xeon_bound.json)."""
    with open(path) as f:
        run = json.load(f)
    meta, results = run["meta"], run["results"]
    from deepfuse.models import resolve_model_path
    from deepfuse.models.gguf_loader import load_gguf

    config, _ = load_gguf(resolve_model_path("smollm2"))
    context = meta["prompt_tokens"] + meta["new_tokens"] / 2
    sweep = meta.get("read_gb_per_s_per_run")  # measured in each of decode.py's rounds, over 1 GiB
    # and over each head's working set (a token's bytes), where the run has them: on a CPU whose
    # last-level cache holds much of that set, a 1 GiB sweep understates what a token can read
    working = meta.get("read_gb_per_s_working_set_per_run") or {}
    bounds, rounds = {}, {}
    for head in ("bf16", "int8", "q8_0"):
        per_round = working.get(head) or sweep
        rounds[head] = per_round
        bw = statistics.median(per_round) if per_round else read_bandwidth(meta["threads"])
        per_token = decode_bytes(config, context, head)
        total = sum(per_token.values())
        bounds[head] = {"bytes_per_token": per_token, "read_gb_per_s": bw, "most_tok_per_s": bw * 1e9 / total,
                        "read": "working set" if working.get(head) else "1 GiB sweep"}
        print(f"int4 projections, {head} head: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in per_token.items())
              + f", total {total / 1e6:.1f} MB; read {bw:.1f} GB/s ({bounds[head]['read']}, "
              + (f"median of {len(per_round)} rounds, {min(per_round):.1f}-{max(per_round):.1f}" if per_round else "now")
              + f") -> at most {bounds[head]['most_tok_per_s']:.0f} tok/s")
    print(f"\n{'engine':22s} {'head':>5s} {'decode tok/s':>12s} {'of its bound':>12s}")
    engines = {}
    for name, r in results.items():
        head = head_of(name)
        if head is None:
            continue
        total = sum(bounds[head]["bytes_per_token"].values())
        if rounds[head]:  # each round's tok/s against the bandwidth read in that round
            shares = [one["decode_tps"] / (g * 1e9 / total) for one, g in zip(r["runs"], rounds[head])]
            share = statistics.median(shares)
        else:
            shares, share = None, r["decode_tps"] / bounds[head]["most_tok_per_s"]
        engines[name] = {"head": head, "decode_tps": r["decode_tps"], "share_of_bound": share,
                         "share_of_bound_per_run": shares}
        print(f"{name:22s} {head:>5s} {r['decode_tps']:12.1f} {share:11.0%}"
              + (f"  (rounds {min(shares):.0%}-{max(shares):.0%})" if shares else ""))
    stem = os.path.splitext(os.path.basename(path))[0]
    write_result("decode_bound.json" if stem == "decode" else f"{stem}_bound.json",
                 {"decode_run": run.get("provenance"), "read_gb_per_s_per_run": sweep,
                  "read_gb_per_s_working_set_per_run": working or None, "bounds": bounds, "engines": engines})


def arithmetic_of(engine: str) -> str | None:
    """The dot-product instruction an engine's projections run on, from throughput.py's names."""
    if not engine.startswith("deepfuse"):
        return None
    if "w8a8" in engine:
        return "int8"
    return "bf16" if "int4" in engine or "bf16" in engine else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=None, help="the run to bound (default: throughput.json, or decode.json)")
    ap.add_argument("--decode", action="store_true", help="the batch-1 decode bandwidth bound (decode.json)")
    args = ap.parse_args()
    if args.decode:
        decode_bound(args.results or os.path.join(HERE, "results", "decode.json"))
        return
    args.results = args.results or os.path.join(HERE, "results", "throughput.json")
    with open(args.results) as f:
        run = json.load(f)
    meta, results = run["meta"], run["results"]
    from deepfuse.models import resolve_model_path
    from deepfuse.models.gguf_loader import load_gguf

    config, _ = load_gguf(resolve_model_path("smollm2"))
    macs = workload_macs(config, meta["prompt_tokens"], meta["output_tokens"])
    total = sum(macs.values())
    outputs = meta["requests"] * meta["output_tokens"]
    peaks = instruction_peaks(meta["threads"])
    print(f"workload: {meta['requests']} requests, {sum(meta['prompt_tokens'])} prompt tokens, {outputs} output tokens")
    print("multiply-adds: " + ", ".join(f"{k} {v / 1e12:.3f} T" for k, v in macs.items()) + f", total {total / 1e12:.3f} T")
    print(f"instruction peaks, {meta['threads']} threads: " + ", ".join(f"{k} {v:.1f} G/s" for k, v in peaks.items()))
    hf = results.get("HF bf16 batched", {}).get("output_tps")
    if hf:
        print(f"HF measured {hf:.1f} tok/s: 5x HF is {5 * hf:.1f} tok/s, the run in {outputs / (5 * hf):.2f} s")
    print(f"\n{'arithmetic':10s} {'least time':>10s} {'most tok/s':>10s} {'most vs HF':>10s}")
    for kind, rate in peaks.items():
        least = total / (rate * 1e9)
        vs_hf = f"{outputs / least / hf:.2f}x" if hf else "-"
        print(f"{kind:10s} {least:9.2f}s {outputs / least:10.1f} {vs_hf:>10s}")
    print(f"\n{'engine':22s} {'arithmetic':>10s} {'tok/s':>8s} {'of the most':>11s}")
    engines = {}
    for name, r in results.items():
        kind = arithmetic_of(name)
        if kind:
            most = outputs / (total / (peaks[kind] * 1e9))
            engines[name] = {"arithmetic": kind, "output_tps": r["output_tps"], "share_of_most": r["output_tps"] / most}
            print(f"{name:22s} {kind:>10s} {r['output_tps']:8.1f} {r['output_tps'] / most:10.0%}")
    write_result("bound.json", {"throughput_run": run.get("provenance"), "multiply_adds": macs,
                                "peaks_g_per_s": peaks, "hf_output_tps": hf, "engines": engines})


if __name__ == "__main__":
    main()
