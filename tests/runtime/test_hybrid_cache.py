"""Hybrid KV cache (sliding-window layers between full-attention ones): a block table per layer
group, sliding blocks handed back as the window passes, prefix caching of the window before a
boundary, and bounded replay, exact for the YOCO-style variant (models/yoco.py) and marked
approximate for Gemma 3's structure. References: the eager model over an unpaged run of
every position (tests.helpers.greedy_with) and the engine with prefix caching off."""
import dataclasses

import pytest
import torch

import deepfuse
from deepfuse.models import Gemma3, Gemma3Config, Yoco, YocoConfig
from deepfuse.models.cache_groups import cache_groups
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig, block_hash, kv_bytes_per_sequence
from tests.helpers import eager_step, greedy_with

WINDOW, BS = 8, 4
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
CONFIG = Gemma3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=4, num_heads=2, num_kv_heads=1,
                      head_dim=32, rope_theta=1e4, rope_local_theta=10.0, rms_norm_eps=1e-6, max_position=256,
                      query_pre_attn_scalar=32.0, sliding_window=WINDOW, full_attention_layers=(1, 3))


def random_weights(model_cls, config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Gemma 3-shaped random weights (norm multipliers around 1)."""
    c, g = config, torch.Generator().manual_seed(seed)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"embed_tokens": (c.vocab_size, c.hidden_size), "q_proj": (q, c.hidden_size), "k_proj": (kv, c.hidden_size),
              "v_proj": (kv, c.hidden_size), "o_proj": (c.hidden_size, q), "gate_proj": (c.intermediate_size, c.hidden_size),
              "up_proj": (c.intermediate_size, c.hidden_size), "down_proj": (c.hidden_size, c.intermediate_size),
              "q_norm": (c.head_dim,), "k_norm": (c.head_dim,)}
    out = {}
    for name in model_cls.weight_names(None, c):
        key = name.split(".")[-2]
        shape = shapes.get(key, (c.hidden_size,))
        out[name] = 1 + 0.2 * torch.randn(shape, generator=g) if len(shape) == 1 else 0.3 * torch.randn(shape, generator=g)
    return out


@pytest.fixture(scope="module")
def gemma():
    return Gemma3(CONFIG, random_weights(Gemma3, CONFIG))


@pytest.fixture(scope="module")
def yoco():
    config = YocoConfig(**{f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(CONFIG) if f.name != "family"})
    return Yoco(config, random_weights(Yoco, config, seed=1))


def engine(model, **cache):
    return Engine(deepfuse.compile(model), CacheConfig(block_size=BS, **{"num_blocks": 64, **cache}), max_num_tokens=8)


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in torch.randint(1, 96, (n,), generator=torch.Generator().manual_seed(seed))]


def test_groups_and_memory_per_sequence(gemma):
    """Two groups with their own tables; at 8k context Gemma 3 270M's cache is about a fifth of all-full."""
    assert [(g.window, g.layers) for g in cache_groups(CONFIG)] == [(0, (1, 3)), (WINDOW, (0, 2))]
    gemma270m = dataclasses.replace(CONFIG, num_layers=18, sliding_window=512, full_attention_layers=(5, 11, 17),
                                    head_dim=256)
    hybrid = kv_bytes_per_sequence(gemma270m, 8192, block_size=16, row_bytes=256 * 2)
    full = kv_bytes_per_sequence(dataclasses.replace(gemma270m, sliding_window=0, full_attention_layers=()), 8192,
                                 block_size=16, row_bytes=256 * 2)
    assert full == {"full": 18 * 8192 * 2 * 256 * 2}
    assert hybrid == {"full": 3 * 8192 * 2 * 256 * 2, "sliding": 15 * (512 // 16 + 1) * 16 * 2 * 256 * 2}
    assert 0.2 < sum(hybrid.values()) / full["full"] < 0.23


def test_hybrid_engine_matches_eager_and_hands_back_sliding_blocks(gemma):
    """A 40-token prompt in 8-token chunks: the sliding group holds at most ceil(8/4) + 1 blocks
    past a step's chunk, the full group all of them; tokens equal the eager unpaged run's."""
    eng = engine(gemma)
    ids = prompt(0, 40)
    want, _ = greedy_with(eager_step(gemma), CONFIG, ids, GREEDY.max_tokens, block_size=BS)
    eng.add_request(ids, GREEDY)
    held = []
    while eng.has_unfinished():
        done = eng.step()
        held.append((eng.kv.pools[0].num_used(), eng.kv.pools[1].num_used()))
    assert done[0].outputs[0].token_ids == want
    assert max(s for _, s in held) <= -(-WINDOW // BS) + 1
    assert max(f for f, _ in held[:-1]) == -(-(40 + 7) // BS)  # every full block until it finished
    assert eng.kv.num_used() == 0


def test_exact_prefix_hit_needs_the_window_before_the_boundary(gemma):
    """A repeated prompt is served from both groups (its window before the boundary stayed
    cached); a prompt sharing only an earlier part of it finds no sliding window there and is
    computed from the start; every output equals the cache-off run's."""
    base = prompt(1, 40)
    prompts = [base + [5, 6], base + [5, 6], base[:28] + [9, 9, 9]]
    want = [o.outputs[0].token_ids for o in engine(gemma, enable_prefix_caching=False).generate(prompts, [GREEDY] * 3)]
    eng = engine(gemma)
    got = [eng.generate([p], [GREEDY])[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in got] == want
    assert [o.num_cached_tokens for o in got] == [0, 40, 0]
    names = [block_hash(b"", base[:4])]
    assert eng.kv.pools[0].holds(names[0]) and not eng.kv.pools[1].holds(names[0])  # no boundary needs it


def test_exact_replay_of_the_yoco_variant_gives_the_full_prefill_tokens(yoco):
    """The third prompt's full-attention blocks are cached for 28 positions but no sliding window
    is: replay of 8 positions (one window) recomputes 28 - 8 .. 31 and the suffix, with exactly
    the tokens and nearly the logits of a full prefill; its later blocks are offered to prefix caching."""
    base = prompt(2, 40)
    prompts = [base + [5, 6], base[:28] + [9, 9, 9]]
    params = dataclasses.replace(GREEDY, logprobs=3)
    want = engine(yoco, enable_prefix_caching=False).generate(prompts, [params] * 2)
    eng = engine(yoco, swa_replay_tokens=WINDOW)
    first = eng.generate(prompts[:1], [params])[0]
    computed = eng.stats.prompt_tokens_computed
    got = eng.generate(prompts[1:], [params])[0]
    assert first.outputs[0].token_ids == want[0].outputs[0].token_ids
    assert got.outputs[0].token_ids == want[1].outputs[0].token_ids and got.num_cached_tokens == 28 - WINDOW
    assert eng.stats.prompt_tokens_computed - computed == 31 - 20
    assert eng.kv.stats.replay_hits == 1 and eng.kv.stats.replayed_tokens == WINDOW
    for a, b in zip(got.outputs[0].logprobs, want[1].outputs[0].logprobs):
        assert a.keys() == b.keys() and max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-4
    suffix = block_hash(b"", (prompts[1] + got.outputs[0].token_ids)[:4])
    for i in range(1, 9):
        suffix = block_hash(suffix, (prompts[1] + got.outputs[0].token_ids)[4 * i:4 * i + 4])
    assert eng.kv.pools[0].holds(suffix)  # block 8 (positions 32..35) follows an exact replay


def test_replay_in_gemma_is_marked_approximate(gemma):
    """Gemma 3's sliding keys depend on the positions replay drops: the request still runs, but
    the blocks it writes after the replayed span are never offered to prefix caching."""
    base = prompt(3, 40)
    eng = engine(gemma, swa_replay_tokens=WINDOW)
    eng.generate([base + [5, 6]], [GREEDY])
    later = base[:28] + [9, 9, 9, 9, 9]
    out = eng.generate([later], [GREEDY])[0]
    assert out.outputs[0].finish_reason == "length" and out.num_cached_tokens == 20 and eng.kv.stats.replay_hits == 1
    name = b""
    for i in range(8):
        name = block_hash(name, later[4 * i:4 * i + 4])
    assert not eng.kv.pools[0].holds(name)  # block 7 (positions 28..31) was computed after the replay
    assert eng.kv.num_used() == 0


def test_replay_off_recomputes_and_interrupted_replay_leaves_nothing(yoco):
    """Without replay the third prompt is computed from the start; a replayed admission whose
    step fails leaves the pools as they were."""
    base = prompt(4, 40)
    eng = engine(yoco, swa_replay_tokens=WINDOW)
    eng.generate([base], [GREEDY])
    before = [(p.num_used(), len(p.lru), dict(p.by_name)) for p in eng.kv.pools]
    eng.add_request(base[:28] + [7, 7, 7], GREEDY)
    real = eng.model
    eng.model = lambda inputs: (_ for _ in ()).throw(RuntimeError("fault inside the step"))
    with pytest.raises(RuntimeError):
        eng.step()
    eng.model = real
    assert [(p.num_used(), len(p.lru), dict(p.by_name)) for p in eng.kv.pools] == before
    assert eng.kv.stats.replay_hits == 0
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.stats.replay_hits == 1 and eng.kv.num_used() == 0


def test_replayed_chunk_inputs_start_the_sliding_group_at_the_replayed_span(gemma):
    """A chunk replaying positions 20..27 of a 28-position cached prefix: its full-attention k/v go
    to the scratch block, and the sliding layers see a sequence that starts at position 20
    (seq_lens.sliding counts from there, the table starts with the replayed span's block), so no
    key before the span is read."""
    from deepfuse.runtime.batch import SeqChunk

    eng = engine(gemma, swa_replay_tokens=WINDOW)
    full, sliding = list(range(10, 18)), [-1] * 5 + [40, 41, 42]
    chunk = SeqChunk(list(range(1, 9)), 20, full, sliding_blocks=sliding, sliding_start=20, replay_end=28)
    inputs = eng.buffers.fill([chunk], eng.cache)
    scratch = eng.cache.scratch_block
    assert scratch == 64 and eng.cache.layers[1].shape[1] == 65 and eng.cache.layers[0].shape[1] == eng.kv.pools[1].num_blocks
    assert inputs["slot_mapping"].tolist() == [scratch * BS + p % BS for p in range(20, 28)]
    assert inputs["seq_lens"].tolist() == [28] and inputs["seq_lens.sliding"].tolist() == [8]
    assert inputs["block_tables.sliding"][0, :3].tolist() == [40, 41, 42]
    assert inputs["slot_mapping.sliding"].tolist() == [b * BS + i for b in (40, 41) for i in range(BS)]


def test_a_hybrid_artifact_round_trips(yoco, tmp_path):
    """Saved and loaded (the family found by the manifest's name), the artifact keeps its two
    groups' inputs and gives the compiled model's tokens, replay included."""
    from deepfuse.runtime.loader import load

    art = deepfuse.compile(yoco)
    art.save(str(tmp_path / "a"))
    loaded = load(str(tmp_path / "a"))
    assert type(loaded.config).__name__ == "YocoConfig"
    assert {"slot_mapping.sliding", "block_tables.sliding", "seq_lens.sliding"} <= {v.name for v in loaded.graph.inputs}
    base = prompt(6, 40)
    prompts = [base + [1, 2], base[:28] + [3, 4, 5]]
    outs = []
    for model in (art, loaded):
        eng = Engine(model, CacheConfig(block_size=BS, num_blocks=64, swa_replay_tokens=WINDOW), max_num_tokens=8)
        outs.append([eng.generate([p], [GREEDY])[0].outputs[0].token_ids for p in prompts])
        assert eng.kv.stats.replay_hits == 1
    assert outs[0] == outs[1]


def test_a_fault_in_the_middle_of_a_chunked_replay_is_undone(yoco):
    """Replaying 8 positions + 3 new ones in 4-token chunks: the second step fails; both groups'
    tables and pools are as after the first, and the request then finishes with the cold tokens."""
    base = prompt(7, 40)
    later = base[:28] + [7, 7, 7]
    want = engine(yoco, enable_prefix_caching=False).generate([later], [GREEDY])[0].outputs[0].token_ids
    eng = Engine(deepfuse.compile(yoco), CacheConfig(block_size=BS, num_blocks=64, swa_replay_tokens=WINDOW),
                 max_num_tokens=4)
    eng.generate([base], [GREEDY])
    eng.add_request(later, GREEDY)
    eng.step()  # positions 20..23 of the replayed span
    req = eng.scheduler.running[0]
    before = ([list(t) for t in req.kv.tables], [(p.num_used(), len(p.lru), dict(p.by_name)) for p in eng.kv.pools])
    real = eng.model
    eng.model = lambda inputs: (_ for _ in ()).throw(KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    eng.model = real
    assert ([list(t) for t in req.kv.tables], [(p.num_used(), len(p.lru), dict(p.by_name)) for p in eng.kv.pools]) == before
    while eng.has_unfinished():
        done = eng.step()
    assert done[0].outputs[0].token_ids == want and eng.kv.num_used() == 0


def test_a_fault_with_requests_still_waiting_is_undone(gemma):
    """A hybrid cache's step fails while requests wait that were never admitted (one table, not
    one per group): the rollback frees nothing of theirs, and generate then gives the tokens a
    fresh engine gives."""
    prompts = [prompt(s, 10 + s) for s in range(3)]
    want = engine(gemma).generate(prompts, [GREEDY] * 3)
    eng = Engine(deepfuse.compile(gemma), CacheConfig(block_size=BS, num_blocks=64), max_num_tokens=8, max_num_seqs=1)
    real = eng.model

    class Failing:
        config = real.config

        def __call__(self, inputs):
            raise RuntimeError("fault inside the step")

    eng.model = Failing()
    with pytest.raises(RuntimeError, match="fault inside"):
        eng.generate(prompts, [GREEDY] * 3)
    assert not eng.has_unfinished() and eng.kv.num_used() == 0
    eng.model = real
    got = eng.generate(prompts, [GREEDY] * 3)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
