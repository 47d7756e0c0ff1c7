"""The native paged decode kernel (codegen/cpu/paged_decode.cpp) against a plain
gather-and-softmax in float64: ragged lengths across block edges, grouped-query heads,
a sliding window, f32 and bf16; and the whole CPU step with and without it."""
import pytest
import torch

from deepfuse.codegen.cpu.native import kernels as native_kernels


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


@pytest.mark.parametrize("dtype,window", [(torch.float32, 0), (torch.float32, 21), (torch.bfloat16, 0)])
def test_paged_decode_matches_a_plain_softmax(dtype, window):
    native = native_kernels()
    if native is None:
        pytest.skip("no C++ compiler here")
    torch.manual_seed(0)
    h, hkv, d, bs, nb = 6, 2, 64, 16, 40
    cache = torch.randn(2, nb, bs, hkv, d).to(dtype)
    lens = torch.tensor([1, 16, 17, 40, 95, 33])
    tables = torch.stack([torch.randperm(nb)[:8] for _ in lens])  # scattered blocks
    q = torch.randn(len(lens), h * d).to(dtype)
    out = torch.empty_like(q)
    native.paged_decode(q, cache, tables, lens, h, window, d ** -0.5, out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), reference(q, cache, tables, lens, h, window, d ** -0.5), atol=tol, rtol=tol)
    with pytest.raises(RuntimeError, match="share a dtype"):
        native.paged_decode(q.float() if dtype != torch.float32 else q.double(), cache, tables, lens, h, window, 1.0,
                            out)


def test_cpu_step_is_the_same_with_and_without_the_native_kernel(tiny_model, monkeypatch):
    """A mixed step (prefill chunk, decodes, a verify chunk) through the compiled CPU step,
    with the native kernels (decode attention, f32 panel GEMMs) and with the torch ops they
    replace."""
    import deepfuse
    from deepfuse.codegen.cpu import attention, kernels
    from deepfuse.runtime.engine import Engine, SamplingParams

    if native_kernels() is None:
        pytest.skip("no C++ compiler here")
    art = deepfuse.compile(tiny_model)
    prompts = [[5, 17, 99, 3, 42, 7, 7, 8] * 5, [9, 2, 64], [100, 3, 3, 3, 3, 3, 3, 3, 3, 3]]
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=2)] * 3
    native = Engine(art).generate(prompts, params)
    monkeypatch.setattr(attention, "native_kernels", lambda: None)
    monkeypatch.setattr(kernels, "native_kernels", lambda: None)
    plain = Engine(deepfuse.compile(tiny_model)).generate(prompts, params)
    assert [o.token_ids for o in native] == [o.token_ids for o in plain]
    for a, b in zip(native, plain):
        for la, lb in zip(a.logprobs, b.logprobs):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)
