"""The native paged decode kernel (codegen/cpu/paged_decode.cpp, and its AMX path in
decode_amx.cpp) against a plain gather-and-softmax in float64: ragged lengths across block
edges, grouped-query heads, a sliding window, f32 and bf16; and the whole CPU step with and
without it."""
import pytest
import torch

from deepfuse.ir.opdefs_llm import dequantize_kv_rows, quantize_kv_rows


def reference(q, cache, tables, lens, h, window, scale):
    n, hkv, d = q.shape[0], cache.shape[3], cache.shape[4]
    g, out = h // hkv, torch.zeros(n, h, d, dtype=torch.float64)
    for s in range(n):
        length = int(lens[s])
        rows = torch.cat([cache[:, b] for b in tables[s, : -(-length // cache.shape[2])].tolist()], 1)[:, :length]
        first = max(0, length - window) if window else 0
        k, v = rows[0, first:].double(), rows[1, first:].double()  # [L,Hkv,D]
        qs = q[s].view(h, d).double()
        for head in range(h):
            w = torch.softmax(k[:, head // g] @ qs[head] * scale, 0)
            out[s, head] = w @ v[:, head // g]
    return out.view(n, h * d)


# the vector kernel (AVX-512: head size 64, 128 or 256, 1 to 8 query heads per kv head, any block size)
# and the plain one (head size 48, 9 heads per kv head) on the same cases; amx_rows=1 sends bf16
# rows to the AMX path where it applies (head size 64/128, blocks of a multiple of 16)
@pytest.mark.parametrize("amx_rows", [0, 1])
@pytest.mark.parametrize("dtype,window,h,hkv,d,bs", [
    (torch.float32, 0, 6, 2, 64, 16), (torch.float32, 21, 6, 2, 64, 16), (torch.bfloat16, 0, 6, 2, 64, 16),
    (torch.bfloat16, 37, 8, 1, 128, 32), (torch.float32, 0, 4, 4, 128, 8), (torch.bfloat16, 0, 9, 1, 48, 16),
    (torch.float32, 5, 18, 2, 48, 8), (torch.bfloat16, 0, 4, 1, 256, 16), (torch.float32, 9, 8, 2, 256, 8)])
def test_paged_decode_matches_a_plain_softmax(native, dtype, window, h, hkv, d, bs, amx_rows):
    torch.manual_seed(0)
    nb = 40
    cache = torch.randn(2, nb, bs, hkv, d).to(dtype)
    lens = torch.tensor([1, 16, 17, 40, 95, 33, 128])
    tables = torch.stack([torch.randperm(nb)[:16] for _ in lens])  # scattered blocks
    cache[:, 3] *= 30  # peaked softmaxes: the running max moves between tiles
    q = torch.randn(len(lens), h * d).to(dtype)
    out = torch.empty_like(q)
    native.paged_decode(q, cache, tables, lens, h, window, d ** -0.5, out, amx_rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens, h, window, d ** -0.5), atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.paged_decode(q.float() if dtype != torch.float32 else q.double(), cache, tables, lens, h, window, 1.0,
                            out)


@pytest.mark.parametrize("dtype,d,amx_rows", [(torch.bfloat16, 64, 0), (torch.bfloat16, 64, 1), (torch.bfloat16, 128, 1),
                                              (torch.float32, 128, 0), (torch.bfloat16, 256, 0)])
def test_paged_decode_carries_the_softmax_across_segments(native, dtype, d, amx_rows):
    """Sequences longer than the kernel's 512-position segment: the running max and sum pass
    from segment to segment (the peak in a late segment, in an early one, and in a window
    that starts mid-block)."""
    torch.manual_seed(1)
    nb, bs, h, hkv = 96, 16, 6, 2
    cache = torch.randn(2, nb, bs, hkv, d).to(dtype)
    cache[0, 70] *= 25  # keys that dominate wherever they fall
    cache[0, 5] *= 25
    tables = torch.stack([torch.randperm(nb)[:80] for _ in range(4)])
    tables[0, 60], tables[1, 2] = 70, 5  # a late peak, an early peak
    lens = torch.tensor([1100, 1279, 513, 700])
    q = torch.randn(4, h * d).to(dtype)
    for window in (0, 600):
        out = torch.empty_like(q)
        native.paged_decode(q, cache, tables, lens, h, window, d ** -0.5, out, amx_rows)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), reference(q, cache, tables, lens, h, window, d ** -0.5), atol=tol,
                                   rtol=tol)


@pytest.mark.parametrize("h,hkv,d,window", [(9, 3, 64, 0), (9, 3, 64, 100), (8, 2, 128, 0), (16, 1, 64, 37)])
def test_amx_spans_match_the_reference_and_each_row_alone(native, h, hkv, d, window):
    """Rows of one sequence (a verify or prompt chunk) run together on the AMX path, up to 16
    query vectors at a time: each row's result is the reference's, and bit-identical to the
    row run alone (batch invariance rests on it), whatever shares the call; with amx_rows=2 a
    lone row takes the vector path and the chunks AMX."""
    if not native.amx_available():
        pytest.skip("no AMX on this machine")
    torch.manual_seed(2)
    nb, bs = 200, 16
    cache = torch.randn(2, nb, bs, hkv, d).bfloat16()
    cache[0, 7] *= 20  # a peak wherever block 7 falls
    chunk, other = torch.randperm(nb)[:60], torch.randperm(nb)[:60]
    shared = other.clone()
    shared[40:] = torch.randperm(nb)[:20]  # same first 40 blocks (a shared prefix), then its own
    lens = torch.tensor([600, 601, 602, 603, 604, 605, 606, 17, 250, 251, 252, 253, 700])
    tables = torch.stack([chunk] * 7 + [torch.randperm(nb)[:60]] + [other] * 4 + [shared])
    q = torch.randn(len(lens), h * d).bfloat16()
    together = torch.empty_like(q)
    native.paged_decode(q, cache, tables, lens, h, window, d ** -0.5, together, 1)
    torch.testing.assert_close(together.double(), reference(q, cache, tables, lens, h, window, d ** -0.5), atol=2e-2,
                               rtol=2e-2)
    for i in range(len(lens)):
        alone = torch.empty_like(q[i:i + 1])
        native.paged_decode(q[i:i + 1], cache, tables[i:i + 1], lens[i:i + 1], h, window, d ** -0.5, alone, 1)
        assert torch.equal(alone[0], together[i]), i
    mixed = torch.empty_like(q)
    native.paged_decode(q, cache, tables, lens, h, window, d ** -0.5, mixed, 2)
    if h // hkv <= 8:  # spans hold 16 query vectors: 16 heads per kv head leave every row alone
        assert torch.equal(mixed[:7], together[:7]) and torch.equal(mixed[8:12], together[8:12])
    torch.testing.assert_close(mixed.double(), reference(q, cache, tables, lens, h, window, d ** -0.5), atol=2e-2,
                               rtol=2e-2)


def test_cpu_step_is_the_same_with_and_without_the_native_kernel(native, tiny_model, monkeypatch):
    """A mixed step (prefill chunk, decodes, a verify chunk) through the compiled CPU step,
    with the native kernels (decode attention, f32 panel GEMMs) and with the torch ops they
    replace."""
    import deepfuse
    from deepfuse.codegen.cpu import attention, packed_weights, row_kernels
    from deepfuse.runtime.engine import Engine, SamplingParams

    art = deepfuse.compile(tiny_model)
    prompts = [[5, 17, 99, 3, 42, 7, 7, 8] * 5, [9, 2, 64], [100, 3, 3, 3, 3, 3, 3, 3, 3, 3]]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2)] * 3
    with_native = Engine(art).generate(prompts, params)
    monkeypatch.setattr(attention, "native_kernels", lambda: None)
    monkeypatch.setattr(packed_weights, "native_kernels", lambda: None)  # the panel GEMMs'
    monkeypatch.setattr(row_kernels, "native_kernels", lambda: None)  # the norms'
    plain = Engine(deepfuse.compile(tiny_model)).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in with_native] == [o.outputs[0].token_ids for o in plain]
    for a, b in zip(with_native, plain):
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t].logprob - lb[t].logprob) < 1e-4 for t in la)


