"""The CPU target's projection kernels, dispatched as the compiled model dispatches them, against
a float64 numpy product of the same weights, within error bounds derived from each path's
rounding.

Dispatch: `prepack_for(op, attrs)` packs the weights as CpuExecutor does at load (native f32
panels, bf16 VNNI panels, int4 tiles or torch's int4 layout, int8 panels), `pre.make(attrs)`
is the allocating kernel, and OUT_FACTORIES[op] the kernel that writes into a planned buffer
(used whenever the packed weight `writes_in_place`). With prepack off the executor runs
`make_kernel(op, attrs)` (F.linear), checked here the same way.

Bounds (u = 2^-24 for f32, 2^-8 for bf16: unit roundoff, round to nearest; S = |x| @ |w|^T):
- an f32 sum of K products, in any order, with or without FMA, is within (K + 1) * 2^-24 * S of the
  exact sum (bf16 x bf16 products are exact in f32);
- the result's rounding to the output dtype adds u_out * |y|;
- int4: the weight is the contract's, bf16(q * s + m) rounded in f32 as linear_q4's reference
  says. torch's int4 GEMM (steps of 1-3 rows in bf16) instead dequantizes (q - 8) * bf16(s) +
  bf16(m + 8 s) in f32: each weight may differ from the contract's by
  2^-8 (|q - 8| |s| + |m + 8 s| + |w|) (+ f32 roundings), summed over K against |x|;
- W8A8: the activation quantization is exact by its spec (reproduced here in numpy float32),
  the integer dots are exact; the kernel adds up d * (dot of q with wq, whose + 128 carries
  128 * sum q) over the G groups in f32 and takes the row's 128 * sum(d * sum q) off at the
  end: the f32 error is within (2G + 4) * 2^-24 * scale * sum_g d_g sum_k |q_k| (|w'_k| + 256).
A one-unit error in an integer, a dropped k, a wrong group's scale or a misplaced column
exceeds these bounds by orders of magnitude (the bounds are ~1e-6 of the terms' magnitudes in
f32 and ~2^-8 of the result in bf16).
"""
import numpy as np
import pytest
import torch

from deepfuse.codegen.cpu.kernels import make_kernel, prepack_for
from deepfuse.codegen.cpu.out_kernels import OUT_FACTORIES
from deepfuse.codegen.cpu.packed_weights import PanelWeight, Q4Weights, writes_in_place

U = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8}
F32_U = 2.0 ** -24
ROWS = (1, 3, 4, 7, 65)  # decode (torch's int4 GEMM up to 3 rows), tile remainders (6- and 8-row tiles), prefill


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def check(got: torch.Tensor, want: np.ndarray, bound: np.ndarray, what: str) -> None:
    got = f64(got)
    assert got.shape == want.shape, what
    err = np.abs(got - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert (err <= bound).all(), (f"{what}: |error| {err[worst]:.3g} over the bound {bound[worst]:.3g} at {worst} "
                                  f"(want {want[worst]:.6g}, got {got[worst]:.6g})")


def run_paths(op: str, attrs: dict, dtype: torch.dtype, x: torch.Tensor, weights: tuple, *tail):
    """[(name, result)] of every kernel the CPU executor would run for this op: the prepacked
    allocating kernel, the planned-buffer kernel where the packed weight writes in place, and
    the unpacked kernel (prepack=False)."""
    pre = prepack_for(op, attrs)
    assert pre is not None and dtype in pre.dtypes
    packed = pre.pack(dtype, *weights)
    runs = [("prepacked", pre.make(attrs)(x, packed, *tail), packed)]
    if op in OUT_FACTORIES and writes_in_place(packed):
        n = runs[0][1].shape[1]
        arena = torch.full((x.shape[0], n + 24), float("nan"), dtype=runs[0][1].dtype)
        out = arena[:, 8:8 + n]  # a planned buffer's view: rows strided
        OUT_FACTORIES[op](attrs)(x, packed, *tail, out=[out])
        assert arena[:, :8].isnan().all() and arena[:, 8 + n:].isnan().all()
        runs.append(("planned buffer", out, packed))
    if len(weights) == 1:
        runs.append(("unpacked", make_kernel(op, attrs)(x, *weights, *tail), None))
    return runs


def bf16_native(native) -> bool:
    return native is not None and native.bf16_gemm_available()


@pytest.fixture(scope="module")
def native_or_none():
    from deepfuse.codegen.cpu.native import kernels

    return kernels()


# N: partial last panel (16 columns) past whole micro-tiles (3 panels f32, 4 bf16), SmolLM2's qkv;
# K: odd (bf16 k pairs padded), short, a real depth
@pytest.mark.parametrize("n,k", [(72, 201), (40, 37), (960, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op", ["linear", "logits"])
def test_dense_projection_within_rounding_of_float64(native_or_none, op, dtype, n, k):
    g = torch.Generator().manual_seed(n * 7 + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    x_all = torch.randn(max(ROWS), k, generator=g).to(dtype)
    w64 = f64(w)
    for t in ROWS:
        x = x_all[:t]
        x64 = f64(x)
        tail = (torch.arange(0, t, 2),) if op == "logits" else ()
        rows = tail[0].numpy() if tail else slice(None)
        want = (x64 @ w64.T)[rows]
        s = (np.abs(x64) @ np.abs(w64).T)[rows]
        u_out = U[dtype]  # logits: the bf16 GEMM's bf16 result, then f32
        bound = u_out * np.abs(want) + (1 + u_out) * (k + 1) * F32_U * s
        for name, got, packed in run_paths(op, {}, dtype, x, (w,), *tail):
            if packed is not None and native_or_none is not None and (dtype == torch.float32 or
                                                                       bf16_native(native_or_none)):
                assert isinstance(packed, PanelWeight), "the native GEMM should run here"
            assert got.dtype == (torch.float32 if op == "logits" else dtype)
            check(got, want, bound, f"{op} {dtype} {name} T={t} N={n} K={k}")


def q4_operands(n: int, k: int, g: torch.Generator):
    """A Q4_1-like int4 weight: nibbles spanning 0..15, fp16-representable scales and mins."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.02).half().float()
    mins = (-torch.rand(n, k // 32, generator=g) * 0.15).half().float()
    return packed, scales, mins


@pytest.mark.parametrize("n,k", [(48, 96), (40, 608), (960, 576)])  # 40: no torch int4 layout (N % 16)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_int4_projection_within_rounding_of_float64(native_or_none, dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    packed, scales, mins = q4_operands(n, k, g)
    x_all = torch.randn(max(ROWS), k, generator=g).to(dtype)
    # the weight, from the format's definition (numpy): low nibble first, groups of 32 along K
    p = packed.numpy()
    q = np.stack((p & 15, p >> 4), -1).reshape(n, k).astype(np.float64)
    s = np.repeat(scales.numpy().astype(np.float64), 32, 1)
    m = np.repeat(mins.numpy().astype(np.float64), 32, 1)
    w32 = q.astype(np.float32) * np.repeat(scales.numpy(), 32, 1) + np.repeat(mins.numpy(), 32, 1)  # f32, twice rounded
    wc = f64(torch.from_numpy(w32).to(dtype))  # linear_q4's weight: rounded to x's dtype
    # torch's int4 GEMM's weight, bounded against the contract's (see the module docstring)
    a = np.abs(q - 8) * np.abs(s) + np.abs(m + 8 * s)
    e_int4 = 2.0 ** -8 * (a + np.abs(wc)) + 2.0 ** -21 * (a + np.abs(q * s) + np.abs(m))
    u_out = U[dtype]
    kinds = set()
    for t in ROWS:
        x = x_all[:t]
        x64 = f64(x)
        want = x64 @ wc.T
        for name, got, w in run_paths("linear_q4", {"group_size": 32}, dtype, x, (packed, scales, mins)):
            assert isinstance(w, Q4Weights)
            torch_int4 = w.int4 is not None and t <= w.int4_rows
            kinds.add("torch int4" if torch_int4 else type(w.dense).__name__)
            e = e_int4 if torch_int4 else 0 * wc
            err_w = np.abs(x64) @ e.T
            acc = (k + 1) * F32_U * (np.abs(x64) @ (np.abs(wc) + e).T)
            bound = u_out * np.abs(want) + (1 + u_out) * (acc + err_w)
            assert got.dtype == dtype
            check(got, want, bound, f"linear_q4 {dtype} {name} T={t} N={n} K={k} ({sorted(kinds)})")
    if dtype == torch.bfloat16 and bf16_native(native_or_none):
        assert "Q4Panels" in kinds and ("torch int4" in kinds) == (n % 16 == 0)
    elif native_or_none is not None:
        assert kinds == {"PanelWeight"}


def w8a8_reference(x: torch.Tensor, wq: torch.Tensor, scale: torch.Tensor, group: int):
    """(y, A): linear_w8a8 by its spec in numpy (activations quantized in float32, exact integer
    dots, float64 sums), and A = scale * sum_g d_g sum_k |q_k| (|w'_k| + 256) for the bound."""
    xf = x.float().numpy().reshape(x.shape[0], -1, group)
    amax = np.abs(xf).max(-1)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    q = np.clip(np.rint((xf * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int64)
    d = (amax / np.float32(127)).astype(np.float32).astype(np.float64)
    wi = wq.numpy().astype(np.int64).reshape(wq.shape[0], -1, group) - 128
    dots = np.einsum("tgk,ngk->tng", q, wi)  # exact integers
    sc = scale.numpy().astype(np.float64)
    y = (dots * d[:, None, :]).sum(-1) * sc
    mag = np.einsum("tgk,ngk->tng", np.abs(q), np.abs(wi) + 256).astype(np.float64)
    return y, (mag * d[:, None, :]).sum(-1) * sc


@pytest.mark.parametrize("n,k", [(40, 192), (72, 320), (960, 576)])  # groups: 3, 5, 9
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("op", ["linear_w8a8", "logits_w8a8"])
def test_w8a8_projection_within_rounding_of_its_spec_in_float64(native_or_none, op, dtype, n, k):
    from deepfuse.ir.opdefs_quant import quantize_w8

    g = torch.Generator().manual_seed(n + k + 1)
    wq, scale = quantize_w8(torch.randn(n, k, generator=g) * 0.05)
    x_all = torch.randn(max(ROWS), k, generator=g).to(dtype)
    x_all[0, 64:128] = 0  # a group of zeros (d = 0)
    x_all[2, :] *= 40  # an outlier row
    groups = k // 64
    for t in ROWS:
        x = x_all[:t]
        tail = (torch.arange(0, t, 2),) if op == "logits_w8a8" else ()
        rows = tail[0].numpy() if tail else slice(None)
        want, a = (r[rows] for r in w8a8_reference(x, wq, scale, 64))
        u_out = U[dtype] if op == "linear_w8a8" else F32_U  # the W8A8 head writes f32 logits
        bound = u_out * np.abs(want) + (1 + u_out) * (2 * groups + 4) * F32_U * a
        for name, got, packed in run_paths(op, {"act_group": 64}, dtype, x, (wq, scale), *tail):
            if native_or_none is not None and native_or_none.i8_gemm_available():
                assert packed.native is not None, "the native int8 GEMM should run here"
            assert got.dtype == (dtype if op == "linear_w8a8" else torch.float32)
            check(got, want, bound, f"{op} {dtype} {name} T={t} N={n} K={k}")
