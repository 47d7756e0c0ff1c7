"""The native f32 panel GEMM (codegen/cpu/panel_gemm.cpp) against a float64 matmul."""
import pytest
import torch

from deepfuse.codegen.cpu.packed_weights import PanelWeight, packed_linear, prepack_linear_weight


@pytest.mark.parametrize("n,k", [(50, 37), (48, 64), (16, 1), (1, 8), (200, 96)])
@pytest.mark.parametrize("m", [0, 1, 3, 8, 9, 17, 40])
def test_panel_gemm_matches_float64(native, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    y = native.panel_gemm(x, native.pack_panels(w), n)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), x.double() @ w.double().T, atol=1e-4, rtol=1e-5)


def test_panel_gemm_takes_strided_rows(native):
    w, x = torch.randn(33, 20), torch.randn(6, 40)
    packed = native.pack_panels(w)
    for view in (x[:, :20], x[:, ::2], x[::2, 5:25]):
        torch.testing.assert_close(native.panel_gemm(view, packed, 33), view @ w.T, atol=1e-5, rtol=1e-5)


def test_panel_gemm_refuses_mismatched_operands(native):
    packed = native.pack_panels(torch.randn(32, 8))
    with pytest.raises(RuntimeError, match="panels must come from pack_panels"):
        native.panel_gemm(torch.randn(2, 9), packed, 32)  # K differs
    with pytest.raises(RuntimeError, match="panels must come from pack_panels"):
        native.panel_gemm(torch.randn(2, 8), packed, 40)  # N needs three panels
    with pytest.raises(RuntimeError, match="float32"):
        native.panel_gemm(torch.randn(2, 8, dtype=torch.bfloat16), packed, 32)
    with pytest.raises(RuntimeError, match="float32"):
        native.pack_panels(torch.randn(4, 8).double())


def test_prepacked_f32_projection_uses_the_panels(native):
    w, x = torch.randn(70, 24), torch.randn(5, 24)
    packed = prepack_linear_weight(w)
    assert isinstance(packed, PanelWeight)
    torch.testing.assert_close(packed_linear(x, packed), x @ w.T, atol=1e-5, rtol=1e-5)


def test_panel_gemm_writes_into_a_given_buffer(native):
    w, x = torch.randn(40, 12), torch.randn(7, 12)
    arena = torch.full((7, 64), float("nan"))
    out = arena[:, 8:48]  # rows strided, as a planned step buffer's view may be
    assert native.panel_gemm(x, native.pack_panels(w), 40, out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, x @ w.T, atol=1e-5, rtol=1e-5)
    assert arena[:, :8].isnan().all() and arena[:, 48:].isnan().all()
    with pytest.raises(RuntimeError, match="out must be"):
        native.panel_gemm(x, native.pack_panels(w), 40, torch.empty(7, 41))


@pytest.fixture(scope="module")
def bf16(native):
    if not native.bf16_gemm_available():
        pytest.skip("neither AMX nor AVX512-BF16 on this CPU")
    return native


@pytest.fixture(params=[True, False], ids=["amx", "vector"])
def use_amx(request, bf16):
    """Both paths of the native bf16 GEMM: AMX tiles (where the CPU has them), AVX512-BF16."""
    if request.param and not bf16.amx_available():
        pytest.skip("no AMX on this CPU")
    return request.param


@pytest.mark.parametrize("n,k", [(50, 37), (48, 64), (33, 96), (200, 576)])
@pytest.mark.parametrize("m", [0, 1, 5, 16, 17, 33, 70])
def test_bf16_gemm_matches_float64(bf16, use_amx, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g).bfloat16(), torch.randn(m, k, generator=g).bfloat16()
    y = bf16.bf16_gemm(x, bf16.pack_vnni(w), n, amx=use_amx)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    want = x.double() @ w.double().T  # f32 accumulation, one bf16 rounding of the result
    torch.testing.assert_close(y.double(), want, atol=1e-2 * k ** 0.5, rtol=8e-3)


def test_bf16_gemm_takes_strided_rows_and_writes_into_a_buffer(bf16, use_amx):
    w, x = torch.randn(40, 64).bfloat16(), torch.randn(20, 128).bfloat16()
    packed = bf16.pack_vnni(w)
    for view in (x[:, :64], x[:, ::2], x[::2, 10:74]):
        want = (view.double() @ w.double().T)
        torch.testing.assert_close(bf16.bf16_gemm(view, packed, 40, amx=use_amx).double(), want, atol=0.1, rtol=8e-3)
    arena = torch.full((20, 64), float("nan"), dtype=torch.bfloat16)
    out = arena[:, 8:48]
    assert bf16.bf16_gemm(x[:, :64], packed, 40, out, use_amx).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.double(), x[:, :64].double() @ w.double().T, atol=0.1, rtol=8e-3)
    assert arena[:, :8].isnan().all() and arena[:, 48:].isnan().all()
    with pytest.raises(RuntimeError, match="panels must come from pack_vnni"):
        bf16.bf16_gemm(torch.randn(2, 96).bfloat16(), packed, 40)  # K differs
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16.bf16_gemm(x[:, :64].float(), packed, 40)