@pytest.mark.parametrize("dtype,window,d", [(torch.float32, 0, 32), (torch.float32, 7, 32), (torch.bfloat16, 0, 32),
                                            (torch.bfloat16, 0, 64), (torch.bfloat16, 9, 64)])
def test_attention_kernel_rows_of_verify_chunks_match_the_reference(native, dtype, window, d, monkeypatch):
    """A step of decodes, verify-sized chunks (2..16 tokens continuing a cached sequence), a
    continued prefill and a whole prompt: the CPU attention kernel with the native kernels (the
    decode kernel takes every decode and verify row; with AMX, bf16 and head size 64, the
    prefill kernel the rest), without them (SDPA), and the IR's reference agree."""
    from deepfuse.codegen.cpu import attention as cpu_attention
    from deepfuse.codegen.cpu.kernels import FACTORIES
    from deepfuse.ir.opdefs_llm import attention as reference_attention

    torch.manual_seed(1)
    h, hkv, bs, nb = 4, 2, 8, 64
    query_lens = torch.tensor([1, 4, 1, 30, 6, 12, 16, 2])
    seq_lens = torch.tensor([9, 21, 40, 47, 6, 12, 50, 3])  # 6 and 12: chunks that are the whole sequence
    tables = torch.randperm(nb)[: 8 * len(query_lens)].view(-1, 8)  # scattered, no block shared
    t = int(query_lens.sum())
    q, k, v = (torch.randn(t, n * d).to(dtype) for n in (h, hkv, hkv))
    slots = []
    for s, (n, length) in enumerate(zip(query_lens.tolist(), seq_lens.tolist())):
        slots += [int(tables[s, p // bs]) * bs + p % bs for p in range(length - n, length)]
    slots = torch.tensor(slots)
    attrs = dict(num_heads=h, num_kv_heads=hkv, head_dim=d, scale=d ** -0.5, window=window)
    cache = torch.randn(2, nb, bs, hkv, d).to(dtype)
    want = reference_attention(q, k, v, cache.clone(), slots, tables, seq_lens, query_lens, **attrs)
    with_native = FACTORIES["attention"](attrs)(q, k, v, cache.clone(), slots, tables, seq_lens.clone(), query_lens)
    monkeypatch.setattr(cpu_attention, "native_kernels", lambda: None)
    plain = FACTORIES["attention"](attrs)(q, k, v, cache.clone(), slots, tables, seq_lens.clone(), query_lens)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(with_native.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(plain.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_type,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.int8, torch.bfloat16), (torch.int8, torch.float32)])
@pytest.mark.parametrize("h,hkv,d,window", [(9, 3, 64, 0), (16, 4, 64, 45), (16, 2, 128, 0), (32, 4, 64, 0)])
def test_many_rows_share_work_items_and_each_row_is_what_it_is_alone(native, cache_type, q_dtype, h, hkv, d, window):
    """With rows enough for every thread, a work item covers all of a row's kv heads (32 heads on
    4 kv heads: two items of 2 kv heads each, 16 query heads at most); alone, a row's kv heads are
    items of their own. Each row matches the reference and, batch-invariant (its positions never
    split), is bit-identical to the row run alone."""
    torch.manual_seed(2)
    nb, bs = 200, 16
    n = 8 * torch.get_num_threads() + 3
    floats = torch.randn(2, nb, bs, hkv, d)
    floats[:, 7] *= 30  # peaked softmaxes
    cache = quantize_kv_rows(floats) if cache_type == torch.int8 else floats.to(cache_type)
    lens = torch.randint(1, 700, (n,))
    tables = torch.stack([torch.randperm(nb)[:44] for _ in range(n)])
    q = torch.randn(n, h * d).to(q_dtype)
    out = torch.empty_like(q)
    native.paged_decode(q, cache, tables, lens, h, window, d ** -0.5, out, 0, True)
    plain = dequantize_kv_rows(cache) if cache_type == torch.int8 else cache
    want = reference(q, plain, tables, lens, h, window, d ** -0.5)
    tol = (1e-5 if q_dtype == torch.float32 else 2e-2) * float(want.abs().max())  # values up to ~100 here
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=0)
    for s in range(0, n, 5):
        alone = torch.empty_like(q[s:s + 1])
        native.paged_decode(q[s:s + 1], cache, tables[s:s + 1], lens[s:s + 1], h, window, d ** -0.5, alone, 0, True)
        assert torch.equal(alone, out[s:s + 1]), s


@pytest.fixture
def four_threads():
    """Four threads for the test (kernels split work as on a 4-core machine, whatever this one has)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield 4
    torch.set_num_threads(before)


@pytest.mark.parametrize("cache_type,q_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                (torch.int8, torch.bfloat16), (torch.int8, torch.float32)])
@pytest.mark.parametrize("h,hkv,d,window", [(9, 3, 64, 0), (8, 1, 128, 0), (8, 1, 128, 200), (4, 1, 256, 300),
                                            (6, 2, 64, 1000)])
def test_few_rows_split_their_positions_across_threads_and_match_the_reference(native, four_threads, cache_type,
                                                                              q_dtype, h, hkv, d, window):
    """Work items that do not share out over the threads (a lone row on four threads: 1-3 kv
    heads): each bf16 row's positions are cut into spans of whole blocks, one work item each, and
    the thread that finishes a row's last span merges them. Rows too short to split, windows that
    start mid-block, a peak in a late span and one in an early span, a pair of rows one of which
    leaves its later spans empty (1,100 and 1 position): every row matches the reference, alone or
    in a pair, split or batch-invariant (never split). f32 rows never split (an f32 build's verify
    rows compute what its one-row steps compute): their two results are the same bits."""
    torch.manual_seed(3)
    nb, bs = 160, 16
    floats = torch.randn(2, nb, bs, hkv, d)
    floats[0, 70] *= 25  # keys that dominate wherever they fall
    floats[0, 5] *= 25
    cache = quantize_kv_rows(floats) if cache_type == torch.int8 else floats.to(cache_type)
    plain = dequantize_kv_rows(cache) if cache_type == torch.int8 else cache
    lens = torch.tensor([1100, 1279, 257, 255, 17, 700, 1])
    tables = torch.stack([torch.randperm(nb)[:80] for _ in lens])
    tables[0, 60], tables[1, 2] = 70, 5  # a late peak, an early peak
    q = torch.randn(len(lens), h * d).to(q_dtype)
    want = reference(q, plain, tables, lens, h, window, d ** -0.5)
    tol = (1e-5 if q_dtype == torch.float32 else 2e-2) * float(want.abs().max())
    outs = {}
    for invariant in (False, True):
        outs[invariant] = torch.empty_like(q)
        for s in range(len(lens)):
            alone = outs[invariant][s:s + 1]
            native.paged_decode(q[s:s + 1], cache, tables[s:s + 1], lens[s:s + 1], h, window, d ** -0.5, alone, 0,
                                invariant)
            torch.testing.assert_close(alone.double(), want[s:s + 1], atol=tol, rtol=0)
        for pair_rows in ([0, 1], [0, 6]):
            pair = torch.empty_like(q[pair_rows])
            native.paged_decode(q[pair_rows], cache, tables[pair_rows], lens[pair_rows], h, window, d ** -0.5, pair,
                                0, invariant)
            torch.testing.assert_close(pair.double(), want[pair_rows], atol=tol, rtol=0)
    if q_dtype == torch.float32:
        assert torch.equal(outs[False], outs[True])
