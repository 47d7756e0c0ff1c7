"""Does inductor pay on the CPU target? Per elementwise op of SmolLM2's step, one run:
deepfuse's CPU kernel vs torch.compile (inductor, dynamic token count) of the op's IR
reference, at a decode shape (1 token) and a prefill shape (512 tokens), bf16, plus the
compile time. Writes benchmarks/results/inductor.json.

    python benchmarks/inductor.py
"""
from __future__ import annotations

import statistics
import time

import torch
from results_file import write_result

from deepfuse.codegen.cpu.kernels import make_kernel
from deepfuse.ir import OPS


def per_call_us(fn, args, n: int = 300) -> float:
    for _ in range(20):
        fn(*args)
    samples = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn(*args)
        samples.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(samples)


def cases(t: int) -> dict:
    d, hd, bf = 576, 64, torch.bfloat16
    x, r, w = torch.randn(t, d, dtype=bf), torch.randn(t, d, dtype=bf), torch.randn(d, dtype=bf)
    qkv = torch.randn(t, 9 * hd, dtype=bf)
    pos = torch.arange(100, 100 + t)
    gate_up = torch.randn(t, 3072, dtype=bf)
    return {
        "rms_norm": ({"eps": 1e-5}, (x, w)),
        "add_rms_norm": ({"eps": 1e-5}, (x, r, w)),
        "rope": ({"head_dim": hd, "theta": 1e5}, (qkv, pos)),
        "swiglu": ({}, (gate_up,)),
    }


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64
    results = {}
    print(f"{'op':14s} {'tokens':>6s} {'deepfuse us':>12s} {'inductor us':>12s} {'ratio':>6s} {'compile s':>10s}")
    for t in (1, 512):
        for op, (attrs, args) in cases(t).items():
            ours = make_kernel(op, attrs)
            ref = OPS[op].reference
            compiled = torch.compile(lambda *a, ref=ref, attrs=attrs: ref(*a, **attrs), dynamic=True)
            c0 = time.perf_counter()
            compiled(*args)
            compile_s = time.perf_counter() - c0
            a, b = per_call_us(ours, args), per_call_us(compiled, args)
            results[f"{op}@{t}"] = {"deepfuse_us": a, "inductor_us": b, "compile_s": compile_s}
            print(f"{op:14s} {t:6d} {a:12.1f} {b:12.1f} {a / b:5.2f}x {compile_s:10.1f}")
    write_result("inductor.json", {"results": results})


if __name__ == "__main__":
    main()
