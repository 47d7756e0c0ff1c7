"""The int8 KV cache (compile(kv_cache_dtype="int8")): the row format, the native cache write
(rows.cpp) bit for bit against the reference's, the native decode and prefill attention over int8
rows against a float64 softmax over the dequantized rows, the CPU attention kernel (native and
SDPA paths) against the op's reference, models end to end against the interpreter, and the
errors for what it does not do."""
import math

import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu import attention as cpu_attention
from deepfuse.codegen.cpu.kernels import RopeTables, make_kernel
from deepfuse.errors import DeepfuseError
from deepfuse.ir import OPS, TensorType, interpret
from deepfuse.ir.opdefs_llm import dequantize_kv_rows, quantize_kv_rows, write_kv_rows
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache
from tests.codegen.test_cpu_paged_decode import reference as decode_reference
from tests.codegen.test_cpu_prefill_attention import case as prefill_case
from tests.codegen.test_cpu_prefill_attention import reference as prefill_reference
from tests.helpers import greedy_with, scheduled_preemptions


def int8_cache(cache: torch.Tensor) -> torch.Tensor:
    """A float cache [2,N,BS,Hkv,D] as int8 rows [2,N,BS,Hkv,D+4]."""
    return quantize_kv_rows(cache)


def test_rows_keep_each_value_within_half_a_step_and_a_zero_row_is_zero():
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64) * torch.tensor([0.01, 1.0, 40.0])[None, :, None]
    x[2, 1] = 0
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, 3, 68)
    scale = rows[..., 64:].contiguous().view(torch.float32)  # the last 4 bytes: the f32 scale
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    back = dequantize_kv_rows(rows)
    # half a step, plus the f32 roundings of x * (127 / amax) and q * scale (each 2^-24 relative,
    # |q| <= 127): ~2^-22 |x| (with 1e-6 of half a step instead, 5 random draws in 3,000 failed)
    assert bool(((back - x).abs() <= scale / 2 + x.abs() * 2.0 ** -22).all())
    assert bool((rows[2, 1] == 0).all()) and bool((back[2, 1] == 0).all())
    live = scale[..., 0] > 0
    assert bool((rows[..., :64].abs().amax(-1)[live] == 127).all())  # each row's largest value is 127


def test_cache_types_name_the_expected_shape():
    f32 = lambda *s: TensorType("f32", s)
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    i64 = lambda *s: TensorType("i64", s)
    args = lambda cache: [f32("T", 64), f32("T", 32), f32("T", 32), cache, i64("T"), i64("S", "B"), i64("S"), i64("S")]
    assert OPS["attention"].infer(args(TensorType("i8", (2, "N", "BS", 2, 20))), attrs) == [f32("T", 64)]
    with pytest.raises(ValueError, match=r"\[2,N,BS,2,20\]"):
        OPS["attention"].infer(args(TensorType("i8", (2, "N", "BS", 2, 16))), attrs)
    with pytest.raises(ValueError, match="neither"):
        OPS["attention"].infer(args(TensorType("bf16", (2, "N", "BS", 2, 16))), attrs)


@pytest.mark.parametrize("dtype,hd", [(torch.float32, 64), (torch.bfloat16, 64), (torch.bfloat16, 128), (torch.float32, 24)])
def test_native_cache_write_is_the_reference_bit_for_bit(native, dtype, hd):
    torch.manual_seed(0)
    h, hkv, t, theta = 6, 2, 21, 10000.0
    qkv = torch.randn(t, (h + 2 * hkv) * hd).to(dtype) * 3
    qkv[4, (h + hkv) * hd:(h + hkv + 1) * hd] = 0  # a zero v row
    pos = torch.randint(0, 300, (t,))
    slots = torch.randperm(8 * 16)[:t]
    cache = torch.zeros(2, 8, 16, hkv, hd + 4, dtype=torch.int8)
    cos, sin = RopeTables(hd, theta).tables(int(pos.max()), torch.float32, torch.device("cpu"))
    q, k = torch.empty(t, h * hd, dtype=dtype), torch.empty(t, hkv * hd, dtype=dtype)
    native.rope_cache(qkv, pos, cos, sin, cache, slots, h, q, k)
    want = torch.zeros_like(cache)
    write_kv_rows(want, k, qkv[:, (h + hkv) * hd:], slots)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match="int8"):
        native.rope_cache(qkv, pos, cos, sin, torch.zeros(2, 8, 16, hkv, hd, dtype=torch.int16), slots, h, q, k)


