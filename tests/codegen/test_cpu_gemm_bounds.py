"""The native GEMMs write their out and nothing else, at every row count and with a partial last
panel: out is a window of a larger tensor filled with a sentinel, and after the call every element
outside the window still holds it. Each result is also checked against a float64 reference that
shares no code with the kernel (a miscompiled tile table once called a 2-panel tile for a lone
last panel: the fused SwiGLU form wrote a row above and rows below its out, and read garbage)."""
import pytest
import torch
import torch.nn.functional as F

from deepfuse.codegen.cpu.q4a8_kernels import pack_q4a8
from deepfuse.ir.opdefs_quant import W8_ZERO, dequantize_q4, quantize_w8, unpack_q4

SENTINEL = 12345.0
ROWS = (1, 2, 3, 5, 7, 13)
N = 40  # two whole panels of 16 and a partial one


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


def swiglu64(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def norm64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.double() * (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).rsqrt()
    return h * w.double()


def act(form: str, rows: int, k: int, g: torch.Generator) -> tuple[dict, torch.Tensor]:
    """(the call's activation arguments, the float64 activation the projection sees)."""
    if form == "swiglu":
        x = torch.randn(rows, 2 * k, generator=g)
        return {"x": x}, swiglu64(x)
    x = torch.randn(rows, k, generator=g)
    if form == "norm":
        w = 0.5 + torch.rand(k, generator=g)
        return {"x": x, "w": w}, norm64(x, w)
    return {"x": x}, x.double()


def close(got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    return float((got.double() - want).abs().max() / want.abs().max()) < tol


@pytest.mark.parametrize("form", ["plain", "swiglu", "norm"])
@pytest.mark.parametrize("rows", ROWS)
def test_i8_gemm_writes_only_its_out(native, form, rows):
    if not native.i8_gemm_available():
        pytest.skip("no AVX512-VNNI on this CPU")
    g = torch.Generator().manual_seed(rows)
    k, group = 128, 64
    wq, scale = quantize_w8(torch.randn(N, k, generator=g))
    panels, padded = native.pack_w8(wq), F.pad(scale, (0, -N % 16))
    args, a = act(form, rows, k, g)
    whole, out = guarded(rows, N, torch.float32)
    if form == "plain":
        native.i8_gemm(args["x"], panels, padded, N, group, out)
    elif form == "swiglu":
        native.i8_gemm_swiglu(args["x"], panels, padded, N, group, out)
    else:
        native.i8_gemm_norm(args["x"], None, args["w"], 1e-5, None, panels, padded, N, group, out)
    assert outside_untouched(whole, out)
    w = (wq.double() - W8_ZERO) * scale.double()[:, None]
    assert close(out, a @ w.T, 0.03)  # int8 activations per group of 64: ~1% error


@pytest.mark.parametrize("form", ["plain", "swiglu", "norm"])
@pytest.mark.parametrize("rows", ROWS)
def test_q4a8_gemm_writes_only_its_out(native, form, rows):
    if not native.q4a8_gemm_available():
        pytest.skip("no AVX512-VNNI on this CPU")
    g = torch.Generator().manual_seed(100 + rows)
    k = 96
    packed = torch.randint(0, 256, (N, k // 2), dtype=torch.uint8, generator=g)
    scales, mins = torch.rand(N, k // 32, generator=g) * 0.02, -torch.rand(N, k // 32, generator=g) * 0.1
    blocks = pack_q4a8(packed, scales, mins)
    args, a = act(form, rows, k, g)
    whole, out = guarded(rows, N, torch.float32)
    if form == "plain":
        native.q4a8_gemm(args["x"], blocks, N, out)
    elif form == "swiglu":
        native.q4a8_gemm_swiglu(args["x"], blocks, N, out)
    else:
        native.q4a8_gemm_norm(args["x"], None, args["w"], 1e-5, None, blocks, N, out)
    assert outside_untouched(whole, out)
    w = unpack_q4(packed).double() * scales.half().double().repeat_interleave(32, 1) + \
        mins.half().double().repeat_interleave(32, 1)  # Q4_1 with f16 scales and mins, as packed
    assert close(out, a @ w.T, 0.03)  # int8 activations per group of 32: ~1% error


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("rows", ROWS + (37,))
def test_bf16_gemms_write_only_their_out(native, amx, rows):
    if not native.bf16_gemm_available():
        pytest.skip("neither AMX nor AVX512-BF16 on this CPU")
    from deepfuse.codegen.cpu.kernels import pack_q4_vnni

    g = torch.Generator().manual_seed(200 + rows)
    k = 96
    x, w = torch.randn(rows, k, generator=g).bfloat16(), torch.randn(N, k, generator=g).bfloat16()
    whole, out = guarded(rows, N, torch.bfloat16)
    native.bf16_gemm(x, native.pack_vnni(w), N, out, amx)
    assert outside_untouched(whole, out)
    assert close(out, x.double() @ w.double().T, 0.02)

    packed = torch.randint(0, 256, (N, k // 2), dtype=torch.uint8, generator=g)
    scales, mins = torch.rand(N, k // 32, generator=g) * 0.02, -torch.rand(N, k // 32, generator=g) * 0.1
    whole, out = guarded(rows, N, torch.bfloat16)
    native.q4_gemm(x, *pack_q4_vnni(packed, scales, mins), N, out, amx)
    assert outside_untouched(whole, out)
    assert close(out, x.double() @ dequantize_q4(packed, scales, mins).double().T, 0.02)
