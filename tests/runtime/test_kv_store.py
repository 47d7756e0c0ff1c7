"""The disk tier of the prefix cache (runtime/kv_store.py): blocks survive eviction and a
restart, come back with the tokens a cold run gives, and a corrupt, truncated, foreign or
unwritable store is detected and worked around, never read into the cache."""
import dataclasses
import os
import warnings

import pytest

import deepfuse
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PREFIX = [(13 * i) % 120 + 3 for i in range(40)]  # 10 blocks of 4


@pytest.fixture(scope="module")
def art(tiny_model):
    return deepfuse.compile(tiny_model)


def engine(art, store, num_blocks=64, **kw):
    return Engine(art, CacheConfig(block_size=4, num_blocks=num_blocks, kv_store=str(store), **kw), max_num_tokens=16)


def cold(art, prompts):
    eng = Engine(art, CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False), max_num_tokens=16)
    return [o.outputs[0].token_ids for o in eng.generate(prompts, [GREEDY] * len(prompts))]


def files(store) -> list[str]:
    return sorted(f for f in os.listdir(store) if f.endswith(".kv"))


def test_blocks_survive_a_restart(art, tmp_path):
    """A new engine (a new process would see the same files) finds the prefix on disk: its
    prefill computes only the new tokens, with the tokens of a cold run."""
    prompts = [PREFIX + [7, 8], PREFIX + [9, 10, 11]]
    want = cold(art, prompts)
    first = engine(art, tmp_path)
    assert first.generate(prompts[:1], [GREEDY])[0].outputs[0].token_ids == want[0]
    first.kv.store.flush()
    assert len(files(tmp_path)) >= 10
    again = engine(art, tmp_path)
    out = again.generate(prompts[1:], [GREEDY])[0]
    assert out.outputs[0].token_ids == want[1] and out.num_cached_tokens == 40
    assert again.kv.stats.store_blocks == 10 and again.stats.prompt_tokens_computed == 3


def test_evicted_blocks_come_back_from_disk(art, tmp_path):
    """A cache of 14 blocks: an unrelated request evicts the prefix's blocks; the next request
    sharing the prefix loads them instead of recomputing."""
    prompts = [PREFIX + [7, 8], [(5 * i) % 100 + 1 for i in range(48)], PREFIX + [9, 9]]
    want = cold(art, prompts)
    eng = engine(art, tmp_path, num_blocks=14)
    got = []
    for p in prompts:
        got.append(eng.generate([p], [GREEDY])[0])
        eng.kv.store.flush()  # the writer thread has caught up: what a later request can find is on disk
    assert [o.outputs[0].token_ids for o in got] == want
    assert eng.kv.pool.evictions > 0 and got[2].num_cached_tokens == 40 and eng.kv.stats.store_blocks >= 1


def test_corrupt_and_truncated_blocks_are_dropped_and_recomputed(art, tmp_path):
    prompts = [PREFIX + [7, 8], PREFIX + [9, 10, 11]]
    want = cold(art, prompts)
    first = engine(art, tmp_path)
    first.generate(prompts[:1], [GREEDY])
    first.kv.store.flush()
    from deepfuse.runtime.kv_cache import block_hash

    names, parent = [], b""
    for i in range(10):
        parent = block_hash(parent, PREFIX[4 * i:4 * i + 4])
        names.append(parent)
    flipped, cut = tmp_path / (names[6].hex() + ".kv"), tmp_path / (names[8].hex() + ".kv")
    original = flipped.read_bytes()
    raw = bytearray(original)
    raw[-5] ^= 0x40  # one bit of the payload
    flipped.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:100])
    again = engine(art, tmp_path)
    out = again.generate(prompts[1:], [GREEDY])[0]
    assert out.outputs[0].token_ids == want[1] and out.num_cached_tokens == 24  # blocks 0..5; 6 failed its checksum
    assert again.kv.store.dropped_corrupt == 1
    again.kv.store.flush()  # the recomputed blocks were written again, as they were before the flip
    assert flipped.read_bytes() == original
    third = engine(art, tmp_path)  # the truncated one too, once found: dropped, then rewritten
    assert third.generate(prompts[1:], [GREEDY])[0].outputs[0].token_ids == want[1]


