"""Graphed decode (runtime/graphed_decode.py) on sm90 in Triton's interpreter, without capture: the
padded bucket path over static inputs gives the eager path's tokens and KV, its padding rows
touch only the scratch block, and no decode step (bucketed or eager, greedy or sampled, dense or
MoE) waits for the device; overlapped steps (runtime/overlap.py) in their buckets give the same
tokens and wait for nothing but the last step's tokens. Capture itself runs only on a GPU
(benchmarks/gpu_graphs.py)."""
import os

import pytest
import torch

import deepfuse
from deepfuse import SamplingParams
from deepfuse.ir import interpret
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.engine import Engine
from deepfuse.runtime.graphed_decode import GraphedDecode, decode_buckets, plain_decode
from deepfuse.runtime.kv_cache import CacheConfig, KVCache
from deepfuse.runtime.spec import SpecConfig
from tests.models.test_gemma3_tiny import pair  # noqa: F401  (a fixture: a tiny Gemma 3)
from tests.sync_trap import HostWait, no_host_waits

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
PARAMS = [dict(temperature=0.0), dict(temperature=0.8, seed=11), dict(temperature=1.0, top_k=20, seed=12),
          dict(temperature=0.0), dict(temperature=0.9, top_p=0.8, seed=-5)]
PROMPTS = [[5, 17, 99, 3, 42], [7, 64, 1], [9, 11, 23, 31, 40, 2], [8, 77], [101, 6, 6, 6]]


@pytest.fixture(scope="module")
def sm90(tiny_model):
    return deepfuse.compile(tiny_model, target="sm90")


def test_buckets_and_which_steps_qualify():
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20] and decode_buckets(3) == [1, 2, 3] and decode_buckets(1) == [1]
    decode = SeqChunk([5], 7, [0])
    assert plain_decode([decode, SeqChunk([6], 3, [1], temperature=0.7)])
    assert not plain_decode([decode, SeqChunk([6, 7], 0, [1])])  # a prefill beside it
    assert not plain_decode([SeqChunk([6, 7], 3, [1], samples=2)])  # verifies a draft
    assert not plain_decode([SeqChunk([6], 3, [1], replay_end=8)])  # a replayed position
    assert not plain_decode([])


def spy_buckets(eng: Engine, used: list) -> None:
    """Records the bucket of every step that takes the graphed path."""
    real = eng.graphed.bucket
    eng.graphed.bucket = lambda k: used.append(real(k)) or used[-1]


def engine_tokens(model, n: int, cuda_graphs: bool, buckets: list | None = None) -> list[list[int]]:
    eng = Engine(model, CacheConfig(block_size=16, num_blocks=32), max_num_seqs=8, cuda_graphs=cuda_graphs)
    if buckets is not None:
        spy_buckets(eng, buckets)
    params = [SamplingParams(max_tokens=4, ignore_eos=True, **p) for p in PARAMS[:n]]
    return [o.outputs[0].token_ids for o in eng.generate(PROMPTS[:n], params)]


@pytest.mark.parametrize("n,bucket", [(3, 4), (5, 8)])
def test_padded_buckets_give_the_eager_and_cpu_tokens(sm90, tiny_model, n, bucket):
    """Greedy and seeded sampled requests: each decode step ran in the bucket, padded."""
    used = []
    got = engine_tokens(sm90, n, True, used)
    assert used == [bucket] * 3  # 4 tokens: the prefill step samples the first, 3 decode steps
    assert got == engine_tokens(sm90, n, False)
    assert got == engine_tokens(deepfuse.compile(tiny_model), n, False)


def test_a_hybrid_models_padded_buckets_give_the_eager_tokens(pair):  # noqa: F811  (the fixture)
    """Gemma 3 (sliding-window and full-attention layers, two cache groups): its padding rows write
    the scratch block of each group; prompts past the window release blocks (-1 in the tables)."""
    sm90 = deepfuse.compile(pair[1], target="sm90")
    prompts = [list(range(3, 23)), [7, 64, 1], list(range(40, 58))]
    params = [SamplingParams(max_tokens=5, ignore_eos=True, **p) for p in PARAMS[:3]]
    out, used = {}, []
    for graphs, overlap in ((False, False), (True, False), (True, True)):
        eng = Engine(sm90, CacheConfig(16, 32), max_num_seqs=8, cuda_graphs=graphs, overlap=overlap)
        assert len(eng.cache.groups) == 2 and (eng.cache.scratch_blocks[1] is not None) == graphs
        if graphs:
            spy_buckets(eng, used)
        out[graphs, overlap] = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
    assert out[True, False] == out[False, False] == out[True, True] and used == [4] * 8
    assert eng.stats.ahead_steps == 4  # overlapped: each decode step launched before the last was read


