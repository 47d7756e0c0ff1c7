import pytest

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13], [42], [5, 5, 5, 5, 5]]


@pytest.fixture(scope="module")
def tiny_art(tiny_model):
    return deepfuse.compile(tiny_model)


def test_batched_equals_alone_greedy_and_seeded(tiny_art):
    eng = Engine(tiny_art, CacheConfig(block_size=4, num_blocks=64))
    for p in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=10, seed=7, ignore_eos=True)):
        together = [o.token_ids for o in eng.generate(PROMPTS, [p] * len(PROMPTS))]
        alone = [eng.generate([pr], [p])[0].token_ids for pr in PROMPTS]
        assert together == alone
        assert all(len(t) == 10 for t in together)
    assert len(eng.cache.allocator.free) == 64  # every block returned


def test_small_token_budget_chunks_prefill(tiny_art):
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    big = Engine(tiny_art, CacheConfig(block_size=4, num_blocks=64)).generate(PROMPTS, [p] * 4)
    small = Engine(tiny_art, CacheConfig(block_size=4, num_blocks=64), max_num_tokens=3).generate(PROMPTS, [p] * 4)
    assert [o.token_ids for o in big] == [o.token_ids for o in small]


def test_cache_smaller_than_all_requests_runs_in_waves(tiny_art):
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = Engine(tiny_art, CacheConfig(block_size=4, num_blocks=64)).generate(PROMPTS, [p] * 4)
    got = Engine(tiny_art, CacheConfig(block_size=4, num_blocks=6)).generate(PROMPTS, [p] * 4)
    assert [o.token_ids for o in want] == [o.token_ids for o in got]


def test_stop_tokens_and_finish_reason(tiny_art):
    eng = Engine(tiny_art, CacheConfig(block_size=4, num_blocks=64))
    free = eng.generate([PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])[0]
    assert free.finish_reason == "length"
    stop = free.token_ids[3]
    out = eng.generate([PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])])[0]
    assert out.finish_reason == "stop" and out.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


@pytest.mark.parametrize("params,msg", [
    (SamplingParams(temperature=-1), "temperature must be >= 0"),
    (SamplingParams(top_p=0), r"top_p must be in \(0, 1\]"),
    (SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (SamplingParams(max_tokens=0), "max_tokens must be >= 1"),
    (SamplingParams(top_k=-2), "top_k must be >= 0"),
])
def test_bad_sampling_params(tiny_art, params, msg):
    with pytest.raises(DeepfuseError, match=msg):
        Engine(tiny_art).generate([[1, 2]], [params])


def test_bad_prompts(tiny_art):
    eng = Engine(tiny_art, CacheConfig(block_size=4, num_blocks=64))
    with pytest.raises(DeepfuseError, match="prompt is empty"):
        eng.generate([[]], [SamplingParams()])
    with pytest.raises(DeepfuseError, match="exceeds the context of 256 tokens"):
        eng.generate([[1] * 250], [SamplingParams(max_tokens=10)])
    with pytest.raises(DeepfuseError, match="outside the vocabulary"):
        eng.generate([[1, 100000]], [SamplingParams()])


def test_llm_api_smollm2(smollm2_compiled, tmp_path):
    from deepfuse import LLM

    smollm2_compiled.save(str(tmp_path / "a"))
    llm = LLM(artifact=str(tmp_path / "a"))
    out = llm.chat("What is the capital of France?", SamplingParams(temperature=0, max_tokens=20))
    assert "Paris" in out.text and out.finish_reason == "stop"
    seeded = [llm.generate("Once upon a time", SamplingParams(temperature=0.8, seed=3, max_tokens=12))[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) > 0