@pytest.mark.parametrize("m", [1, 6, 7, 40])
def test_bf16_gemm_rows_do_not_depend_on_the_row_count(bf16, use_amx, m):
    """Each row's sums run in one order whichever rows share its tile: the first rows of a call
    are bit-identical to a call with more rows (what batch invariance rests on)."""
    w, x = torch.randn(100, 576).bfloat16(), torch.randn(70, 576).bfloat16()
    packed = bf16.pack_vnni(w)
    assert torch.equal(bf16.bf16_gemm(x[:m], packed, 100, amx=use_amx), bf16.bf16_gemm(x, packed, 100, amx=use_amx)[:m])


def test_prepacked_bf16_projection_uses_the_native_gemm(bf16):
    w, x = torch.randn(70, 64).bfloat16(), torch.randn(5, 64).bfloat16()
    packed = prepack_linear_weight(w)
    assert isinstance(packed, PanelWeight)
    torch.testing.assert_close(packed_linear(x, packed).double(), x.double() @ w.double().T, atol=0.1, rtol=8e-3)


def int4_weight(n: int, k: int):
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    return packed, torch.rand(n, k // 32) * 0.02, -torch.rand(n, k // 32) * 0.1


# rows: one tile row, both halves of a row block, several blocks with a ragged last one;
# columns: an odd panel count, a partial last panel; depths: one group, several
@pytest.mark.parametrize("m,n,k", [(1, 40, 32), (5, 33, 96), (37, 960, 576), (70, 48, 1536)])
def test_int4_gemm_is_the_dense_gemm_of_the_dequantized_weight(bf16, use_amx, m, n, k):
    """q4_gemm dequantizes to exactly the dense copy's bf16 values (q * scale + min, rounded
    twice as torch does), so its result is the dense bf16 GEMM's, bit for bit, on either path."""
    from deepfuse.codegen.cpu.packed_weights import pack_q4_vnni
    from deepfuse.ir.opdefs_quant import dequantize_q4

    torch.manual_seed(m)
    packed, scales, mins = int4_weight(n, k)
    x = torch.randn(m, k).bfloat16()
    dense = dequantize_q4(packed, scales, mins).bfloat16()
    got = bf16.q4_gemm(x, *pack_q4_vnni(packed, scales, mins), n, amx=use_amx)
    assert torch.equal(got, bf16.bf16_gemm(x, bf16.pack_vnni(dense), n, amx=use_amx))
    out = torch.empty(m, n + 3, dtype=torch.bfloat16)[:, :n]
    assert bf16.q4_gemm(x, *pack_q4_vnni(packed, scales, mins), n, out, use_amx).data_ptr() == out.data_ptr()
    assert torch.equal(out, got)


def test_int4_gemm_refuses_mismatched_operands(bf16):
    from deepfuse.codegen.cpu.packed_weights import pack_q4_vnni

    nibbles, scales, mins = pack_q4_vnni(*int4_weight(40, 64))
    with pytest.raises(RuntimeError, match="pack_q4_vnni"):
        bf16.q4_gemm(torch.randn(2, 96).bfloat16(), nibbles, scales, mins, 40)  # K differs
    with pytest.raises(RuntimeError, match="scales and mins"):
        bf16.q4_gemm(torch.randn(2, 64).bfloat16(), nibbles, scales.half(), mins, 40)
    with pytest.raises(RuntimeError, match="bfloat16"):
        bf16.q4_gemm(torch.randn(2, 64), nibbles, scales, mins, 40)


def test_int4_projection_keeps_no_dense_copy(bf16):
    """bf16 int4 weights run in the native int4 GEMM above torch's int4 GEMM's rows, with no
    dense bf16 copy in memory; the result equals the dense path's."""
    from deepfuse.codegen.cpu.packed_weights import Q4Panels, Q4Weights, q4_linear
    from deepfuse.ir.opdefs_quant import dequantize_q4

    packed, scales, mins = int4_weight(48, 64)
    w = Q4Weights(torch.bfloat16, packed, scales, mins)
    assert isinstance(w.dense, Q4Panels)
    x = torch.randn(9, 64).bfloat16()
    dense = prepack_linear_weight(dequantize_q4(packed, scales, mins).bfloat16())
    assert torch.equal(q4_linear(x, w), packed_linear(x, dense))
