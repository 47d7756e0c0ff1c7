"""Every CPU kernel against the op's reference on ragged batches, partial blocks, GQA, windows."""
import math

import pytest
import torch

from deepfuse.codegen.cpu.kernels import FACTORIES, make_kernel
from deepfuse.ir import OPS
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("h,hkv", [(4, 4), (6, 2), (4, 1)])
def test_attention_kernel(window, h, hkv, sinks):
    torch.manual_seed(0)
    hd = 16
    attrs = dict(num_heads=h, num_kv_heads=hkv, head_dim=hd, scale=1 / math.sqrt(hd), window=window,
                 **({"sinks": True} if sinks else {}))
    sink = [torch.randn(h) * 2] if sinks else []
    cache = KVCache(1, hkv, hd, torch.float32, CacheConfig(block_size=4, num_blocks=64))
    cache2 = KVCache(1, hkv, hd, torch.float32, CacheConfig(block_size=4, num_blocks=64))
    blocks, blocks2 = [[], [], [], []], [[], [], [], []]
    # step 1: prompts of ragged lengths; step 2: decode one token each; step 3: mixed; step 4: short
    # chunks continuing cached sequences (speculative verification), grouped with padding, and a decode
    for step in ([(0, 7), (0, 3), (0, 9), (0, 2)], [(7, 1), (3, 1), (9, 1), (2, 1)], [(8, 1), (4, 5), (10, 1), (3, 2)],
                 [(9, 4), (9, 3), (11, 1), (5, 6)]):
        chunks = [SeqChunk([1] * n, start, blocks[s]) for s, (start, n) in enumerate(step)]
        chunks2 = [SeqChunk([1] * n, start, blocks2[s]) for s, (start, n) in enumerate(step)]
        inp, inp2 = build_step(chunks, cache), build_step(chunks2, cache2)
        T = inp["tokens"].shape[0]
        q, k, v = torch.randn(T, h * hd), torch.randn(T, hkv * hd), torch.randn(T, hkv * hd)

        def args(i, q=q, k=k, v=v):
            return (q, k, v, i["kv_cache.0"], i["slot_mapping"], i["block_tables"], i["seq_lens"], i["query_lens"],
                    *sink)

        want = OPS["attention"].reference(*args(inp), **attrs)
        got = make_kernel("attention", attrs)(*args(inp2))
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(cache2.layers[0], cache.layers[0])


def test_elementwise_kernels():
    """(The projections, linear and logits, are F.linear unpacked and native GEMMs prepacked:
    test_cpu_projections_float64.py checks every path against float64.)"""
    torch.manual_seed(0)
    x, w = torch.randn(5, 32), torch.randn(24, 32)
    pos = torch.tensor([0, 3, 4, 9, 500])
    cases = [
        ("embedding", (w, torch.tensor([3, 0, 23])), {}),
        ("add", (x, x * 2), {}),
        ("split", (x,), {"sizes": [8, 24], "axis": -1}),
        ("swiglu", (x,), {}),
        ("rms_norm", (x, torch.randn(32)), {"eps": 1e-5}),
        ("rms_norm", (x.bfloat16(), torch.randn(32).bfloat16()), {"eps": 1e-5}),
        ("rope", (x, pos), {"head_dim": 16, "theta": 10000.0}),
        ("rope", (x[:, :16], pos), {"head_dim": 8, "theta": 500000.0}),
    ]
    for op, args, attrs in cases:
        want = OPS[op].reference(*args, **attrs)
        got = make_kernel(op, attrs)(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
            tol = 2e-2 if a.dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"{op} {attrs}")
    assert set(FACTORIES) >= {"linear", "rope", "attention", "rms_norm", "swiglu", "sample", "logits"}


def test_sample_kernel_matches_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    args = (torch.tensor([0.0, 0.7, 1.0, 0.0]), torch.tensor([0, 5, 0, 0]), torch.tensor([1.0, 1.0, 0.9, 1.0]),
            torch.tensor([11, 12, 13, 14]))
    assert torch.equal(make_kernel("sample", {})(logits, *args), OPS["sample"].reference(logits, *args))