def test_a_store_of_another_model_is_refused_and_left_alone(art, tiny_model, tmp_path):
    first = engine(art, tmp_path)
    first.generate([PREFIX + [7, 8]], [GREEDY])
    first.kv.store.flush()
    before = {f: (tmp_path / f).read_bytes() for f in files(tmp_path)}
    weights = {k: v + 0.01 if k.endswith("norm.weight") else v for k, v in tiny_model.weights.items()}
    other = deepfuse.compile(type(tiny_model)(tiny_model.config, weights))
    with pytest.warns(UserWarning, match="another model"):
        eng = engine(other, tmp_path)
    out = eng.generate([PREFIX + [9, 10, 11]], [GREEDY])[0]
    assert out.num_cached_tokens == 0 and eng.kv.store is None
    assert out.outputs[0].token_ids == cold(other, [PREFIX + [9, 10, 11]])[0]
    assert {f: (tmp_path / f).read_bytes() for f in files(tmp_path)} == before
    with pytest.warns(UserWarning, match="another model"):  # a different block size is another layout
        Engine(art, CacheConfig(block_size=8, num_blocks=64, kv_store=str(tmp_path)))


def test_a_full_disk_loses_nothing_but_the_disk_copy(art, tmp_path, monkeypatch):
    """Every write fails (ENOSPC): the engine runs on, from memory, and leaves no partial file."""
    import errno

    from deepfuse.runtime import kv_store

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    eng = engine(art, tmp_path)
    monkeypatch.setattr(kv_store.os, "replace", full)
    prompts = [PREFIX + [7, 8], PREFIX + [9, 10, 11]]
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        got = [eng.generate([p], [GREEDY])[0] for p in prompts]
        eng.kv.store.flush()
    assert [o.outputs[0].token_ids for o in got] == cold(art, prompts) and got[1].num_cached_tokens == 40
    assert eng.kv.store.write_errors >= 10 and files(tmp_path) == []
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_the_store_keeps_within_its_size(art, tmp_path):
    """A cap of about four blocks: the oldest files go first."""
    eng = engine(art, tmp_path, kv_store_gb=1.0)
    block = sum(layer[:, 0].numel() * layer.element_size() for layer in eng.cache.layers) + 64
    eng.kv.store.max_bytes = 4 * block
    eng.generate([PREFIX + [7, 8]], [GREEDY])
    eng.kv.store.flush()
    assert len(files(tmp_path)) == 4 and eng.kv.store.bytes <= 4 * block
    assert sum(os.path.getsize(tmp_path / f) for f in files(tmp_path)) == eng.kv.store.bytes


def test_a_hybrid_model_replays_over_blocks_from_the_store(tmp_path):
    """The YOCO-style hybrid model with bounded replay: after a restart only the full-attention
    blocks come from disk, the sliding window is replayed, and the tokens are a cold run's."""
    from deepfuse.models import Yoco, YocoConfig
    from tests.runtime.test_hybrid_cache import CONFIG, random_weights

    config = YocoConfig(**{f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(CONFIG) if f.name != "family"})
    art = deepfuse.compile(Yoco(config, random_weights(Yoco, config, seed=3)))
    prefix = [t % 90 + 1 for t in PREFIX]  # the hybrid model's vocabulary is 96
    prompts = [prefix + [7, 8], prefix + [9, 10, 11]]
    want = cold(art, prompts)
    make = lambda: Engine(art, CacheConfig(block_size=4, num_blocks=64, kv_store=str(tmp_path), swa_replay_tokens=8),
                          max_num_tokens=16)
    first = make()
    assert first.generate(prompts[:1], [GREEDY])[0].outputs[0].token_ids == want[0]
    first.kv.store.flush()
    again = make()
    out = again.generate(prompts[1:], [GREEDY])[0]
    assert out.outputs[0].token_ids == want[1] and out.num_cached_tokens == 40 - 8
    assert again.kv.stats.store_blocks == 10 and again.kv.stats.replay_hits == 1
