"""The native row kernels (codegen/cpu/rows.cpp: swiglu, rope_cache, argmax) against float64
references and torch, and the compiled CPU step's use of them."""
import pytest
import torch
import torch.nn.functional as F


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_float64_silu_times_up(native, dtype):
    torch.manual_seed(0)
    x = (torch.randn(37, 2 * 83) * 8).to(dtype)  # 83: vector body and a scalar tail
    x[0, :6] = torch.tensor([0.0, -200.0, 200.0, 90.0, -90.0, 1e-30]).to(dtype)
    ref = F.silu(x[:, :83].double()) * x[:, 83:].double()
    got = native.swiglu(x)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), ref.to(dtype).double(), rtol=tol, atol=1e-30)
    out = torch.empty(37, 100, dtype=dtype)[:, :83]  # a strided destination
    assert native.swiglu(x, out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, got, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="x must be"):
        native.swiglu(x[:, :5])


def test_argmax_is_the_sample_ops_greedy_rule_including_ties_nan_and_infinities(native):
    """The first largest value, a NaN counting as -inf: the sample op's reference on greedy rows."""
    from deepfuse.ir import OPS

    torch.manual_seed(0)
    x = torch.randn(12, 1000)
    x[1, [10, 500]] = 7.0  # a tie: the first wins
    x[2, 999] = 9.0  # in the scalar tail
    x[3, [4, 600]] = float("nan")  # NaNs are passed over
    x[4] = float("-inf")
    x[5, 3] = float("inf")
    x[6] = float("nan")  # NaN only: index 0, as for -inf only
    x[7, :] = float("-inf")
    x[7, 0], x[7, 998] = float("nan"), float("-inf")
    x[8, 995:] = float("nan")
    x[9, 999] = float("nan")
    x[9, 998] = 12.0
    greedy = lambda t: OPS["sample"].reference(t, torch.zeros(t.shape[0]), torch.zeros(t.shape[0], dtype=torch.long),
                                               torch.ones(t.shape[0]), torch.zeros(t.shape[0], dtype=torch.long))
    assert torch.equal(native.argmax(x), greedy(x))
    assert torch.equal(native.argmax(x[:, :17]), greedy(x[:, :17]))
    with pytest.raises(RuntimeError, match="f32"):
        native.argmax(x.double())


def rope_reference(x, pos, hd, theta):
    from deepfuse.ir.opdefs_llm import rope_cos_sin

    cos, sin = rope_cos_sin(pos, hd, theta)
    h = x.double().view(x.shape[0], -1, hd)
    rotated = torch.cat((-h[..., hd // 2:], h[..., : hd // 2]), dim=-1)
    return (h * cos.double()[:, None] + rotated * sin.double()[:, None]).reshape(x.shape[0], -1)


def test_rope_tables_are_looked_up_once_per_positions_tensor_and_again_after_a_write():
    from deepfuse.codegen.cpu.kernels import RopeTables

    tables = RopeTables(16, 10000.0)
    pos = torch.tensor([3, 9, 1], dtype=torch.int32)
    cos, sin, pos64 = tables.native(pos)
    assert pos64.dtype == torch.int64 and torch.equal(pos64, pos.long()) and len(cos) > 9
    assert tables.native(pos)[2] is pos64  # the same tensor, unwritten: the step's first lookup reused
    rows = tables.rows(pos, torch.float32)
    assert tables.rows(pos, torch.float32) is rows
    pos[1] = 5000  # written in place (a refilled step buffer): both looked up again
    cos, sin, pos64 = tables.native(pos)
    assert pos64[1] == 5000 and len(cos) > 5000
    torch.testing.assert_close(tables.rows(pos, torch.float32)[0][1, 0], cos[5000])
    assert tables.native(pos.clone())[2] is not pos64  # another tensor


@pytest.mark.parametrize("dtype,hd", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 24)])
def test_rope_cache_rotates_q_k_and_writes_the_cache_at_slots(native, dtype, hd):
    from deepfuse.codegen.cpu.kernels import RopeTables

    torch.manual_seed(0)
    h, hkv, t, theta = 6, 2, 21, 10000.0
    qkv = torch.randn(t, (h + 2 * hkv) * hd).to(dtype)
    pos = torch.randint(0, 300, (t,))
    slots = torch.randperm(8 * 16)[:t]
    cache = torch.zeros(2, 8, 16, hkv, hd, dtype=dtype)
    cos, sin = RopeTables(hd, theta).tables(int(pos.max()), torch.float32, torch.device("cpu"))
    q, k = torch.empty(t, h * hd, dtype=dtype), torch.empty(t, hkv * hd, dtype=dtype)
    native.rope_cache(qkv, pos, cos, sin, cache, slots, h, q, k)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q.double(), rope_reference(qkv[:, : h * hd], pos, hd, theta), rtol=tol, atol=tol)
    torch.testing.assert_close(k.double(), rope_reference(qkv[:, h * hd:(h + hkv) * hd], pos, hd, theta), rtol=tol,
                               atol=tol)
    flat = cache.view(2, -1, hkv * hd)
    assert torch.equal(flat[0][slots], k) and torch.equal(flat[1][slots], qkv[:, (h + hkv) * hd:])
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert not flat[:, untouched].any()
    before = cache.clone()
    with pytest.raises(RuntimeError, match="slot outside"):  # nothing written
        native.rope_cache(qkv, pos, cos, sin, cache, torch.cat([slots[:-1], torch.tensor([8 * 16])]), h, q, k)
    with pytest.raises(RuntimeError, match="position outside"):
        native.rope_cache(qkv, torch.full((t,), len(cos)), cos, sin, cache, slots, h, q, k)
    assert torch.equal(cache, before)


