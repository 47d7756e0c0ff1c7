"""int4 x int8 projections (linear_q4a8): the native VNNI kernel (q4a8_gemm.cpp) against an
independent float64 reference (the activation quantized per row and group of 32, the Q4_1 weight
dequantized with f16 scales and mins), the kernel's sensitivity to the nibble order and the min
term, batch independence, the norm / SwiGLU prologue-fused forms against the ops' references, and
the int4-a8 build end to end against the interpreter."""
import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu.native import kernels
from deepfuse.codegen.cpu.q4a8_kernels import Q4A8Weights, pack_q4a8, q4a8_linear
from deepfuse.ir import interpret
from deepfuse.ir.opdefs_fused import add_rms_norm_linear, is_q4a8, rms_norm_linear, swiglu_linear
from deepfuse.ir.opdefs_llm import rms_norm
from deepfuse.ir.opdefs_quant import linear_q4a8, quantize_q4
from tests.helpers import greedy_with

native = kernels()
needs_kernel = pytest.mark.skipif(native is None or not native.q4a8_gemm_available(),
                                  reason="the native q4a8 kernel needs AVX512-VNNI and a g++ build")


def weight(n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // 32, generator=g) * 0.02
    mins = -torch.rand(n, k // 32, generator=g) * 0.2  # far from zero: a missing min term is visible
    return packed, scales, mins


def reference(x: torch.Tensor, packed, scales, mins) -> torch.Tensor:
    """Shares no code with the op: per row and group of 32, d = max|x| / 127 and q = round(x / d)
    (in f32, as documented), the Q4_1 weight spelled out nibble by nibble, float64 products."""
    t, k = x.shape
    xf = x.float().view(t, k // 32, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    xq = ((xf * inv).round().clamp(-127, 127).double() * (amax.double() / 127)).view(t, k)
    n = packed.shape[0]
    w = torch.empty(n, k, dtype=torch.float64)
    w[:, 0::2], w[:, 1::2] = (packed & 0xF).double(), (packed >> 4).double()  # byte j: k = 2j low, 2j + 1 high
    s = scales.half().double().repeat_interleave(32, 1)
    m = mins.half().double().repeat_interleave(32, 1)
    return xq @ (w * s + m).T


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("rows,n,k", [(1, 64, 576), (1, 1000, 576), (2, 1000, 96), (3, 40, 96), (9, 200, 1536)])
def test_kernel_matches_float64_reference(dtype, tol, rows, n, k):
    packed, scales, mins = weight(n, k)
    x = torch.randn(rows, k).to(dtype)
    x[0, 32:64] = 0  # a zero group
    got = native.q4a8_gemm(x, pack_q4a8(packed, scales, mins), n)
    assert got.dtype == dtype and got.shape == (rows, n)
    want = reference(x, packed, scales, mins)
    assert rel_err(got, want) < tol
    assert rel_err(linear_q4a8(x, packed, scales, mins, group_size=32), want) < tol  # the op's own reference


@needs_kernel
def test_wrong_nibble_order_or_missing_min_term_would_fail():
    """The reference the kernel passes is far from one with the nibbles swapped or without mins."""
    packed, scales, mins = weight(48, 128, seed=1)
    x = torch.randn(2, 128)
    got = native.q4a8_gemm(x, pack_q4a8(packed, scales, mins), 48)
    assert rel_err(got, reference(x, packed, scales, mins)) < 1e-5
    swapped = (packed >> 4) | ((packed & 0xF) << 4)
    assert rel_err(got, reference(x, swapped, scales, mins)) > 0.05
    assert rel_err(got, reference(x, packed, scales, torch.zeros_like(mins))) > 0.05


@needs_kernel
def test_a_rows_result_does_not_depend_on_the_batch():
    # 1000 columns: 63 panels, a partial last one; one row goes 8 panels at a time, two rows 4, more 2
    packed, scales, mins = weight(1000, 576, seed=2)
    blocks, x = pack_q4a8(packed, scales, mins), torch.randn(11, 576).bfloat16()
    whole = native.q4a8_gemm(x, blocks, 1000)
    for r in (0, 4, 10):
        assert torch.equal(native.q4a8_gemm(x[r:r + 1], blocks, 1000)[0], whole[r])
    assert torch.equal(native.q4a8_gemm(x[5:7], blocks, 1000), whole[5:7])
    assert torch.equal(native.q4a8_gemm(x[3:8], blocks, 1000), whole[3:8])


@needs_kernel
def test_f32_out_and_packed_weights_call():
    packed, scales, mins = weight(40, 64, seed=3)
    w, x = Q4A8Weights(torch.bfloat16, packed, scales, mins), torch.randn(2, 64).bfloat16()
    assert w.native is not None
    out = torch.empty(2, 40)
    native.q4a8_gemm(x, w.blocks, 40, out)
    assert rel_err(out, reference(x, packed, scales, mins)) < 1e-5
    y = torch.full((2, 40), float("nan"), dtype=torch.bfloat16)
    assert q4a8_linear(x, w, y) is y and torch.equal(y, native.q4a8_gemm(x, w.blocks, 40))


def test_reference_weights_where_the_kernel_does_not_run():
    """f16 activations (or groups other than 32) keep the op's reference."""
    packed, scales, mins = quantize_q4(torch.randn(24, 64), 32)
    w, x = Q4A8Weights(torch.float16, packed, scales, mins), torch.randn(3, 64).half()
    assert w.native is None
    torch.testing.assert_close(q4a8_linear(x, w), linear_q4a8(x, packed, scales, mins, group_size=32))


Q4A8 = {"group_size": 32, "act_group": 32}  # a fused op's int4-a8 projection


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("with_res", [False, True])
def test_fused_norm_matches_the_ops_references(dtype, tol, rows, with_res):
    """q4a8_gemm_norm against rms_norm_linear / add_rms_norm_linear's references (the norm in torch,
    then linear_q4a8) and the float64 reference of the torch norm; the sum comes out exactly."""
    n, k = 200, 576
    packed, scales, mins = weight(n, k, seed=4)
    g = torch.Generator().manual_seed(rows)
    x, res = torch.randn(rows, k, generator=g).to(dtype), torch.randn(rows, k, generator=g).to(dtype)
    nw = (torch.rand(k, generator=g) + 0.5).to(dtype)
    blocks, sum_out = pack_q4a8(packed, scales, mins), torch.full((rows, k), float("nan"), dtype=dtype)
    if with_res:
        got = native.q4a8_gemm_norm(x, res, nw, 1e-5, sum_out, blocks, n)
        s, want_op = add_rms_norm_linear(x, res, nw, packed, scales, mins, eps=1e-5, **Q4A8)
        assert torch.equal(sum_out, s) and torch.equal(s, x + res)
    else:
        got = native.q4a8_gemm_norm(x, None, nw, 1e-5, None, blocks, n)
        s, want_op = x, rms_norm_linear(x, nw, packed, scales, mins, eps=1e-5, **Q4A8)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert rel_err(got, want_op.double()) < tol
    assert rel_err(got, reference(rms_norm(s, nw, eps=1e-5), packed, scales, mins)) < tol


@needs_kernel
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)])
def test_fused_swiglu_matches_the_ops_reference(dtype, tol):
    """The op's reference rounds silu(gate) and the product to bf16 apart (the kernel once, as the
    float64 reference here does), so against it bf16 gets twice the tolerance."""
    n, f = 72, 1536
    packed, scales, mins = weight(n, f, seed=5)
    x = torch.randn(3, 2 * f, generator=torch.Generator().manual_seed(5)).to(dtype)
    got = native.q4a8_gemm_swiglu(x, pack_q4a8(packed, scales, mins), n)
    assert got.dtype == dtype and got.shape == (3, n)
    assert rel_err(got, swiglu_linear(x, packed, scales, mins, **Q4A8).double()) < 2 * tol
    act = (torch.nn.functional.silu(x[:, :f].float()) * x[:, f:].float()).to(dtype)
    assert rel_err(got, reference(act, packed, scales, mins)) < tol


