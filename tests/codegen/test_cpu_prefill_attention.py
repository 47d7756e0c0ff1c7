"""The native prefill attention (codegen/cpu/prefill_attention.cpp), on AMX tiles where the CPU
has them and on its AVX512-BF16 vector path, against a plain
per-row softmax in float64 over keys gathered through the block tables: several chunks in one
call (whole prompts, a chunk continuing a cached prefix, a single row), grouped-query heads,
head sizes 64 and 128, block sizes 8 to 32, a sliding window; and its errors."""
import pytest
import torch


@pytest.fixture(scope="module")
def kernel(native):
    if not native.paged_prefill_available():
        pytest.skip("no AVX512-BF16 (nor AMX) on this machine")
    return native


@pytest.fixture(params=[True, False], ids=["amx", "vector"])
def use_amx(request, kernel):
    if request.param and not kernel.amx_available():
        pytest.skip("no AMX tiles on this machine")
    return request.param


def reference(q, cache, tables, rows, qlens, lens, h, window, scale):
    out = torch.zeros(q.shape, dtype=torch.float64)
    bs, hkv, d = cache.shape[2], cache.shape[3], cache.shape[4]
    for c in range(len(rows)):
        length, n, r = int(lens[c]), int(qlens[c]), int(rows[c])
        kv = torch.cat([cache[:, b] for b in tables[c, : -(-length // bs)].tolist()], 1)[:, :length].double()
        for i in range(n):
            pos = length - n + i
            first = max(0, pos - window + 1) if window else 0
            qs = q[r + i].view(h, d).double()
            for head in range(h):
                k, v = kv[0, first:pos + 1, head // (h // hkv)], kv[1, first:pos + 1, head // (h // hkv)]
                out[r + i].view(h, d)[head] = torch.softmax(k @ qs[head] * scale, 0) @ v
    return out


def case(h, hkv, d, bs, seed=0):
    torch.manual_seed(seed)
    nb = 80
    cache = torch.randn(2, nb, bs, hkv, d).bfloat16()
    cache[0, 7] *= 20  # peaked softmaxes: the running max moves between key chunks
    lens = torch.tensor([1, 70, 130, 200])  # a one-token prompt, a whole prompt, two continued chunks
    qlens = torch.tensor([1, 70, 50, 3])
    rows = torch.tensor([2, 3, 73, 123])  # rows 0-1 and 126-127 belong to no chunk
    tables = torch.stack([torch.randperm(nb)[:40] for _ in lens])  # scattered blocks
    q = torch.randn(128, h * d).bfloat16()
    return q, cache, tables, rows, qlens, lens


@pytest.mark.parametrize("h,hkv,d,bs,window", [(9, 3, 64, 16, 0), (6, 2, 128, 8, 0), (4, 4, 64, 32, 37),
                                               (8, 1, 128, 16, 100), (4, 1, 256, 16, 0), (8, 2, 256, 8, 45)])
def test_paged_prefill_matches_a_plain_softmax(kernel, use_amx, h, hkv, d, bs, window):
    q, cache, tables, rows, qlens, lens = case(h, hkv, d, bs)
    out = torch.full_like(q, 7.0)
    kernel.paged_prefill(q, cache, tables, rows, qlens, lens, h, window, d ** -0.5, out, use_amx)
    want = reference(q, cache, tables, rows, qlens, lens, h, window, d ** -0.5)
    mine = torch.cat([torch.arange(int(r), int(r) + int(n)) for r, n in zip(rows, qlens)])
    torch.testing.assert_close(out[mine].double(), want[mine], atol=2e-2, rtol=2e-2)
    others = torch.tensor([0, 1, 126, 127])
    assert bool((out[others] == 7.0).all())  # rows of no chunk are left alone


def test_paged_prefill_rejects_bad_operands_with_clear_errors(kernel):
    q, cache, tables, rows, qlens, lens = case(4, 2, 64, 16)
    out = torch.empty_like(q)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernel.paged_prefill(q.float(), cache, tables, rows, qlens, lens, 4, 0, 0.125, out.float())
    with pytest.raises(RuntimeError, match="head size 64, 128 or 256"):
        kernel.paged_prefill(q, cache[..., :32].contiguous(), tables, rows, qlens, lens, 4, 0, 0.125, out)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_prefill(q, cache, tables, rows, qlens, torch.tensor([1, 70, 40, 200]), 4, 0, 0.125, out)
    bad = tables.clone()
    bad[1, 0] = 10_000
    with pytest.raises(RuntimeError, match="block id outside the cache"):
        kernel.paged_prefill(q, cache, bad, rows, qlens, lens, 4, 0, 0.125, out)


def test_smollm2_bf16_long_prompt_in_chunks_gives_sdpas_tokens(kernel, smollm2, monkeypatch):
    """A 1,500-token prompt prefilled in 256-token chunks (each continuing the cached prefix)
    through the native kernel, and through SDPA: the same greedy tokens and close logprobs."""
    import deepfuse
    from deepfuse.codegen.cpu import attention
    from deepfuse.runtime.engine import Engine, SamplingParams
    from deepfuse.runtime.kv_cache import CacheConfig

    model, tok = smollm2
    text = " ".join(f"Item {i}: the {w} is next to the {v}." for i, (w, v) in
                    enumerate(zip(["lamp", "chair", "river", "stone"] * 60, ["door", "tree", "cup", "hill"] * 60)))
    prompt = tok.encode(text)[:1500]
    art = deepfuse.compile(model, dtype="bf16", tokenizer=tok)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)

    def run():
        return Engine(art, CacheConfig(num_blocks=256), max_num_tokens=256).generate([prompt], [params])[0]

    calls = []
    real = attention.native_kernels

    class Counting:  # the native module, counting prefill launches
        def __getattr__(self, name):
            if name == "paged_prefill":
                calls.append(name)
            return getattr(real(), name)

    class NoPrefill:  # the native module as on a machine without the kernel: prefill chunks take SDPA
        def __getattr__(self, name):
            return getattr(real(), name)

        def paged_prefill_available(self):
            return False

    monkeypatch.setattr(attention, "native_kernels", lambda: Counting())
    native = run()
    assert len(calls) >= 6 * 30  # six chunks or more, 30 layers
    monkeypatch.setattr(attention, "native_kernels", lambda: NoPrefill())
    sdpa = run()
    assert native.outputs[0].token_ids == sdpa.outputs[0].token_ids
    for a, b in zip(native.outputs[0].logprobs, sdpa.outputs[0].logprobs):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 0.1 for t in a)
