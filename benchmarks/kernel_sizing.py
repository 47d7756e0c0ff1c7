"""Decode kernels sized for their shapes, checked on a CPU-only machine (no GPU runs here):
the CTAs each decode launch of an sm90 / sm100 plan starts at 1, 16 and 64 sequences against
the SM count (132 for H100/H200, 148 for B200), and, for the kernels of those launches (and the
one-pass prefill attention) compiled ahead of time, the tensor-core MMA, registers and spills
(ptxas -v) and global load widths.

    python benchmarks/kernel_sizing.py [--models smollm2,mixtral] [--archs sm90,sm100] [--context 512]
                                       [--out PATH]   # default benchmarks/results/kernel_sizing.json

Models (1 layer, weights on the meta device, bf16; only shapes matter): SmolLM2-135M's shape
(hidden 576, 9 heads / 3 kv heads of 64, intermediate 1536, vocab 49152) and the device
check's Mixtral shape (hidden 1024, 8 heads / 2 kv heads of 128, 16 experts of 1024, top 2,
vocab 32000). "working" counts a split-KV launch's programs whose partition holds keys at the
given context; the rest return at once.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from deepfuse.codegen.targets import get_target  # noqa: E402
from deepfuse.codegen.triton import build_plan  # noqa: E402
from deepfuse.codegen.triton.aot import compile_all  # noqa: E402
from deepfuse.codegen.triton.occupancy import decode_launches, ptx_loads, ptxas_usage, scalar_loads  # noqa: E402
from deepfuse.codegen.triton.tiles import SMS  # noqa: E402
from deepfuse.compiler import trace_model  # noqa: E402
from deepfuse.models.family import family_for_hf_model_type  # noqa: E402
from deepfuse.passes import PassManager  # noqa: E402

SEQS = (1, 16, 64)
GEMMS = ("linear", "linear_q4", "logits", "rms_norm_linear", "add_rms_norm_linear", "swiglu_linear", "with_epilogue")


def shaped_model(kind: str):
    """A deepfuse model of `kind`'s shape, 1 layer, with meta-device weights."""
    import transformers as tf

    if kind == "smollm2":
        cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
        hf_cls, model_type = tf.LlamaForCausalLM, "llama"
    else:
        cfg = tf.MixtralConfig(vocab_size=32000, hidden_size=1024, intermediate_size=1024, num_local_experts=16,
                               num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2,
                               num_experts_per_tok=2, max_position_embeddings=4096)
        hf_cls, model_type = tf.MixtralForCausalLM, "mixtral"
    with torch.device("meta"):
        hf = hf_cls(cfg)
    fmt = family_for_hf_model_type(model_type).hf
    config = fmt.config({**cfg.to_dict(), "model_type": model_type})
    weights = {k: v.float() for k, v in hf.state_dict().items()}
    config, weights = fmt.weights(config, weights) if fmt.weights else (config, weights)
    return family_for_hf_model_type(model_type).model(config, weights)


def measure(kind: str, arch: str, context: int) -> dict:
    """{"launches": {seqs: rows}, "kernels": {name: usage}} for one model shape on one arch."""
    g, _ = PassManager(get_target(arch).pipeline()).run(trace_model(shaped_model(kind), "bf16"))
    plan = build_plan(g, arch)
    launches = {s: decode_launches(plan, s, context) for s in SEQS}
    names = {r["kernel"] for rows in launches.values() for r in rows}
    # and the one-pass attention (prefill chunks), whose loads the tables show too
    specs = {spec["name"]: (spec, p["node"]) for p in plan["launches"] for spec in p.get("kernels", [])
             if spec["name"] in names or p["op"] == "qkv_attention"}
    files = compile_all(list(specs.values()), arch)
    kernels = {}
    for name in sorted(specs):
        ptx = files[f"{name}.ptx"].decode()
        found = ptx_loads(ptx)
        kernels[name] = {**ptxas_usage(ptx, arch), **found, "scalar_8_16_bit_loads": scalar_loads(found["loads"]),
                         "shared": json.loads(files[f"{name}.json"])["shared"]}
    return {"launches": launches, "kernels": kernels}


def print_tables(results: dict, context: int) -> None:
    for arch, models in results.items():
        sms = SMS[arch]
        for kind, r in models.items():
            print(f"\n{kind} on {arch} ({sms} SMs), one-token decodes at {context} keys: CTAs per launch")
            print(f"| op | kernel | {' | '.join(f'{s} seqs' for s in SEQS)} | working at 64 | >= SMs at 64 |")
            print("|---|---|" + "---|" * (len(SEQS) + 2))
            by_kernel: dict[str, dict] = {}
            for s, rows in r["launches"].items():
                for row in rows:
                    by_kernel.setdefault(row["kernel"], {"op": row["op"]})[s] = row
            for name, cells in by_kernel.items():
                at = [str(cells[s]["ctas"]) if s in cells else "-" for s in SEQS]
                w = cells.get(64, {}).get("working", 0)
                print(f"| {cells['op']} | {name} | {' | '.join(at)} | {w} | {'yes' if w >= sms else 'no'} |")
            print(f"\n{kind} on {arch}: compiled kernels (ptxas -v; PTX global loads)")
            print("| kernel | mma | regs | spill st/ld | stack | shared | loads | scalar 8/16-bit |")
            print("|---|---|---|---|---|---|---|---|")
            for name, k in r["kernels"].items():
                loads = ", ".join(f"{n}x {i}" for i, n in sorted(k["loads"].items()))
                print(f"| {name} | {k['mma'] or '-'} | {k['registers']} | {k['spill_stores']}/{k['spill_loads']} | "
                      f"{k['stack']} | {k['shared']} | {loads} | {k['scalar_8_16_bit_loads']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2,mixtral")
    ap.add_argument("--archs", default="sm90,sm100")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("kernel_sizing.py compiles for sm90/sm100: run it without TRITON_INTERPRET=1")
    t0 = time.time()
    results = {arch: {kind: measure(kind, arch, args.context) for kind in args.models.split(",")}
               for arch in args.archs.split(",")}
    print_tables(results, args.context)
    data = {"context": args.context, "sms": {a: SMS[a] for a in results}, "gemm_ops": list(GEMMS),
            "results": results, "seconds": round(time.time() - t0, 1)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(data, f, indent=1)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from results_file import write_result

        print("wrote", write_result("kernel_sizing.json", data))
    print(f"({data['seconds']} s, compiled here, not run on a GPU)")


if __name__ == "__main__":
    main()
