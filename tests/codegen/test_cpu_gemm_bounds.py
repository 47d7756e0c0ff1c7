"""The native GEMMs write their out and nothing else, at every row count and with a partial last
panel: out is a window of a larger tensor filled with a sentinel, and after the call every element
outside the window still holds it. Each result is also checked against a float64 reference that
shares no code with the kernel (a miscompiled tile table once called a 2-panel tile for a lone
last panel: the fused SwiGLU form wrote a row above and rows below its out, and read garbage)."""
import pytest
import torch
import torch.nn.functional as F

from deepfuse.codegen.cpu.q4a8_kernels import pack_q4a8
from deepfuse.codegen.cpu.selfcheck import rms_ref, swiglu_ref
from deepfuse.ir.opdefs_quant import W8_ZERO, dequantize_q4, quantize_w8, unpack_q4

SENTINEL = 12345.0
ROWS = (1, 2, 3, 4, 5, 7, 10, 13)  # each micro-tile height, alone and after full tiles
# columns: 3 panels of 16 (the last partial), 5 and 6 (a 4-panel tile and a lone or paired last
# panel), 9 (one row's 8-panel tile and a partial last panel)
COLUMNS = (40, 72, 88, 136)
CASES = [(rows, n) for rows in ROWS for n in COLUMNS]


def guarded(rows: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the whole buffer, out: its [rows, n] window, 300 elements in from each end, rows n + 8 apart)."""
    ld = n + 8
    whole = torch.full((600 + rows * ld,), SENTINEL, dtype=dtype)
    return whole, whole[300:300 + rows * ld].view(rows, ld)[:, :n]


def outside_untouched(whole: torch.Tensor, out: torch.Tensor) -> bool:
    inside = torch.zeros_like(whole, dtype=torch.bool)
    window = inside[300:300 + out.shape[0] * out.stride(0)].view(out.shape[0], out.stride(0))
    window[:, :out.shape[1]] = True
    return bool((whole[~inside] == SENTINEL).all())


def act(form: str, rows: int, k: int, g: torch.Generator, dtype=torch.float32) -> tuple[dict, torch.Tensor]:
    """(the call's activation arguments in dtype, the float64 activation the projection sees)."""
    if form == "swiglu":
        x = torch.randn(rows, 2 * k, generator=g).to(dtype)
        return {"x": x}, swiglu_ref(x)
    x = torch.randn(rows, k, generator=g).to(dtype)
    if form == "norm":
        w = (0.5 + torch.rand(k, generator=g)).to(dtype)
        return {"x": x, "w": w}, rms_ref(x, w, 1e-5)
    return {"x": x}, x.double()


def project(native, kernel: str, form: str, args: dict, weight: tuple, out: torch.Tensor) -> None:
    """native.<kernel>[_swiglu | _norm](activation, *weight, out), as form says."""
    if form == "norm":
        getattr(native, kernel + "_norm")(args["x"], None, args["w"], 1e-5, None, *weight, out)
    else:
        getattr(native, kernel + ("_swiglu" if form == "swiglu" else ""))(args["x"], *weight, out)


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return float((got.double() - want).abs().max() / want.abs().max()) < tol


# (x's dtype, out's dtype): every instantiation the kernels have
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


@pytest.mark.parametrize("form", ["plain", "swiglu", "norm"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "bf16", "bf16-f32out"])
def test_i8_gemm_writes_only_its_out(native, form, dtypes):
    if not native.i8_gemm_available():
        pytest.skip("no AVX512-VNNI on this CPU")
    k, group = 128, 64
    for rows, n in CASES:
        g = torch.Generator().manual_seed(rows * 1000 + n)
        wq, scale = quantize_w8(torch.randn(n, k, generator=g))
        panels, padded = native.pack_w8(wq), F.pad(scale, (0, -n % 16))
        args, a = act(form, rows, k, g, dtypes[0])
        whole, out = guarded(rows, n, dtypes[1])
        project(native, "i8_gemm", form, args, (panels, padded, n, group), out)
        assert outside_untouched(whole, out), (rows, n)
        w = (wq.double() - W8_ZERO) * scale.double()[:, None]
        assert close(out, a @ w.T, 0.03), (rows, n)  # int8 activations per group of 64: ~1% error


@pytest.mark.parametrize("form", ["plain", "swiglu", "norm"])
@pytest.mark.parametrize("dtypes", DTYPES, ids=["f32", "bf16", "bf16-f32out"])
def test_q4a8_gemm_writes_only_its_out(native, form, dtypes):
    if not native.q4a8_gemm_available():
        pytest.skip("no AVX512-VNNI on this CPU")
    k = 96
    for rows, n in CASES:
        g = torch.Generator().manual_seed(rows * 1000 + n)
        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scales, mins = torch.rand(n, k // 32, generator=g) * 0.02, -torch.rand(n, k // 32, generator=g) * 0.1
        blocks = pack_q4a8(packed, scales, mins)
        args, a = act(form, rows, k, g, dtypes[0])
        whole, out = guarded(rows, n, dtypes[1])
        project(native, "q4a8_gemm", form, args, (blocks, n), out)
        assert outside_untouched(whole, out), (rows, n)
        w = unpack_q4(packed).double() * scales.half().double().repeat_interleave(32, 1) + \
            mins.half().double().repeat_interleave(32, 1)  # Q4_1 with f16 scales and mins, as packed
        assert close(out, a @ w.T, 0.03), (rows, n)  # int8 activations per group of 32: ~1% error


@pytest.mark.parametrize("amx", [False, True])
def test_bf16_gemms_write_only_their_out(native, amx):
    if not native.bf16_gemm_available():
        pytest.skip("neither AMX nor AVX512-BF16 on this CPU")
    from deepfuse.codegen.cpu.packed_weights import pack_q4_vnni

    k = 96
    for rows, n in [*CASES, (37, 40), (37, 136)]:  # 37: a whole 32-row block of AMX tiles and a ragged one
        g = torch.Generator().manual_seed(rows * 1000 + n)
        x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
        whole, out = guarded(rows, n, torch.bfloat16)
        native.bf16_gemm(x, native.pack_vnni(w), n, out, amx)
        assert outside_untouched(whole, out), (rows, n)
        assert close(out, x.double() @ w.double().T, 0.02), (rows, n)

        packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        scales, mins = torch.rand(n, k // 32, generator=g) * 0.02, -torch.rand(n, k // 32, generator=g) * 0.1
        whole, out = guarded(rows, n, torch.bfloat16)
        native.q4_gemm(x, *pack_q4_vnni(packed, scales, mins), n, out, amx)
        assert outside_untouched(whole, out), (rows, n)
        assert close(out, x.double() @ dequantize_q4(packed, scales, mins).double().T, 0.02), (rows, n)