def test_bf16_step_is_close_with_and_without_the_row_kernels(native, tiny_model, monkeypatch):
    """bf16 through the compiled CPU step with the native row kernels and with the torch ops
    they replace (everything else the same): the same first tokens, log-probs within bf16's
    rounding."""
    import deepfuse
    from deepfuse.codegen.cpu import kernels, row_kernels
    from deepfuse.runtime.engine import Engine, SamplingParams

    prompts = [[5, 17, 99, 3, 42, 7, 7, 8] * 5, [9, 2, 64], [100, 3, 3, 3, 3, 3, 3, 3, 3, 3]]
    params = [SamplingParams(temperature=0, max_tokens=1, logprobs=3)] * 3
    with_native = Engine(deepfuse.compile(tiny_model, dtype="bf16")).generate(prompts, params)
    calls = []
    monkeypatch.setattr(kernels, "native_rows", lambda: calls.append(1))
    monkeypatch.setattr(row_kernels, "native_rows", lambda: calls.append(1))  # SwiGLU's
    plain = Engine(deepfuse.compile(tiny_model, dtype="bf16")).generate(prompts, params)
    assert calls  # the torch path ran
    assert [o.outputs[0].token_ids for o in with_native] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(with_native, plain):
        assert a.outputs[0].logprobs[0].keys() == b.outputs[0].logprobs[0].keys()
        first_a, first_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert all(abs(first_a[t].logprob - first_b[t].logprob) < 0.05 for t in first_a)



def test_tensors_off_the_cpu_take_torchs_path_not_the_native_kernels(monkeypatch):
    """The native kernels read host memory: a GPU's tensors (the device check runs the CPU target's
    kernels on the GPU as its peer) must go to torch's ops. "meta" tensors stand in for them here:
    torch's ops keep them meta, and no native kernel is asked for."""
    from deepfuse.codegen.cpu import row_kernels

    asked = []
    monkeypatch.setattr(row_kernels, "native_kernels", lambda: asked.append("norms") or None)
    monkeypatch.setattr(row_kernels, "native_rows", lambda: asked.append("rows") or None)
    x, w = torch.empty(5, 64, device="meta"), torch.empty(64, device="meta")
    assert row_kernels.rms_rows(x, w, 1e-5).device.type == "meta"
    s, normed = row_kernels.add_rms_rows(x, x, w, 1e-5)
    assert s.device.type == normed.device.type == "meta"
    assert row_kernels.swiglu_rows(torch.empty(5, 128, device="meta")).device.type == "meta"
    assert asked == []
    row_kernels.rms_rows(torch.randn(5, 64), torch.ones(64), 1e-5)  # the CPU's tensors still ask
    row_kernels.swiglu_rows(torch.randn(5, 128))
    assert asked == ["norms", "rows"]