@pytest.mark.parametrize("dtype,window,h,hkv,d,bs", [
    (torch.float32, 0, 6, 2, 64, 16), (torch.bfloat16, 0, 9, 3, 64, 16), (torch.bfloat16, 37, 8, 1, 128, 32),
    (torch.float32, 5, 18, 2, 48, 8), (torch.bfloat16, 0, 6, 2, 48, 16)])
def test_decode_over_int8_rows_matches_a_plain_softmax(native, dtype, window, h, hkv, d, bs):
    """The vector kernel (head size 64/128) and the plain one (48) on int8 rows: against a float64
    softmax over the rows dequantized (the kernel folds each row's scale into its score and weight)."""
    torch.manual_seed(0)
    nb = 80
    cache = torch.randn(2, nb, bs, hkv, d)
    cache[:, 3] *= 30  # peaked softmaxes and rows of very different scales
    rows = int8_cache(cache)
    lens = torch.tensor([1, 16, 17, 40, 95, 33, 128, 600])
    tables = torch.stack([torch.randperm(nb) for _ in lens])  # scattered blocks
    q = torch.randn(len(lens), h * d).to(dtype)
    out = torch.empty_like(q)
    native.paged_decode(q, rows, tables, lens, h, window, d ** -0.5, out, 2)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want = decode_reference(q, dequantize_kv_rows(rows), tables, lens, h, window, d ** -0.5)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("h,hkv,d,bs,window", [(9, 3, 64, 16, 0), (6, 2, 128, 8, 0), (8, 1, 128, 16, 100)])
def test_prefill_over_int8_rows_matches_a_plain_softmax(native, h, hkv, d, bs, window):
    if not native.paged_prefill_available():
        pytest.skip("no AVX512-BF16 (nor AMX) on this machine")
    q, cache, tables, rows, qlens, lens = prefill_case(h, hkv, d, bs)
    packed = int8_cache(cache.float())
    want = prefill_reference(q, dequantize_kv_rows(packed), tables, rows, qlens, lens, h, window, d ** -0.5)
    mine = torch.cat([torch.arange(int(r), int(r) + int(n)) for r, n in zip(rows, qlens)])
    for amx in {False, bool(native.amx_available())}:
        out = torch.full_like(q, 7.0)
        native.paged_prefill(q, packed, tables, rows, qlens, lens, h, window, d ** -0.5, out, amx)
        torch.testing.assert_close(out[mine].double(), want[mine], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_native", [True, False])
def test_attention_kernel_over_an_int8_cache_matches_the_reference(dtype, use_native, monkeypatch):
    """Prompts, decodes, mixed steps and short verify chunks through the CPU attention kernel (native
    kernels, or the SDPA paths that gather and dequantize blocks) against the op's reference, with
    the same int8 cache contents written by both."""
    if not use_native:
        monkeypatch.setattr(cpu_attention, "native_kernels", lambda: None)
    torch.manual_seed(0)
    h, hkv, hd = 6, 2, 64
    attrs = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, scale=1 / math.sqrt(hd))
    caches = [KVCache(1, hkv, hd + 4, torch.int8, CacheConfig(block_size=16, num_blocks=64)) for _ in range(2)]
    tables = [[[], [], [], []], [[], [], [], []]]
    for step in ([(0, 70), (0, 3), (0, 40), (0, 2)], [(70, 1), (3, 1), (40, 1), (2, 1)],
                 [(71, 1), (4, 30), (41, 1), (3, 2)], [(72, 4), (34, 3), (42, 1), (5, 6)]):
        inputs = [build_step([SeqChunk([1] * n, start, tables[c][s]) for s, (start, n) in enumerate(step)], caches[c])
                  for c in range(2)]
        t = inputs[0]["tokens"].shape[0]
        q, k, v = (torch.randn(t, n * hd).to(dtype) for n in (h, hkv, hkv))

        def args(i, q=q, k=k, v=v):
            return (q, k, v, i["kv_cache.0"], i["slot_mapping"], i["block_tables"], i["seq_lens"], i["query_lens"])

        want = OPS["attention"].reference(*args(inputs[0]), **attrs)
        got = make_kernel("attention", attrs)(*args(inputs[1]))
        assert torch.equal(caches[0].layers[0], caches[1].layers[0])
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_tiny_model_with_an_int8_cache_matches_the_interpreter_and_survives_an_artifact(tiny_model, tmp_path):
    art = deepfuse.compile(tiny_model, kv_cache_dtype="int8")
    assert art.kv_cache_dtype == "int8" and art.kv_cache_type.dtype == "i8"
    kv = art.kv_cache_type
    got, got_logits = greedy_with(art, tiny_model.config, [1, 5, 9, 2], 6, kv=kv)
    want, want_logits = greedy_with(lambda inputs: interpret(art.graph, inputs), tiny_model.config, [1, 5, 9, 2], 6,
                                    kv=kv)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    loaded = deepfuse.load(art.save(str(tmp_path / "kv8")))
    assert loaded.kv_cache_dtype == "int8"
    assert greedy_with(loaded, tiny_model.config, [1, 5, 9, 2], 6, kv=kv)[0] == got