def test_steps_that_verify_drafts_run_eagerly_beside_graphed_ones(sm90):
    """n-gram drafting: steps that verify drafts take the eager path, the others their bucket;
    the tokens are the all-eager engine's."""
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 9, 9, 9, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, **p) for p in PARAMS[:3]]
    out, used = {}, []
    for graphs in (False, True):
        eng = Engine(sm90, CacheConfig(16, 32), max_num_seqs=8, cuda_graphs=graphs,
                     spec=SpecConfig(num_draft_tokens=2, schedule="fixed"))
        if graphs:
            spy_buckets(eng, used)
        out[graphs] = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
        drafted = eng.spec_stats
    assert out[True] == out[False]
    assert used and eng.stats.steps > len(used) + 1 and drafted.drafted > 0, (used, eng.stats.steps)


def seeded_cache(c, scratch: bool) -> KVCache:
    """8 blocks of random keys and values (the same with or without the scratch block, itself random)."""
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(16, 8), scratch=scratch)
    real, extra = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    for layer in cache.layers:
        layer[:, :8] = torch.randn(layer[:, :8].shape, generator=real)
        layer[:, 8:] = torch.randn(layer[:, 8:].shape, generator=extra)
    return cache


def decode_chunks(n: int) -> list[SeqChunk]:
    """n decodes over cached keys; block 0 holds the first sequence's positions 0..15."""
    tables, starts = [[0, 1], [2], [3, 4], [5], [6]], [17, 9, 25, 4, 12]
    return [SeqChunk([7 + i], starts[i], tables[i], **PARAMS[i]) for i in range(n)]


def padded_step(model, n: int, pad_block: int | None = None):
    """One step of n decodes through GraphedDecode (no capture) -> (outputs, cache, its scratch block).
    pad_block: where the padding rows write instead of the scratch block (a broken padding)."""
    cache = seeded_cache(model.config, scratch=True)
    graphed = GraphedDecode(model, cache, 8, 4, capture=False)
    if pad_block is not None:
        cache.scratch_blocks = [pad_block]
    return graphed(decode_chunks(n))[1], cache, 8


@pytest.mark.parametrize("n", [3, 5])
def test_padding_rows_write_only_the_scratch_block(sm90, n):
    """The real blocks' KV after the padded step equal the unpadded step's, bit for bit; only the
    scratch block changed besides. Writing the padding into block 0 instead is caught."""
    eager_cache = seeded_cache(sm90.config, scratch=False)
    want = sm90(build_step(decode_chunks(n), eager_cache))
    got, cache, scratch = padded_step(sm90, n)
    assert torch.equal(got[1], want[1]) and got[0].shape == want[0].shape
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    before = seeded_cache(sm90.config, scratch=True)

    def real_blocks_equal(c: KVCache) -> bool:
        return all(torch.equal(a[:, :scratch], b) for a, b in zip(c.layers, eager_cache.layers))

    assert real_blocks_equal(cache)
    assert not all(torch.equal(a[:, scratch], b[:, scratch]) for a, b in zip(cache.layers, before.layers))
    _, broken, _ = padded_step(sm90, n, pad_block=0)
    assert not real_blocks_equal(broken)


@pytest.fixture(scope="module")
def mixtral_sm90(tmp_path_factory):
    from deepfuse.models import load_model
    from tests.models.test_moe_families import mixtral

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mixtral")
    mixtral().eval().save_pretrained(path)
    return deepfuse.compile(load_model(str(path), with_tokenizer=False)[0], target="sm90")


@pytest.fixture(scope="module")
def hd24_sm90(tmp_path_factory):
    """head_dim 24: no attention kernel (not a power of two), its launch runs a torch stand-in."""
    from transformers import LlamaForCausalLM

    from deepfuse.models import load_model
    from tests.conftest import tiny_hf_config

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hd24")
    LlamaForCausalLM(tiny_hf_config(hidden_size=96, num_attention_heads=4)).save_pretrained(path)
    art = deepfuse.compile(load_model(str(path), with_tokenizer=False)[0], target="sm90")
    assert [p["op"] for p in art.plan["launches"] if not p.get("kernels")] == ["qkv_attention"] * 2
    return art


def test_the_trap_catches_host_reads():
    x = torch.arange(4)
    for read in (lambda: x[0].item(), lambda: x.tolist(), lambda: bool(x[1]), lambda: x.numpy(),
                 lambda: x[x > 1], lambda: torch.nonzero(x), lambda: x.repeat_interleave(x)):
        with no_host_waits(), pytest.raises(HostWait):
            read()
    with no_host_waits():
        x.repeat_interleave(2), x[1:3], x + 1


