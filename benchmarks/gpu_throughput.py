"""Offline throughput on one NVIDIA GPU: throughput.py's workload (64 requests, 50-500 prompt
tokens, 128 output tokens each, EOS ignored, all arriving at t=0) through deepfuse's sm90/sm100
build and its Engine (continuous batching), against transformers' batched `generate` on the
same GPU. Both bf16, both on the same weights: random ones of SmolLM2-135M's shape (30 layers),
written by transformers and loaded by each engine (so the GPU machine needs no copy of the
98 MB GGUF; speed does not depend on the weights' values). Rounds are interleaved;
medians and per-round ratios are printed, and the runs written as JSON.

    python benchmarks/gpu_throughput.py [--runs 3] [--requests 64] [--out FILE] [--profile] [--dry-run]

--dry-run: 2 layers of a tiny shape, 4 requests of 8 output tokens, f32, on the CPU in Triton's
interpreter (start it with TRITON_INTERPRET=1): checks that the script runs (CI does).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from throughput import OUT_TOKENS, hf_generate, summary  # noqa: E402


def smollm2_shaped(path: str, dry: bool):
    """A random-weight SmolLM2-135M (or, dry, a 2-layer toy) saved by transformers at `path`."""
    import transformers as tf

    torch.manual_seed(0)
    shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                 num_attention_heads=9, num_key_value_heads=3)
    if dry:
        shape = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=6, num_key_value_heads=2)
    cfg = tf.LlamaConfig(**shape, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)


def refuse_wrong_machine(dry: bool) -> None:
    """Exits with the reason where the run cannot happen: a dry run outside Triton's interpreter,
    or a real one without a GPU."""
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run needs TRITON_INTERPRET=1")
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device visible: run with --dry-run (and TRITON_INTERPRET=1) on a CPU machine")


def make_prompts(n: int, vocab: int, dry: bool, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lo, hi = (5, 20) if dry else (50, 500)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


ENGINES: dict = {}  # (artifact, requests, overlap) -> Engine: its CUDA graphs are captured once


def run_deepfuse(art, prompts, out_tokens: int, overlap: bool = False) -> dict:
    """One round through an Engine kept per (artifact, batch size, overlap), with prefix caching
    off: nothing cached from an earlier round, and the decode graphs captured before the timing."""
    from deepfuse import SamplingParams
    from deepfuse.runtime.engine import Engine
    from deepfuse.runtime.kv_cache import CacheConfig

    key = (id(art), len(prompts), overlap)
    if key not in ENGINES:
        ENGINES[key] = Engine(art, CacheConfig(num_blocks=4096, enable_prefix_caching=False), max_num_tokens=1024,
                              max_num_seqs=len(prompts), overlap=overlap)
    engine = ENGINES[key]
    p = SamplingParams(temperature=0, max_tokens=out_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = engine.generate(prompts, [p] * len(prompts), use_tqdm=False)
    wall = time.perf_counter() - t
    if not all(len(o.outputs[0].token_ids) == out_tokens for o in outs):
        raise RuntimeError(f"deepfuse returned {[len(o.outputs[0].token_ids) for o in outs]} tokens, not {out_tokens} each")
    return summary(wall, [o.metrics.ttft_s for o in outs], [o.metrics.tpot_s for o in outs],
                   sum(len(o.outputs[0].token_ids) for o in outs))


def profile(art, prompts, path: str) -> None:
    """Where a deepfuse run's time goes: the GPU's busy time (its kernels' summed time) against
    the wall time; the rest is the host (Python, launches, copies, waits)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        run_deepfuse(art, prompts, 16)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events)
    kernels = sum(e.count for e in events if e.self_device_time_total > 0)
    print(f"profile: one run of {len(prompts)} requests x 16 tokens: {wall * 1000:.0f} ms wall, GPU busy "
          f"{gpu_us / 1000:.0f} ms ({100 * gpu_us / 1e6 / wall:.0f}%), {kernels} GPU kernels; table in {path}")
    with open(path, "w") as f:
        f.write(events.table(sort_by="self_device_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_throughput.json"))
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="then one deepfuse run of 16 output tokens under torch.profiler: busy GPU time against "
                         "wall time, and the top kernels (a table beside --out)")
    args = ap.parse_args()
    dry = args.dry_run
    refuse_wrong_machine(dry)
    from transformers import AutoModelForCausalLM

    import deepfuse
    from deepfuse.codegen.triton.runner import gpu_arch
    from deepfuse.models import load_model

    target = "sm90" if dry else gpu_arch()
    if target is None:
        sys.exit(f"{torch.cuda.get_device_name()} is neither sm_90 nor sm_100")
    dtype, tdt = ("f32", torch.float32) if dry else ("bf16", torch.bfloat16)
    out_tokens = 8 if dry else OUT_TOKENS
    requests = 4 if dry else args.requests
    with tempfile.TemporaryDirectory() as path:
        smollm2_shaped(path, dry)
        model = load_model(path, with_tokenizer=False)[0]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=tdt).to("cpu" if dry else "cuda").eval()
    t = time.perf_counter()
    art = deepfuse.compile(model, target=target, dtype=dtype)
    compile_s = time.perf_counter() - t
    prompts = make_prompts(requests, model.config.vocab_size, dry)
    warmup = make_prompts(4, model.config.vocab_size, dry, seed=1)
    # untimed: a short round, then (on a GPU) a whole one: HF's first full-size generate ran at a
    # quarter of its later speed on an H200 (cuBLAS and SDPA choosing their kernels for new shapes)
    run_deepfuse(art, warmup, 4)
    hf_generate(hf, warmup, 4)
    if not dry:
        run_deepfuse(art, prompts, out_tokens)
        run_deepfuse(art, prompts, out_tokens, overlap=True)
        hf_generate(hf, prompts, out_tokens)
    engines = {f"deepfuse {target} {dtype}": lambda: run_deepfuse(art, prompts, out_tokens),
               f"deepfuse {target} overlap": lambda: run_deepfuse(art, prompts, out_tokens, overlap=True),
               f"HF {dtype} batched": lambda: hf_generate(hf, prompts, out_tokens)}
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    device = "cpu (Triton interpreter, dry run)" if dry else torch.cuda.get_device_name()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save(**more) -> None:
        """The runs so far (complete: false until the medians are in): a run stopped by its time
        limit still leaves what it measured."""
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "target": target, "dtype": dtype,
                       "kernel_source": art.runner.kernel_source, "compile_s": compile_s,
                       "prompt_tokens": [len(p) for p in prompts], "output_tokens": out_tokens, "runs": runs,
                       "complete": False, **more}, f, indent=1)

    for round_ in range(1 if dry else args.runs):
        for name, fn in engines.items():
            runs[name].append(fn())
            print(f"round {round_ + 1}, {name}: {runs[name][-1]['output_tps']:.1f} output tok/s", flush=True)
            save()
    results = {name: {"runs": rs, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}} for name, rs in runs.items()}
    ours, _, peer = results.values()
    shape = "a toy" if dry else "SmolLM2-135M"
    print(f"\n{device}, {shape} shape ({model.config.num_layers} layers, random weights), {requests} requests, "
          f"prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, {out_tokens} output tokens each, "
          f"median of {len(ours['runs'])} run(s); {target} kernels: {art.runner.kernel_source}, compiled in "
          f"{compile_s:.0f} s")
    print(f"{'engine':22s} {'out tok/s':>10s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s} {'vs HF':>7s}")
    for name, r in results.items():
        print(f"{name:22s} {r['output_tps']:10.1f} {r['ttft_p50_s']:8.2f}s {r['ttft_p99_s']:8.2f}s "
              f"{r['tpot_p50_s'] * 1000:7.1f}ms {r['tpot_p99_s'] * 1000:7.1f}ms "
              f"{r['output_tps'] / peer['output_tps']:6.2f}x")
    print("per round vs HF: " + ", ".join(f"{a['output_tps'] / b['output_tps']:.2f}x"
                                          for a, b in zip(ours["runs"], peer["runs"])))
    save(complete=True, results=results)

    if args.profile and not dry:
        profile(art, prompts, args.out.removesuffix(".json") + "_profile.txt")


if __name__ == "__main__":
    main()
