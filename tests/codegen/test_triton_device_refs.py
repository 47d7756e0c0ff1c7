"""codegen/triton/device_refs.py: the paged attention a Triton launch without a kernel runs on the
device gives the IR reference's result (ragged prefill, drafts, decode; sliding window; sinks;
int8 cache; chunks of queries) without reading a value back."""
import pytest
import torch

from deepfuse.codegen.triton import device_refs
from deepfuse.ir import OPS
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache
from tests.sync_trap import HostWait, no_host_waits

H, HKV, HD = 4, 2, 24


def step(dtype: torch.dtype):
    row = HD + 4 if dtype == torch.int8 else HD
    cache = KVCache(1, HKV, row, dtype, CacheConfig(16, 8))
    gen = torch.Generator().manual_seed(0)
    if dtype == torch.int8:  # random int8 rows with positive f32 scales in their last 4 bytes
        layer = cache.layers[0]
        layer[..., :HD] = torch.randint(-100, 100, layer[..., :HD].shape, generator=gen, dtype=torch.int8)
        layer[..., HD:] = (torch.rand(layer.shape[:-1] + (1,), generator=gen) * 0.02 + 0.01).view(torch.int8)
    else:
        cache.layers[0].copy_(torch.randn(cache.layers[0].shape, generator=gen))
    inputs = build_step([SeqChunk(list(range(5, 25)), 0, [0, 1], samples=4), SeqChunk([9, 2], 0, [3]),
                         SeqChunk([7], 17, [4, 5])], cache)
    t = inputs["tokens"].shape[0]
    q, k, v = (torch.randn(t, n * HD, generator=gen) for n in (H, HKV, HKV))
    return [q, k, v, cache.layers[0], *(inputs[n] for n in ("slot_mapping", "block_tables", "seq_lens", "query_lens"))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("window,sinks", [(0, False), (8, False), (0, True)])
def test_device_attention_is_the_reference_without_host_reads(monkeypatch, dtype, window, sinks):
    monkeypatch.setattr(device_refs, "CHUNK_ELEMENTS", 3 * 2 * 2 * 16 * HKV * (HD + 4))  # chunks of 3 queries
    attrs = dict(num_heads=H, num_kv_heads=HKV, head_dim=HD, scale=HD ** -0.5, window=window, sinks=sinks)
    extra = [torch.randn(H)] if sinks else []
    a, b = step(dtype), step(dtype)
    want = OPS["attention"].reference(*a, *extra, **attrs)
    with no_host_waits():
        got = device_refs.attention(*b, *extra, **attrs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(a[3], b[3])  # the same k/v written
    with no_host_waits(), pytest.raises(HostWait, match="tolist"):  # what the IR reference would do on a device
        OPS["attention"].reference(*a, *extra, **attrs)
