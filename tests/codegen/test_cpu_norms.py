"""The native RMS norm kernels (codegen/cpu/norms.cpp) against the IR's references."""
import pytest
import torch

from deepfuse.ir.opdefs_llm import rms_norm as reference_rms_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,d", [(0, 64), (1, 576), (7, 33), (64, 576), (300, 128)])
def test_rms_norm_matches_the_reference(native, dtype, t, d):
    g = torch.Generator().manual_seed(t * 100 + d)
    x, w = (torch.randn(t, d, generator=g) * 3).to(dtype), (1 + torch.randn(d, generator=g) * 0.1).to(dtype)
    want = reference_rms_norm(x, w, eps=1e-5)
    got = native.rms_norm(x, w, 1e-5)
    assert got.dtype == dtype and got.shape == (t, d)
    # f32: summation order only; bf16: the same two roundings, off by one bf16 step at most
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [40, 576])  # vector lanes and a scalar tail; vector lanes only
def test_add_rms_norm_matches_the_reference_and_writes_into_buffers(native, dtype, d):
    x, res = torch.randn(9, d).to(dtype), torch.randn(9, d).to(dtype)
    w = (1 + torch.randn(d) * 0.1).to(dtype)
    s, normed = native.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(s, x + res)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=8e-3)
    torch.testing.assert_close(normed, reference_rms_norm(x + res, w, eps=1e-6), **tol)
    arena = torch.zeros(9, 2 * d, dtype=dtype)
    s2, n2 = native.add_rms_norm(x, res, w, 1e-6, arena[:, :d], arena[:, d:])
    assert s2.data_ptr() == arena.data_ptr() and torch.equal(arena[:, :d], s) and torch.equal(arena[:, d:], normed)


def test_add_rms_norm_rounds_its_bf16_sums_half_to_even_as_torch_does(native):
    """The sum's f32 -> bf16 rounding (vcvtneps2bf16 where the CPU has AVX512-BF16, integer
    arithmetic elsewhere) on exact ties, either way up or down, in the vector lanes and in
    the scalar tail, and on large, small and negative values."""
    d = 40
    ulp = 2.0 ** -7  # of bf16 at 1.0
    ties = torch.tensor([ulp / 2, 3 * ulp / 2, -ulp / 2, -3 * ulp / 2, ulp / 4, 3 * ulp / 4, 0.0, ulp])
    base = torch.tensor([1.0, -1.0, 2.0 ** 20, 2.0 ** -20, 3.0])
    x = base.repeat_interleave(len(ties))[:d].view(1, d)
    res = (ties.repeat(len(base)) * x.abs().flatten().clamp(min=1.0))[:d].view(1, d)
    x, res = x.to(torch.bfloat16), res.to(torch.bfloat16)
    assert (x.float() + res.float() != (x + res).float()).any()  # some sums do round
    s, _ = native.add_rms_norm(x, res, torch.ones(d, dtype=torch.bfloat16), 1e-6)
    assert torch.equal(s, x + res)

def test_rms_norm_takes_strided_rows_and_refuses_bad_operands(native):
    x = torch.randn(6, 100)
    w = torch.ones(50)
    torch.testing.assert_close(native.rms_norm(x[:, 25:75], w, 1e-5), reference_rms_norm(x[:, 25:75], w, eps=1e-5))
    with pytest.raises(RuntimeError, match="w must be"):
        native.rms_norm(x[:, :50], torch.ones(49), 1e-5)
    with pytest.raises(RuntimeError, match="w must be"):
        native.rms_norm(x[:, :50], torch.ones(50, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="unit column stride"):
        native.rms_norm(x[:, ::2], w, 1e-5)
    with pytest.raises(RuntimeError, match="f32 or bf16"):
        native.rms_norm(x.half()[:, :50], w.half(), 1e-5)
    with pytest.raises(RuntimeError, match="res must be"):
        native.add_rms_norm(x[:, :50], torch.randn(6, 49), w, 1e-5)
