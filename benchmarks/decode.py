"""Batch-1 prefill and decode tokens/s: deepfuse vs llama.cpp and HF transformers eager, same
weights, one run.

All load SmolLM2-135M-Instruct from the same Q4_1 GGUF: HF dequantized; "bf16+int4" keeps
the projections in 4-bit groups, which reproduce Q4_1 up to bf16 rounding; "int4-head8" is that
build with the LM head int8 and int8 activations (as llama.cpp's Q4 files carry a Q8_0 head);
"int4-a8" is the same int4 weights times activations quantized to int8 per row and group of 32
(llama.cpp's Q4_1 x Q8_1 product, native AVX512-VNNI), with the same int8 head; "int4-a8 burst 8"
is that build in an engine that runs 8 decode steps before the host takes their tokens
(Engine(decode_steps=8), runtime/decode_burst.py: the same tokens, streamed 8 at a time);
"int4 inv." is the bf16+int4 build compiled batch-invariant; llama.cpp (llama-cpp-python, the
`bench` extra; skipped without it) runs the GGUF as it is. The engines run in `--runs`
interleaved rounds (each round one run of each, then reads of the machine's read bandwidth for
`bound.py --decode`, over 1 GiB and over the bytes one token reads); the table shows medians and
the per-round ratios go to benchmarks/results/decode.json.

With --sampled every engine draws (temperature 0.8, top-k 40, top-p 0.9; deepfuse seeded) and
"int4-a8 ref. sampler" joins: the int4-a8 build with its native sampler off, so its program stops
before the sampler and the op's reference draws from Python (the results go to decode_sampled.json).

    python benchmarks/decode.py [--runs 3] [--new-tokens 64] [--engines "deepfuse bf16+int4,llama.cpp Q4_1"]
    python benchmarks/decode.py --sampled --engines "deepfuse int4-a8,deepfuse int4-a8 ref. sampler,llama.cpp Q4_1"
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time

import torch
from bound import HEAD_BYTES, ReadBandwidth, decode_bytes
from results_file import write_result
from sampler_switch import reference_sampler

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "The story should be warm, a little mysterious, and end with a surprise. ") * 3


SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.9)  # --sampled: every engine draws with these


def deepfuse_runner(dtype: str, ids: list[int], n: int, model, quant: str | None = None,
                    batch_invariant: bool = False, sampled: bool = False, native_sampler: bool = True,
                    decode_steps: int = 1):
    """One run of a deepfuse build (compiled and warmed up here): {"prefill_tps", "decode_tps"}.
    sampled: seeded draws with SAMPLED, else greedy. native_sampler=False: this engine's steps
    run as if the self-check had refused the native sampler (the program stops before the
    sampler, which runs the op's reference from Python), for an A/B in one run. decode_steps: the
    engine's (runtime/decode_burst.py: steps run before the host takes their tokens)."""
    import deepfuse
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig

    art = deepfuse.compile(model, dtype=dtype, quant=quant, batch_invariant=batch_invariant)
    eng = Engine(art, CacheConfig(enable_prefix_caching=False),  # every run prefills the whole prompt
                 **({"decode_steps": decode_steps} if decode_steps > 1 else {}))  # (native_ab --python: older engines)
    how = dict(SAMPLED, seed=1) if sampled else dict(temperature=0)
    p = SamplingParams(max_tokens=n, ignore_eos=True, **how)
    sampler = lambda: reference_sampler(not native_sampler)  # noqa: E731
    with sampler():
        eng.generate([ids], [SamplingParams(max_tokens=4, ignore_eos=True, **how)])  # warm-up

    def run() -> dict:
        with sampler():
            r = eng.generate([ids], [p])[0]
        return {"prefill_tps": len(ids) / r.metrics.ttft_s,
                "decode_tps": (n - 1) / (r.metrics.total_s - r.metrics.ttft_s)}

    return run


def hf_runner(dtype: torch.dtype, ids: list[int], n: int):
    from transformers import AutoModelForCausalLM

    from deepfuse.models import smollm2_gguf_path

    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=dtype).eval()
    x = torch.tensor([ids])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(k: int) -> float:
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(x, max_new_tokens=k, min_new_tokens=k, **kw)
        assert out.shape[1] == len(ids) + k
        return time.perf_counter() - t

    gen(4)  # warm-up

    def run() -> dict:
        prefill = statistics.median(gen(1) for _ in range(3))
        total = gen(n)
        return {"prefill_tps": len(ids) / prefill, "decode_tps": (n - 1) / (total - prefill)}

    return run


