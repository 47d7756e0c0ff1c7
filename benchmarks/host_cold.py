"""What a decode step's host work costs after the step's kernels: single host operations of the
kind the engine runs between steps (a torch op, the same check on numpy's view, the native argmax
over a vocabulary row, a slice, a read-back), timed warm (the op just ran) and right after one
sweep over as many bytes as an int4-a8 SmolLM2 decode token reads (bound.decode_bytes: its
projections, int8 LM head and KV rows), which leaves the op's code and data in no cache.

The batch-1 decode step's host part (benchmarks/decode_split.py) runs cold in this sense: its
Python follows ~98 MB of weight reads. Medians of `--reps` alternating warm and cold calls.
Writes benchmarks/results/host_cold.json.

    python benchmarks/host_cold.py [--reps 200]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_file import write_result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    if a.reps < 1:
        ap.error(f"--reps must be at least 1, got {a.reps}")

    from bound import decode_bytes

    from deepfuse.codegen.cpu.row_kernels import native_rows
    from deepfuse.models import resolve_model_path
    from deepfuse.models.gguf_loader import load_gguf

    config, _ = load_gguf(resolve_model_path("smollm2"))
    swept = int(sum(decode_bytes(config, 97 + 64 / 2, "int8").values()))  # decode.py's mean context
    weights = torch.ones(swept // 8, dtype=torch.int64)  # read by a sum: every byte, on torch's threads
    native = native_rows()
    temperature = torch.zeros(1)
    logits = torch.randn(1, config.vocab_size)
    tokens = torch.zeros(64, dtype=torch.int64)
    ops = {
        "torch.empty [1, vocab] f32": lambda: torch.empty(1, config.vocab_size),
        "torch check: bool((t > 0).any())": lambda: bool((temperature > 0).any()),
        "numpy check: (t.numpy() > 0).any()": lambda: (temperature.numpy() > 0).any(),
        "native argmax over [1, vocab]": lambda: native.argmax(logits),
        "tensor slice t[:1]": lambda: tokens[:1],
        "read back: t[:1].tolist()": lambda: tokens[:1].tolist(),
    }
    us: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, op in ops.items():
            warm, cold = [], []
            for _ in range(a.reps):
                op()
                t = time.perf_counter()
                op()
                warm.append(time.perf_counter() - t)
                weights.sum()
                t = time.perf_counter()
                op()
                cold.append(time.perf_counter() - t)
            us[name] = {"warm": statistics.median(warm) * 1e6, "after the sweep": statistics.median(cold) * 1e6}
            print(f"{name:40s} warm {us[name]['warm']:7.1f} us   after a {swept / 1e6:.0f} MB sweep "
                  f"{us[name]['after the sweep']:7.1f} us")
    path = write_result("host_cold.json", {"config": {"reps": a.reps, "swept_bytes": swept,
                                                      "threads": torch.get_num_threads()}, "median_us": us})
    print("wrote", path)


if __name__ == "__main__":
    main()