def test_smollm2_bf16_with_an_int8_cache_keeps_its_greedy_answer(smollm2):
    """SmolLM2 in bf16 (native prefill and decode over int8 rows) against the interpreter running
    the same graph's references, and the answer of the bf16 cache."""
    model, tok = smollm2
    llm = deepfuse.LLM("smollm2", dtype="bf16", kv_cache_dtype="int8", num_blocks=64)
    assert llm.engine.cache.layers[0].dtype == torch.int8
    assert llm.engine.cache.layers[0].shape[-1] == model.config.head_dim + 4
    prompt = tok.encode("The capital of France is")
    got, _ = greedy_with(llm.model, model.config, prompt, 6, kv=llm.model.kv_cache_type)
    want, _ = greedy_with(lambda inputs: interpret(llm.model.graph, inputs), model.config, prompt, 6,
                          kv=llm.model.kv_cache_type)
    assert got == want
    assert tok.decode(got).startswith(" Paris")
    out = llm.generate(["The capital of France is"], deepfuse.SamplingParams(temperature=0, max_tokens=6),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == got


def test_int8_cache_refuses_what_it_does_not_do(tiny_model, tmp_path):
    with pytest.raises(DeepfuseError, match="kv_cache_dtype 'fp8'"):
        deepfuse.compile(tiny_model, kv_cache_dtype="fp8")
    with pytest.raises(DeepfuseError, match="cpu target"):
        deepfuse.compile(tiny_model, target="sm90", kv_cache_dtype="int8")
    path = deepfuse.compile(tiny_model).save(str(tmp_path / "float-cache"))
    with pytest.raises(DeepfuseError, match="recompile"):
        deepfuse.LLM(artifact=path, kv_cache_dtype="int8")


def test_engine_with_an_int8_cache_batches_preempts_and_shares_prefixes_without_changing_outputs(tiny_model):
    """The runtime over int8 caches: a batch gives each request's tokens alone, a cache too small
    for every request (preemption by recompute) gives the large cache's, and the prefix cache
    serves shared prompt blocks (hit rate reported) with unchanged outputs."""
    from deepfuse.runtime.engine import Engine, SamplingParams

    art = deepfuse.compile(tiny_model, kv_cache_dtype="int8")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13], [42], [5, 5, 5, 5, 5]] * 2
    engine = lambda blocks, prefix=True: Engine(art, CacheConfig(block_size=4, num_blocks=blocks,
                                                                 enable_prefix_caching=prefix))
    big = engine(128)
    assert big.cache.layers[0].dtype == torch.int8
    want = [o.outputs[0].token_ids for o in big.generate(prompts, [greedy] * 8)]
    assert want == [big.generate([p], [greedy])[0].outputs[0].token_ids for p in prompts]
    small = engine(12, prefix=False)
    outs = small.generate(prompts, [greedy] * 8)
    assert [o.outputs[0].token_ids for o in outs] == want
    # the scheduler's documented policy on these sizes (tests/helpers.py): 4 preemptions
    must = scheduled_preemptions([len(p) for p in prompts], 12, block_size=4, num_blocks=12)
    assert [o.metrics.num_preemptions for o in outs] == must and small.scheduler.num_preemptions == sum(must) > 0
    prefix = [(7 * i) % 120 for i in range(40)]
    shared = [prefix + [100 + i, 3, 4] for i in range(4)]
    off, on = engine(128, prefix=False), engine(128)
    expect = [o.outputs[0].token_ids for o in off.generate(shared, [greedy] * 4)]
    assert [o.outputs[0].token_ids for o in on.generate(shared, [greedy] * 4)] == expect
    # the first request computes its 43 tokens; the other three find the 40-token prefix (10 blocks)
    assert on.stats.prompt_tokens_computed == 43 + 3 * 3
    assert on.kv.stats.prefix_hits == 3 * 40 and on.kv.usage()["prefix_hit_rate"] == pytest.approx(3 * 40 / (4 * 43), abs=1e-4)