def llama_cpp_runner(ids: list[int], n: int, sampled: bool = False):
    """llama.cpp (llama-cpp-python) on the same Q4_1 GGUF, greedy (sampled: its sampler with
    SAMPLED's temperature, top-k and top-p, no min-p or repeat penalty), token by token (its
    generate() never stops on its own, so EOS is ignored as for the others); None without the
    bench extra."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from deepfuse.models import smollm2_gguf_path

    llm = Llama(model_path=smollm2_gguf_path(), n_ctx=1024, n_threads=torch.get_num_threads(), n_batch=512,
                verbose=False)

    def gen(k: int) -> list[float]:
        llm.reset()  # no prefix kept from the run before: every run prefills the whole prompt
        times = [time.perf_counter()]
        how = dict(temp=SAMPLED["temperature"], top_k=SAMPLED["top_k"], top_p=SAMPLED["top_p"], min_p=0.0,
                   repeat_penalty=1.0) if sampled else dict(temp=0.0)
        for _ in llm.generate(ids, **how):
            times.append(time.perf_counter())
            if len(times) == k + 1:
                break
        return times

    gen(4)  # warm-up

    def run() -> dict:
        times = gen(n)
        return {"prefill_tps": len(ids) / (times[1] - times[0]), "decode_tps": (n - 1) / (times[-1] - times[1])}

    return run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--engines", default="", help="comma-separated names from the table (default: all)")
    ap.add_argument("--sampled", action="store_true",
                    help=f"seeded draws at {SAMPLED} instead of greedy (HF not run; adds 'int4-a8 ref. sampler')")
    ap.add_argument("--result", default=None, help="result file (default: decode.json, decode_sampled.json)")
    args = ap.parse_args()
    from deepfuse.codegen.cpu.executor import ALLOCATOR_TUNED
    from deepfuse.models import load_model

    model, tok = load_model("smollm2")
    ids = tok.encode(PROMPT)
    n = args.new_tokens
    sampled = dict(sampled=args.sampled)
    makers = {"deepfuse f32": lambda: deepfuse_runner("f32", ids, n, model, **sampled),
              "deepfuse bf16": lambda: deepfuse_runner("bf16", ids, n, model, **sampled),
              "deepfuse bf16+int4": lambda: deepfuse_runner("bf16", ids, n, model, "int4", **sampled),
              "deepfuse int4-head8": lambda: deepfuse_runner("bf16", ids, n, model, "int4-head8", **sampled),
              "deepfuse int4-a8": lambda: deepfuse_runner("bf16", ids, n, model, "int4-a8", **sampled),
              "deepfuse int4-a8 burst 8": lambda: deepfuse_runner("bf16", ids, n, model, "int4-a8", decode_steps=8,
                                                                  **sampled),
              "deepfuse int4 inv.": lambda: deepfuse_runner("bf16", ids, n, model, "int4", batch_invariant=True,
                                                            **sampled),
              "llama.cpp Q4_1": lambda: llama_cpp_runner(ids, n, **sampled)}
    if args.sampled:
        makers["deepfuse int4-a8 ref. sampler"] = lambda: deepfuse_runner("bf16", ids, n, model, "int4-a8",
                                                                          sampled=True, native_sampler=False)
    else:
        makers["HF eager f32"] = lambda: hf_runner(torch.float32, ids, n)
        makers["HF eager bf16"] = lambda: hf_runner(torch.bfloat16, ids, n)
    wanted = [e.strip() for e in args.engines.split(",")] if args.engines else list(makers)
    runners = {}
    for name in wanted:
        run = makers[name]()
        if run is None:
            print(f"{name}: skipped (pip install -e .[bench] for llama-cpp-python)")
            continue
        runners[name] = run
    runs: dict[str, list[dict]] = {name: [] for name in runners}
    meter, read_gb_per_s = ReadBandwidth(torch.get_num_threads()), []
    working_mib = {head: math.ceil(sum(decode_bytes(model.config, len(ids) + n / 2, head).values()) / 2**20)
                   for head in HEAD_BYTES}  # one token's bytes, per LM-head format
    working: dict[str, list[float]] = {head: [] for head in working_mib}
    for _ in range(args.runs):  # interleaved rounds: every engine sees the same machine noise
        for name, run in runners.items():
            runs[name].append(run())
        read_gb_per_s.append(meter())  # this round's read bandwidth, for bound.py --decode: over 1 GiB
        for head, mib in working_mib.items():  # and over a token's working set
            working[head].append(meter(mib))
    results = {name: {"runs": r, **{k: statistics.median(x[k] for x in r) for k in r[0]}} for name, r in runs.items()}
    peers = [p for p in ("llama.cpp Q4_1", "HF eager bf16") if p in results]
    print(f"\nSmolLM2-135M, batch 1, {'sampled ' + str(SAMPLED) if args.sampled else 'greedy'}, "
          f"prompt {len(ids)} tokens, {args.new_tokens} new tokens, "
          f"median of {args.runs} interleaved runs, {torch.get_num_threads()} threads")
    print(f"{'engine':30s} {'prefill tok/s':>14s} {'decode tok/s':>13s}" + "".join(f" {'vs ' + p:>18s}" for p in peers))
    for name, r in results.items():
        vs = "".join(f" {r['decode_tps'] / results[p]['decode_tps']:17.2f}x" for p in peers)
        print(f"{name:30s} {r['prefill_tps']:14.1f} {r['decode_tps']:13.1f}{vs}")
        for p in peers:  # per-round ratios: the rounds ran side by side
            r[f"decode_vs_{p}_per_run"] = [a["decode_tps"] / b["decode_tps"] for a, b in zip(r["runs"], results[p]["runs"])]
    print(f"read bandwidth per round (read_bw.cpp): {', '.join(f'{g:.1f}' for g in read_gb_per_s)} GB/s over 1 GiB; "
          f"over {working_mib['int8']} MiB (an int8-head token's bytes): {', '.join(f'{g:.1f}' for g in working['int8'])}")
    meta = {"prompt_tokens": len(ids), "new_tokens": args.new_tokens, "runs": args.runs,
            "sampling": dict(SAMPLED, seed=1) if args.sampled else "greedy",
            "read_gb_per_s_per_run": read_gb_per_s, "read_gb_per_s_working_set_per_run": working,
            "working_set_mib": working_mib,
            "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
            "allocator": "glibc mallopt(M_MMAP_THRESHOLD=1GiB, M_TRIM_THRESHOLD=2GiB) in-process, for both engines"
            if ALLOCATOR_TUNED else "default"}
    write_result(args.result or ("decode_sampled.json" if args.sampled else "decode.json"),
                 {"meta": meta, "results": results})


if __name__ == "__main__":
    main()
