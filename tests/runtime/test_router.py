"""PrefixRouter's choices, without processes: longest cached prefix first, load otherwise,
round-robin as the baseline; reports ordered by their sequence numbers; dead replicas skipped."""
import pytest
import torch

from deepfuse.errors import DeepfuseError
from deepfuse.runtime.block_pool import block_hash
from deepfuse.runtime.kv_cache import CacheConfig, KVCache, KVCacheManager
from deepfuse.runtime.router import PrefixRouter, prompt_block_names

A = list(range(1, 81))  # 5 blocks of 16
B = list(range(200, 280))


def test_block_names_are_the_cache_managers():
    cache = KVCache(1, 1, 4, torch.float32, CacheConfig(block_size=16, num_blocks=16))
    kv = KVCacheManager(cache)
    prompt = A + [7, 8, 9]
    seq = kv.match_prefix(prompt)
    kv.allocate(seq, prompt, len(prompt))
    kv.commit()
    names = prompt_block_names(prompt, 16)
    assert len(names) == 5 and set(names) == set(kv.pool.by_name)
    assert kv.match_prefix(prompt).cached == 5 * 16  # the cache finds exactly these names again
    assert names[1] == block_hash(block_hash(b"", A[:16]), A[16:32])
    assert prompt_block_names(A, 16) == names[:4]  # the last token is always computed: 80 tokens name 4 blocks
    assert prompt_block_names([1] * 16, 16) == [] and prompt_block_names([1] * 17, 16) != []


def test_longest_prefix_wins_and_a_new_prefix_balances():
    router = PrefixRouter(2, 16)
    a, b = prompt_block_names(A + [1], 16), prompt_block_names(B + [1], 16)
    assert router.route(a) == 0
    router.started(0, "a1", a)
    assert router.route(a[:3] + prompt_block_names(B, 16)[3:]) == 0  # 3 leading blocks in common
    assert router.route(b) == 1  # nothing cached: the least loaded
    router.started(1, "b1", b)
    router.finished(0, "a1")
    router.report(0, 1, frozenset(a))
    router.report(1, 1, frozenset(b[:2]))
    assert router.route(a) == 0 and router.route(b) == 1
    router.report(0, 2, frozenset(a + b[:4]))  # replica 0 has since cached a longer run of b
    assert router.matched(0, b) == 4 and router.matched(1, b) == 5  # b1 is still in flight on 1
    router.finished(1, "b1")
    assert router.matched(1, b) == 2 and router.route(b) == 0


def test_load_breaks_ties_and_overrides_affinity_past_max_imbalance():
    router = PrefixRouter(3, 16, max_imbalance=2)
    a = prompt_block_names(A + [1], 16)
    router.report(0, 1, frozenset(a))
    router.report(1, 1, frozenset(a))
    router.started(0, "x", [])
    assert router.route(a) == 1  # equal matches: the less loaded
    for i in range(3):
        router.started(1, f"y{i}", [])
    assert router.route(a) == 0  # 0 (1 in flight) is within 2 of the idle replica 2; 1 (3) is not
    router.started(0, "z", [])
    router.started(0, "w", [])
    assert router.load(0) == 3 and router.load(2) == 0
    assert router.route(a) == 2  # both holders are 3 over the idle replica 2


def test_round_robin_ignores_the_cache():
    router = PrefixRouter(2, 16, policy="round_robin")
    a = prompt_block_names(A + [1], 16)
    router.report(0, 1, frozenset(a))
    assert [router.route(a) for _ in range(4)] == [0, 1, 0, 1]


def test_no_match_takes_the_least_loaded_in_turn():
    router = PrefixRouter(3, 16)
    assert [router.route([]) for _ in range(4)] == [0, 1, 2, 0]
    router.started(1, "r", [])
    assert [router.route([]) for _ in range(3)] == [2, 0, 2]


def test_late_reports_are_ignored_and_dead_replicas_skipped():
    router = PrefixRouter(2, 16)
    a = prompt_block_names(A + [1], 16)
    router.report(1, 5, frozenset(a))
    router.report(1, 4, frozenset())  # older than the report held
    assert router.matched(1, a) == 5 and router.route(a) == 1
    router.report(1, 6, frozenset(a[:1]))  # evicted since
    assert router.matched(1, a) == 1
    router.mark_dead(1)
    assert router.live() == [0] and router.route(a) == 0
    router.mark_dead(0)
    with pytest.raises(DeepfuseError, match="no replica is alive"):
        router.route(a)


def test_bad_settings_and_duplicate_ids():
    with pytest.raises(DeepfuseError, match="routing policy"):
        PrefixRouter(2, 16, policy="random")
    with pytest.raises(DeepfuseError, match="at least 1 replica"):
        PrefixRouter(0, 16)
    router = PrefixRouter(2, 16)
    router.started(0, "r", [b"x"])
    with pytest.raises(DeepfuseError, match="already running"):
        router.started(0, "r", [])
    router.finished(0, "r")
    router.finished(0, "r")  # a second end is a no-op
    assert router.load(0) == 0 and router.matched(0, [b"x"]) == 0
