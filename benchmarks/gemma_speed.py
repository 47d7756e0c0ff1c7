"""Gemma 3 270M speed against llama.cpp on the same GGUF (the packaged Q4_K_M), in one run.

  decode   batch 1: a 128-token prompt, --decode-tokens new tokens, tokens/s after the first
  prefill  batch 1: a --prefill-tokens prompt, its tokens over the time to the first token
  throughput  --requests requests (50-500 prompt tokens, 128 new tokens each, EOS ignored), all
           arriving at once, the same token ids for every engine: deepfuse's engine batches them;
           llama.cpp serves them as parallel sequences of one context (its batched API through
           llama-cpp-python's bindings, as llama.cpp's own batched example and server do: the
           prompts prefilled packed into batches of 512 tokens, then one llama_decode per step
           for every running sequence, greedy by llama.cpp's sampler)

Engines: deepfuse bf16 (the GGUF dequantized), deepfuse bf16+int4 (projections requantized to
4-bit groups of 32; the tied embedding / LM head stays bf16), deepfuse bf16+int4-head (the LM head
int4 too; the embedding still gathers bf16 rows), deepfuse bf16+w8a8 (int8 weights, the head too, and
int8 activations), llama.cpp on the Q4_K_M file itself (needs
`pip install -e .[bench]`, else skipped). Each measurement --runs times, engines interleaved round
by round, medians reported.

    python benchmarks/gemma_speed.py [--runs 3] [--requests 64] [--skip-throughput] [--engines ...]
        [--llama-kv split|unified] [--result NAME.json]
Writes benchmarks/results/gemma_speed.json (or --result). llama.cpp's 64 sequences get one KV
stream each by default (split); with one unified cache its attention spans every sequence's cells.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from llama_cpp_batched import LlamaCppParallel
from results_file import write_result
from throughput import make_prompts, summary

OUT_TOKENS = 128
DEEPFUSE = {"deepfuse-bf16": ("bf16", None), "deepfuse-bf16-int4": ("bf16", "int4"),
            "deepfuse-bf16-int4-head": ("bf16", "int4-head"), "deepfuse-bf16-w8a8": ("bf16", "w8a8")}  # (dtype, quant)


def deepfuse_engine(source, tok, dtype: str, quant: str | None, requests: int):
    import deepfuse
    from deepfuse.runtime.engine import Engine
    from deepfuse.runtime.kv_cache import CacheConfig

    art = deepfuse.compile(source, target="cpu", dtype=dtype, quant=quant, tokenizer=tok)
    return Engine(art, CacheConfig(num_blocks=4096, enable_prefix_caching=False), max_num_tokens=1024,
                  max_num_seqs=max(requests, 1))


def deepfuse_single(eng, ids: list[int], n: int) -> tuple[float, float]:
    """(decode tokens/s after the first, prefill tokens/s)."""
    from deepfuse.runtime.engine import SamplingParams

    out = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)])[0]
    t = out.outputs[0].token_times
    return (len(t) - 1) / (t[-1] - t[0]), len(ids) / out.metrics.ttft_s


def deepfuse_batch(eng, prompts) -> dict:
    from deepfuse.runtime.engine import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    t = time.perf_counter()
    outs = eng.generate(prompts, [p] * len(prompts))
    wall = time.perf_counter() - t
    return summary(wall, [o.metrics.ttft_s for o in outs], [o.metrics.tpot_s for o in outs],
                   sum(len(o.outputs[0].token_ids) for o in outs))


class LlamaCpp:
    def __init__(self, path: str, requests: int, unified: bool = True):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=4096, n_threads=torch.get_num_threads(), n_batch=512, verbose=False)
        self.parallel = LlamaCppParallel(self.llm, requests, requests * 640, unified=unified) if requests > 0 else None

    def times(self, ids: list[int], n: int) -> tuple[float, list[float]]:
        """(start, each token's time), greedy, EOS ignored (generate never stops on its own)."""
        self.llm.reset()
        t0, times = time.perf_counter(), []
        for _ in self.llm.generate(ids, temp=0.0, reset=True):
            times.append(time.perf_counter())
            if len(times) == n:
                break
        return t0, times

    def single(self, ids: list[int], n: int) -> tuple[float, float]:
        t0, t = self.times(ids, n)
        return (len(t) - 1) / (t[-1] - t[0]), len(ids) / (t[0] - t0)

    def batch(self, prompts) -> dict:
        start, times = self.parallel.run(prompts, OUT_TOKENS)
        wall = time.perf_counter() - start
        return summary(wall, [t[0] - start for t in times], [(t[-1] - t[0]) / (len(t) - 1) for t in times],
                       sum(len(t) for t in times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--prefill-tokens", type=int, default=1024)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--engines", default=",".join(DEEPFUSE) + ",llama.cpp", help="comma-separated, of: "
                    + ", ".join(DEEPFUSE) + ", llama.cpp")
    ap.add_argument("--llama-kv", default="split", choices=["unified", "split"],
                    help="llama.cpp's KV cache for the 64 parallel sequences: one unified cache, or one stream each")
    ap.add_argument("--result", default="gemma_speed.json")
    args = ap.parse_args()
    from deepfuse.models import gemma3_gguf_path, load_model

    wanted = args.engines.split(",")
    source, tok = load_model("gemma3")
    engines = {name: deepfuse_engine(source, tok, *DEEPFUSE[name], args.requests) for name in DEEPFUSE if name in wanted}
    try:
        if "llama.cpp" in wanted:
            engines["llama.cpp"] = LlamaCpp(gemma3_gguf_path(), 0 if args.skip_throughput else args.requests,
                                            unified=args.llama_kv == "unified")
    except ImportError:
        print("llama-cpp-python is not installed (pip install -e .[bench]): llama.cpp skipped")
    prompts = make_prompts(tok, args.requests)
    short, long = make_prompts(tok, 1, seed=1)[0][:128], (make_prompts(tok, 8, seed=2)[0] * 10)[:args.prefill_tokens]
    for name, e in engines.items():  # warm-up: kernels built, caches touched
        e.single(short, 4) if name == "llama.cpp" else deepfuse_single(e, short, 4)
    rows = {name: {"decode_tps": [], "prefill_tps": [], "throughput": []} for name in engines}
    for r in range(args.runs):
        for name, e in engines.items():
            single = e.single if name == "llama.cpp" else lambda ids, n, e=e: deepfuse_single(e, ids, n)
            rows[name]["decode_tps"].append(single(short, args.decode_tokens)[0])
            rows[name]["prefill_tps"].append(single(long, 2)[1])
            if not args.skip_throughput:
                rows[name]["throughput"].append(e.batch(prompts) if name == "llama.cpp" else deepfuse_batch(e, prompts))
            print(f"round {r + 1} {name}: decode {rows[name]['decode_tps'][-1]:.1f} tok/s, prefill "
                  f"{rows[name]['prefill_tps'][-1]:.0f} tok/s" + (
                      f", throughput {rows[name]['throughput'][-1]['output_tps']:.1f} tok/s" if rows[name]["throughput"] else ""),
                  flush=True)
    result = {}
    for name, v in rows.items():
        result[name] = {"decode_tps": statistics.median(v["decode_tps"]), "prefill_tps": statistics.median(v["prefill_tps"]),
                        "decode_runs": v["decode_tps"], "prefill_runs": v["prefill_tps"]}
        if v["throughput"]:
            result[name]["throughput_tps"] = statistics.median(x["output_tps"] for x in v["throughput"])
            result[name]["throughput_runs"] = v["throughput"]
    if "llama.cpp" in result:
        base = result["llama.cpp"]
        for v in result.values():
            v["vs_llama_cpp"] = {k: round(v[k] / base[k], 2) for k in ("decode_tps", "prefill_tps", "throughput_tps")
                                 if k in v and k in base}
    for name, v in result.items():
        print(f"{name:20s} decode {v['decode_tps']:7.1f}  prefill {v['prefill_tps']:7.0f}"
              + (f"  throughput {v['throughput_tps']:7.1f}" if "throughput_tps" in v else "")
              + (f"  vs llama.cpp {v['vs_llama_cpp']}" if "vs_llama_cpp" in v else ""))
    write_result(args.result, {"model": "gemma-3-270m Q4_K_M", "requests": args.requests,
                                      "decode_tokens": args.decode_tokens, "prefill_tokens": args.prefill_tokens,
                                      "runs": args.runs,
                                      "llama_cpp_throughput": f"parallel sequences on one context ({args.llama_kv} KV "
                                                              "cache): prompts prefilled in packed batches of 512 tokens, "
                                                              "then one llama_decode per step for every sequence, greedy",
                                      "results": result})


if __name__ == "__main__":
    main()
