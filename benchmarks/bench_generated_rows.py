"""Generated CPU row kernels (kernel IR -> C++, codegen/cpu/generated*.py) against the hand-written
native ones (row_kernels.py over norms.cpp / rows.cpp) at SmolLM2-135M's shapes: rms_norm and
add_rms_norm over D=576, swiglu over [T, 2*1536], T in (1, 16, 256), f32 and bf16. Two pairs:
the allocating calls (the `kernel` op's kernel against row_kernels.py's), and the calls a bound
decode step makes into planned buffers (the generated kernel's bind() against the hand kernel
called straight through its pybind entry with out=, the least a bound hand call costs). All four
are timed interleaved, median of REPEATS blocks each; writes benchmarks/results/generated_rows.json.

    python benchmarks/bench_generated_rows.py
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

sys.path.insert(0, __import__("os").path.dirname(__file__))
from results_file import write_result  # noqa: E402

from deepfuse.codegen.cpu.generated_build import NativeKernel  # noqa: E402
from deepfuse.codegen.cpu.native import kernels as native_kernels  # noqa: E402
from deepfuse.codegen.cpu.row_kernels import add_rms_rows, rms_rows, swiglu_rows  # noqa: E402
from deepfuse.frontend import Spec, ops, trace  # noqa: E402
from deepfuse.ir import DTYPES  # noqa: E402
from deepfuse.kernel.ir import Kernel  # noqa: E402
from deepfuse.passes import dce  # noqa: E402
from deepfuse.passes.decompose import decompose_unsupported  # noqa: E402
from deepfuse.passes.generate_kernels import generate_kernels  # noqa: E402

D, F, EPS = 576, 1536, 1e-5
ROWS = (1, 16, 256)
REPEATS = 9


def kernel_of(fn, specs: list[Spec]) -> NativeKernel:
    """fn traced, decomposed and lowered to its one generated kernel, compiled."""
    g = dce(generate_kernels()(decompose_unsupported(set())(trace(fn, *specs, name="bench"))))
    (node,) = g.nodes
    assert node.op == "kernel", node.op
    return NativeKernel(Kernel.from_json(node.attrs["kernel"]))


def cases(dtype: str, t: int):
    """(name, hand call, generated call, hand call with out=, generated bound call) for one dtype
    and row count."""
    dt, hand_out = DTYPES[dtype], native_kernels()
    x, r = torch.randn(t, D).to(dt), torch.randn(t, D).to(dt)
    w = (1 + 0.1 * torch.randn(D)).to(dt)
    xs = torch.randn(t, 2 * F).to(dt)
    o, s, og = torch.empty_like(x), torch.empty_like(x), torch.empty(t, F, dtype=dt)
    rms = kernel_of(lambda a, b: ops.rms_norm(a, b, eps=EPS), [Spec("x", dtype, ("T", D)), Spec("w", dtype, (D,))])
    add = kernel_of(lambda a, b, c: ops.add_rms_norm(a, b, c, eps=EPS),
                    [Spec("x", dtype, ("T", D)), Spec("r", dtype, ("T", D)), Spec("w", dtype, (D,))])
    glu = kernel_of(lambda a: ops.swiglu(a), [Spec("x", dtype, ("T", 2 * F))])
    (rms_bound,), (add_bound,), (glu_bound,) = (rms.bind(x, w, out=[o]).calls, add.bind(x, r, w, out=[s, o]).calls,
                                                glu.bind(xs, out=[og]).calls)
    return [("rms_norm", lambda: rms_rows(x, w, EPS), lambda: rms(x, w), lambda: hand_out.rms_norm(x, w, EPS, o),
             rms_bound),
            ("add_rms_norm", lambda: add_rms_rows(x, r, w, EPS), lambda: add(x, r, w),
             lambda: hand_out.add_rms_norm(x, r, w, EPS, s, o), add_bound),
            ("swiglu", lambda: swiglu_rows(xs), lambda: glu(xs), lambda: hand_out.swiglu(xs, og), glu_bound)]


def block(fn, iters: int) -> float:
    """Microseconds per call over `iters` calls."""
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def main() -> None:
    if native_kernels() is None:
        raise SystemExit("the hand-written native kernels could not be built here")
    rows = []
    print(f"{'op':<13}{'dtype':<6}{'T':>5}{'hand':>8}{'gen':>8}{'ratio':>7}{'hand out=':>11}{'gen bound':>11}{'ratio':>7}  (us)")
    for name_idx in range(3):
        for dtype in ("f32", "bf16"):
            for t in ROWS:
                name, *calls = cases(dtype, t)[name_idx]
                iters = max(20, 4000 // t)
                for fn in calls:
                    block(fn, iters)  # warm caches and threads
                times = [[] for _ in calls]
                for _ in range(REPEATS):
                    for fn, ts in zip(calls, times):
                        ts.append(block(fn, iters))
                h, g, ho, gb = (statistics.median(ts) for ts in times)
                rows.append({"op": name, "dtype": dtype, "T": t, "hand_us": round(h, 2), "generated_us": round(g, 2),
                             "ratio": round(g / h, 3), "hand_out_us": round(ho, 2), "generated_bound_us": round(gb, 2),
                             "bound_ratio": round(gb / ho, 3)})
                print(f"{name:<13}{dtype:<6}{t:>5}{h:>8.2f}{g:>8.2f}{g / h:>7.2f}{ho:>11.2f}{gb:>11.2f}{gb / ho:>7.2f}")
    path = write_result("generated_rows.json", {"D": D, "F": F, "repeats": REPEATS, "threads": torch.get_num_threads(),
                                                "rows": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