@pytest.mark.parametrize("which", ["llama", "mixtral", "hd24"])
def test_decode_steps_never_wait_for_the_device(request, which):
    """Greedy and seeded sampled decode steps, eager (runner) and padded (GraphedDecode: staging,
    one non-blocking copy, the step), with every host read outside Triton's own kernels trapped.
    Mixtral's step adds the MoE routing and sort kernels (moe_align.py); hd24's attention is
    a torch stand-in (device_refs.py), whose tokens are the IR reference's."""
    model = request.getfixturevalue({"llama": "sm90", "mixtral": "mixtral_sm90", "hd24": "hd24_sm90"}[which])
    eager_cache = seeded_cache(model.config, scratch=False)
    inputs = build_step(decode_chunks(3), eager_cache)
    with no_host_waits():
        want = model(inputs)
    reference = interpret(model.graph, build_step(decode_chunks(3), seeded_cache(model.config, scratch=False)))
    assert torch.equal(want[1], reference[1])
    cache = seeded_cache(model.config, scratch=True)
    graphed = GraphedDecode(model, cache, 8, 4, capture=False)
    chunks = decode_chunks(3)
    with no_host_waits() as trap:
        _, got = graphed(chunks)
    assert trap.copies == [((graphed.ends[4],), True)]  # one copy, non-blocking, of the bytes bucket 4 reads
    assert torch.equal(got[1], want[1])


def test_overlapped_steps_in_their_buckets_give_the_eager_and_cpu_tokens(sm90, tiny_model):
    """Greedy and seeded sampled requests that end at different steps (max_tokens, a stop id): the
    overlapped engine's decode steps run in buckets that shrink as requests end (a finished
    request's row in the step launched ahead is dropped), with the tokens of the synchronous
    eager sm90 engine and of the CPU build."""
    params = [SamplingParams(max_tokens=m, ignore_eos=True, **p) for m, p in zip([5, 3, 5, 2, 4], PARAMS)]
    first = engine_outputs(sm90, params, False, False)
    params[0] = SamplingParams(max_tokens=5, stop_token_ids=[first[0][2]], **PARAMS[0])  # stops at its third token
    used = []
    got = engine_outputs(sm90, params, True, True, used)
    assert got == engine_outputs(sm90, params, False, False) == engine_outputs(deepfuse.compile(tiny_model), params,
                                                                               False, False)
    assert [len(t) for t in got] == [3, 3, 5, 2, 4]
    # every decode step launched ahead: 5 rows, 4, 3 (the stopped request's row is dropped), 1; a request
    # that its max_tokens ends gets no row after its last token
    assert used == [8, 4, 4, 1]


def engine_outputs(model, params, graphs: bool, overlap: bool, buckets: list | None = None) -> list[list[int]]:
    eng = Engine(model, CacheConfig(block_size=16, num_blocks=32), max_num_seqs=8, cuda_graphs=graphs, overlap=overlap)
    if buckets is not None:
        spy_buckets(eng, buckets)
    out = [o.outputs[0].token_ids for o in eng.generate(PROMPTS[:len(params)], params)]
    assert eng.stats.ahead_steps == (len(buckets) if overlap else 0)
    return out


def test_overlapped_decode_waits_only_for_the_last_steps_tokens(sm90, monkeypatch):
    """After the prefill step, every step() launches the next decode step (staging, the feed, the
    bucket) and takes the last one's tokens with every host read trapped except the one wait for
    those tokens (InFlight.tokens); the tokens are the synchronous engine's."""
    from deepfuse.runtime.overlap import InFlight

    params = [SamplingParams(max_tokens=5, ignore_eos=True, **p) for p in PARAMS[:3]]
    eng = Engine(sm90, CacheConfig(block_size=16, num_blocks=32), max_num_seqs=8, cuda_graphs=True, overlap=True)
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    done = {o.request_id: o for o in eng.step()}  # the prefill (eager) and the first decode step launched
    real, reads = InFlight.tokens, []

    with no_host_waits() as trap:
        def tokens(self):
            trap.suspended += 1
            reads.append(1)
            try:
                return real(self)
            finally:
                trap.suspended -= 1

        monkeypatch.setattr(InFlight, "tokens", tokens)
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step())
    assert len(reads) == 4 and eng.stats.ahead_steps == 4
    assert [done[i].outputs[0].token_ids for i in ids] == engine_outputs(sm90, params, False, False)