@needs_kernel
def test_fused_forms_are_batch_independent_and_match_the_unfused_kernels():
    """A row's result is the same alone or in a batch, and bit for bit the unfused native norm /
    SwiGLU followed by q4a8_gemm (the prologue makes the same rows)."""
    n, k = 960, 576
    packed, scales, mins = weight(n, k, seed=6)
    blocks = pack_q4a8(packed, scales, mins)
    x, res, nw = torch.randn(7, k).bfloat16(), torch.randn(7, k).bfloat16(), torch.rand(k).bfloat16() + 0.5
    sum_out = torch.empty_like(x)
    whole = native.q4a8_gemm_norm(x, res, nw, 1e-5, sum_out, blocks, n)
    s, normed = native.add_rms_norm(x, res, nw, 1e-5)
    assert torch.equal(sum_out, s) and torch.equal(whole, native.q4a8_gemm(normed, blocks, n))
    for r in (0, 6):
        one = native.q4a8_gemm_norm(x[r:r + 1], res[r:r + 1], nw, 1e-5, torch.empty_like(x[:1]), blocks, n)
        assert torch.equal(one[0], whole[r])
    h = torch.randn(5, 2 * k).bfloat16()
    both = native.q4a8_gemm_swiglu(h, blocks, n)
    assert torch.equal(both, native.q4a8_gemm(native.swiglu(h), blocks, n))
    assert torch.equal(native.q4a8_gemm_swiglu(h[2:3], blocks, n)[0], both[2])


def test_int4_a8_build_matches_the_interpreter(tiny_model):
    """int4-a8: every projection linear_q4a8, the norms before q/k/v and gate/up and the SwiGLU
    before down fused into them (rms_norm_linear, add_rms_norm_linear, swiglu_linear with an
    int4-a8 projection), the head logits_w8a8; the CPU build's greedy tokens and logits match
    the interpreter on its own graph."""
    art = deepfuse.compile(tiny_model, quant="int4-a8")
    counts = art.graph.op_counts()
    layers = tiny_model.config.num_layers
    assert counts.get("linear_q4a8", 0) > 0 and counts["logits_w8a8"] == 1
    assert counts["swiglu_linear"] == layers and counts.get("rms_norm_linear", 0) + counts["add_rms_norm_linear"] == 2 * layers
    assert all(is_q4a8(n.attrs) for n in art.graph.nodes
               if n.op in ("rms_norm_linear", "add_rms_norm_linear", "swiglu_linear"))
    assert not {"linear", "linear_q4", "logits", "swiglu"} & set(counts)
    prompt = [1, 5, 9, 2, 7]
    want, want_logits = greedy_with(lambda inputs: interpret(art.graph, inputs), tiny_model.config, prompt, 6)
    got, logits = greedy_with(art, tiny_model.config, prompt, 6)
    assert got == want
    torch.testing.assert_close(logits, want_logits, atol=1e-3, rtol=1e-3)
