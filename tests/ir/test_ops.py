"""Reference ops against independent formulations (dense attention, HF rotary)."""
import math

import pytest
import torch
import torch.nn.functional as F

from deepfuse.ir import OPS
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache


def dense_attention(q, k, v, h, hkv, hd, window=0):
    """Plain causal attention over one full sequence, [L, H*hd]."""
    L = q.shape[0]
    qh = q.view(L, h, hd).transpose(0, 1)
    kh = k.view(L, hkv, hd).transpose(0, 1).repeat_interleave(h // hkv, 0)
    vh = v.view(L, hkv, hd).transpose(0, 1).repeat_interleave(h // hkv, 0)
    i = torch.arange(L)
    mask = i[None, :] <= i[:, None]
    if window:
        mask &= i[None, :] > i[:, None] - window
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask).transpose(0, 1).reshape(L, h * hd)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_paged_attention_matches_dense_over_chunks(window, block_size):
    """Prefill in ragged chunks of two sequences through the paged op == dense attention."""
    torch.manual_seed(0)
    h, hkv, hd = 4, 2, 8
    lens = [11, 7]
    qkv = [(torch.randn(n, h * hd), torch.randn(n, hkv * hd), torch.randn(n, hkv * hd)) for n in lens]
    cache = KVCache(1, hkv, hd, torch.float32, CacheConfig(block_size=block_size, num_blocks=64))
    blocks = [[], []]
    outs = [torch.zeros(n, h * hd) for n in lens]
    for lo, hi in [(0, 3), (3, 4), (4, 11)]:  # chunks; sequence 1 runs out after 7
        chunks, rows = [], []
        for s in range(2):
            if lo < lens[s]:
                e = min(hi, lens[s])
                chunks.append((s, SeqChunk(list(range(lo, e)), lo, blocks[s])))
                rows.append((s, lo, e))
        inp = build_step([c for _, c in chunks], cache)
        q = torch.cat([qkv[s][0][a:b] for s, a, b in rows])
        k = torch.cat([qkv[s][1][a:b] for s, a, b in rows])
        v = torch.cat([qkv[s][2][a:b] for s, a, b in rows])
        o = OPS["attention"].reference(q, k, v, inp["kv_cache.0"], inp["slot_mapping"], inp["block_tables"],
                                       inp["seq_lens"], inp["query_lens"], num_heads=h, num_kv_heads=hkv,
                                       head_dim=hd, scale=1 / math.sqrt(hd), window=window)
        r = 0
        for s, a, b in rows:
            outs[s][a:b] = o[r:r + b - a]
            r += b - a
    for s in range(2):
        want = dense_attention(*qkv[s], h, hkv, hd, window)
        torch.testing.assert_close(outs[s], want, atol=1e-5, rtol=1e-5)


def test_rope_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half  # noqa: F401

    torch.manual_seed(0)
    hd, h, T = 16, 3, 6
    x = torch.randn(T, h * hd)
    pos = torch.tensor([0, 1, 2, 7, 8, 100])
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    emb = torch.cat([pos[:, None].float() * inv] * 2, -1)
    xh = x.view(T, h, hd).transpose(0, 1)[None]
    want, _ = apply_rotary_pos_emb(xh, xh, emb.cos()[None], emb.sin()[None])
    got = OPS["rope"].reference(x, pos, head_dim=hd, theta=10000.0)
    torch.testing.assert_close(got, want[0].transpose(0, 1).reshape(T, -1))


def test_sample_greedy_and_seeded():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    ref = OPS["sample"].reference
    t0 = torch.zeros(3)
    args = (torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.tensor([1, 2, 3]))
    assert torch.equal(ref(logits, t0, *args), logits.argmax(-1))
    t1 = torch.ones(3)
    a, b = ref(logits, t1, *args), ref(logits, t1, *args)
    assert torch.equal(a, b)
    # the row's draw depends on its own seed only, not on its neighbours
    solo = ref(logits[1:2], t1[:1], args[0][:1], args[1][:1], args[2][1:2])
    assert solo[0] == a[1]
