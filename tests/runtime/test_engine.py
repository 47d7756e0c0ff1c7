"""Engine on the tiny random Llama: batching, chunking, preemption, prefix cache, errors."""
import pytest

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig, block_hash
from tests.helpers import ngram_spec_counts, scheduled_preemptions

PROMPTS = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12, 13], [42], [5, 5, 5, 5, 5]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_art(tiny_model):
    return deepfuse.compile(tiny_model)


def engine(art, num_blocks=64, block_size=4, **kw):
    return Engine(art, CacheConfig(block_size=block_size, num_blocks=num_blocks, **kw.pop("cache", {})), **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_batched_equals_alone_greedy_and_seeded(tiny_art):
    eng = engine(tiny_art)
    for p in (GREEDY, SamplingParams(temperature=1.0, top_p=0.9, top_k=20, max_tokens=10, seed=7, ignore_eos=True)):
        together = tokens(eng.generate(PROMPTS, [p] * len(PROMPTS)))
        alone = [eng.generate([pr], [p])[0].outputs[0].token_ids for pr in PROMPTS]
        assert together == alone
        assert all(len(t) == 10 for t in together)
    assert eng.kv.pool.num_used() == 0 and eng.kv.pool.num_available() == 64  # every block returned


def test_small_token_budget_chunks_prefill(tiny_art):
    big = engine(tiny_art).generate(PROMPTS, [GREEDY] * 4)
    small = engine(tiny_art, max_num_tokens=3).generate(PROMPTS, [GREEDY] * 4)
    assert tokens(big) == tokens(small)


def test_preemption_when_the_cache_cannot_hold_every_request(tiny_art):
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = engine(tiny_art).generate(PROMPTS * 2, [p] * 8)
    eng = engine(tiny_art, num_blocks=12, cache={"enable_prefix_caching": False})
    got = eng.generate(PROMPTS * 2, [p] * 8)
    assert tokens(got) == tokens(want)
    # the documented policy (LIFO victims, recompute) on these sizes: 8 requests needing 34 blocks
    # in all, 12 at hand -> 4 preemptions, of requests 2, 3, 4 and 6
    want_preemptions = scheduled_preemptions([len(pr) for pr in PROMPTS * 2], 12, block_size=4, num_blocks=12)
    assert [o.metrics.num_preemptions for o in got] == want_preemptions and sum(want_preemptions) > 0
    assert eng.scheduler.num_preemptions == sum(want_preemptions)
    assert eng.kv.pool.num_available() == 12


def test_seeded_sampling_survives_preemption(tiny_art):
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=11, ignore_eos=True)
    want = engine(tiny_art).generate(PROMPTS * 2, [p] * 8)
    eng = engine(tiny_art, num_blocks=12)
    got = eng.generate(PROMPTS * 2, [p] * 8)
    assert tokens(got) == tokens(want)
    assert sum(o.metrics.num_preemptions for o in got) == eng.scheduler.num_preemptions > 0


def test_request_too_big_for_the_whole_cache_is_an_error_not_a_hang(tiny_art):
    eng = engine(tiny_art, num_blocks=4)  # 16 tokens
    out = eng.generate([[1] * 10, [2, 3]], [SamplingParams(max_tokens=10), SamplingParams(temperature=0, max_tokens=3)])
    assert out[0].outputs[0].finish_reason == "error" and "(max_model_len 16)" in str(out[0].error)
    assert out[1].outputs[0].finish_reason == "length" and len(out[1].outputs[0].token_ids) == 3


def test_prefix_cache_skips_shared_prompt_blocks(tiny_art):
    prefix = [(7 * i) % 120 for i in range(40)]
    prompts = [prefix + [100 + i, 3, 4] for i in range(8)]
    off = engine(tiny_art, num_blocks=128, cache={"enable_prefix_caching": False})
    on = engine(tiny_art, num_blocks=128)
    want, got = off.generate(prompts, [GREEDY] * 8), on.generate(prompts, [GREEDY] * 8)
    assert tokens(got) == tokens(want)
    assert off.stats.prompt_tokens_computed == 8 * 43
    # the first request computes everything; the next seven find the 40-token prefix (10 blocks)
    assert on.stats.prompt_tokens_computed == 43 + 7 * 3
    assert [o.num_cached_tokens for o in got] == [0] + [40] * 7
    assert on.kv.usage()["prefix_hit_rate"] == pytest.approx(7 * 40 / (8 * 43), abs=1e-4)
    # a second round is served from cached, unreferenced blocks
    again = on.generate(prompts[:1], [GREEDY])[0]
    assert again.outputs[0].token_ids == want[0].outputs[0].token_ids and again.num_cached_tokens == 40


def test_prefix_cache_evicts_least_recently_used_blocks(tiny_art):
    eng = engine(tiny_art, num_blocks=12)
    a, b = list(range(1, 17)), list(range(30, 46))
    # 16 prompt tokens and 10 generated: the KV of 16 + 9 positions, 7 blocks, of which the 6 full
    # ones are named and stay cached when the request ends; the 7th goes back free
    eng.generate([a], [GREEDY])
    assert eng.kv.usage()["blocks_cached_unused"] == 6 and eng.kv.usage()["blocks_free"] == 6
    # b takes the 6 free blocks, then evicts a's least recently used one (its tail)
    eng.generate([b], [GREEDY])
    assert eng.kv.pool.evictions == 1 and eng.kv.usage()["blocks_cached_unused"] == 5 + 6
    c = eng.generate([list(range(60, 96))], [SamplingParams(temperature=0, max_tokens=8)])[0]
    # c's 36 prompt tokens and its n generated ones need ceil((36 + n - 1) / 4) blocks (11 for 8):
    # one free, the rest evicted
    assert eng.kv.pool.evictions == 1 + -(-(36 + len(c.outputs[0].token_ids) - 1) // 4) - 1
    assert eng.generate([a], [GREEDY])[0].outputs[0].token_ids == engine(tiny_art).generate([a], [GREEDY])[0].outputs[0].token_ids


def test_requests_added_while_others_run(tiny_art):
    eng = engine(tiny_art)
    alone = [engine(tiny_art).generate([p], [GREEDY])[0].outputs[0].token_ids for p in PROMPTS]
    ids = [eng.add_request(PROMPTS[0], GREEDY), eng.add_request(PROMPTS[1], GREEDY)]
    done = {}
    for step in range(40):
        if step == 3:
            ids += [eng.add_request(PROMPTS[2], GREEDY), eng.add_request(PROMPTS[3], GREEDY)]
        for out in eng.step():
            done[out.request_id] = out.outputs[0].token_ids
        if not eng.has_unfinished():
            break
    assert [done[i] for i in ids] == alone


def test_abort(tiny_art):
    eng = engine(tiny_art)
    keep, drop = eng.add_request(PROMPTS[0], GREEDY), eng.add_request(PROMPTS[1], GREEDY)
    eng.step()
    out = eng.abort(drop)
    assert out.outputs[0].finish_reason == "abort" and eng.abort(drop) is None
    finished = []
    while eng.has_unfinished():
        finished += eng.step()
    assert [o.request_id for o in finished] == [keep] and len(finished[0].outputs[0].token_ids) == 10
    assert eng.kv.pool.num_used() == 0


def test_stop_tokens_logprobs_and_timing(tiny_art):
    eng = engine(tiny_art)
    free = eng.generate([PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)])[0]
    assert free.outputs[0].finish_reason == "length" and len(free.outputs[0].logprobs) == 8
    for tok, lp in zip(free.outputs[0].token_ids, free.outputs[0].logprobs):
        assert len(lp) == 3 and tok in lp and max(e.logprob for e in lp.values()) == lp[tok].logprob <= 0  # greedy: the top
        assert sorted(e.rank for e in lp.values()) == [1, 2, 3] and lp[tok].rank == 1
    times, m = free.outputs[0].token_times, free.metrics
    assert len(times) == 8 and m.ttft_s == times[0] > 0 and m.tpot_s > 0 and free.finished
    # one token a step: strictly increasing times, tpot the mean gap after the first, all before the end
    assert all(a < b for a, b in zip(times, times[1:]))
    assert m.tpot_s == pytest.approx((times[-1] - times[0]) / 7) and m.total_s >= times[-1]
    assert m.arrival_time < m.first_token_time <= m.last_token_time <= m.finished_time
    assert free.outputs[0].cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(
        free.outputs[0].token_ids, free.outputs[0].logprobs)))
    assert free.outputs[0].stop_reason is None
    stop = free.outputs[0].token_ids[3]
    out = eng.generate([PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop])])[0]
    done, ids = out.outputs[0], free.outputs[0].token_ids
    assert done.finish_reason == "stop" and done.token_ids == ids[: ids.index(stop) + 1] and done.stop_reason == stop
    assert done.cumulative_logprob is None and done.logprobs is None


@pytest.mark.parametrize("kw,field", [
    ({"temperature": -1}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"), ({"top_k": -2}, "top_k"), ({"logprobs": 99}, "logprobs"),
    ({"stop": [""]}, "stop"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {3: float("inf")}}, "logit_bias"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias"), ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids"), ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"), ({"stop_token_ids": [[1, 2]]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop": 3}, "stop"),
    ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_params_raise_value_error_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"^{field} must"):
        SamplingParams(**kw)


def test_vllm_spellings_are_taken():
    p = SamplingParams(stop="x", stop_token_ids=None, top_k=-1, allowed_token_ids=(3, 4))
    assert (p.stop, p.stop_token_ids, p.top_k, p.allowed_token_ids) == (["x"], [], 0, [3, 4])
    assert SamplingParams(stop=None, stop_token_ids=(7,)).stop_token_ids == [7]


def test_max_tokens_none_generates_up_to_the_context(tiny_art):
    """vLLM's max_tokens=None: as many tokens as max_model_len leaves after the prompt."""
    eng = engine(tiny_art)
    assert SamplingParams(max_tokens=None, min_tokens=5).max_tokens is None
    with pytest.raises(ValueError, match="^max_tokens must"):
        SamplingParams(max_tokens=True)
    free = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    outs = eng.generate([PROMPTS[1], [1] * 256, PROMPTS[0]], [free, free, GREEDY])
    assert eng.max_model_len == 256
    assert (outs[0].outputs[0].finish_reason, len(outs[0].outputs[0].token_ids)) == ("length", 256 - len(PROMPTS[1]))
    assert tokens(outs[:1])[0][:10] == tokens(engine(tiny_art).generate([PROMPTS[1]], [GREEDY]))[0]  # greedy, 10 tokens
    assert outs[1].outputs[0].finish_reason == "error" and "leaves no room to generate" in str(outs[1].error)
    assert outs[2].outputs[0].finish_reason == "length" and eng.kv.pool.num_used() == 0


def test_bad_requests_fail_alone_and_the_rest_complete(tiny_art):
    eng = engine(tiny_art)
    mutated = SamplingParams(temperature=0, max_tokens=4)
    mutated.max_tokens = 0  # changed after construction: caught when submitted
    prompts = [PROMPTS[0], [], [1] * 250, [1, 100000], PROMPTS[1], PROMPTS[2]]
    params = [GREEDY, GREEDY, SamplingParams(max_tokens=10), GREEDY, mutated, GREEDY]
    outs = eng.generate(prompts, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "error", "error", "error", "length"]
    assert isinstance(outs[1].error, ValueError) and "prompt is empty" in str(outs[1].error)
    assert "(max_model_len 256)" in str(outs[2].error)
    assert "outside the vocabulary" in str(outs[3].error)
    assert str(outs[4].error).startswith("max_tokens must")
    assert tokens([outs[0], outs[5]]) == tokens(engine(tiny_art).generate([PROMPTS[0], PROMPTS[2]], [GREEDY] * 2))
    eng.add_request([1], GREEDY, request_id="x")
    with pytest.raises(DeepfuseError, match="already in use"):
        eng.add_request([1], GREEDY, request_id="x")


def test_penalized_requests_keep_their_tokens_in_any_batch_preempted_or_speculating(tiny_art):
    """Penalties and min_tokens are drawn on the host from each row's logits under its own key:
    a request's tokens are the same alone, in a batch, through a cache small enough to preempt,
    and beside n-gram speculation (which drafts nothing for requests whose penalties count their
    output, and verifies the others' drafts on the host); and they differ from the unpenalized run."""
    from deepfuse.runtime.spec import SpecConfig

    base = dict(max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0, repetition_penalty=1.5, **base),
              # seeds 9 and 10 on PROMPTS[1]: seeds whose draws the penalties change (a Gumbel-max draw
              # changes only where a penalty moves the winning score; seed 9's plain run repeats a token)
              SamplingParams(temperature=0.9, seed=9, presence_penalty=1.0, frequency_penalty=0.5, **base),
              SamplingParams(temperature=0, frequency_penalty=2.0, **base),
              SamplingParams(temperature=0.7, seed=10, repetition_penalty=0.7, top_k=10, **base),
              SamplingParams(temperature=1.0, seed=3, min_p=0.9, **base),
              SamplingParams(temperature=0, logit_bias={5: 30.0, 6: -1e4}, **base),
              SamplingParams(temperature=1.0, seed=4, allowed_token_ids=[9, 12, 40, 41], **base)]
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[3], PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[3]]
    alone = [engine(tiny_art).generate([pr], [p])[0].outputs[0].token_ids for pr, p in zip(prompts, params)]
    plain = [engine(tiny_art).generate([pr], [SamplingParams(temperature=p.temperature, seed=p.seed, top_k=p.top_k,
                                                             **base)])[0].outputs[0].token_ids for pr, p in zip(prompts, params)]
    assert [a != b for a, b in zip(alone, plain)] == [True] * len(params), (alone, plain)
    assert 5 in alone[5] and 6 not in alone[5] and set(alone[6]) <= {9, 12, 40, 41}
    k = len(params)
    mixed = engine(tiny_art).generate(prompts + PROMPTS, params + [GREEDY] * 4)
    assert tokens(mixed[:k]) == alone
    small = engine(tiny_art, num_blocks=8)
    assert tokens(small.generate(prompts, params)) == alone and small.scheduler.num_preemptions > 0
    spec = engine(tiny_art, spec=SpecConfig(num_draft_tokens=3, schedule="fixed"))
    repeat = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]  # n-gram drafts for the unpenalized request beside them
    outs = spec.generate(prompts + [repeat], params + [GREEDY])
    assert tokens(outs[:k]) == alone and all(o.metrics.spec.drafted == 0 for o in outs[:4])
    assert sum(o.metrics.spec.drafted for o in outs[4:k]) > 0  # min_p, logit_bias, allowed_token_ids
    # what prompt lookup must draft for the repeating request, from its tokens (runtime/spec.py's rules)
    must = ngram_spec_counts(repeat, outs[k].outputs[0].token_ids, 3, GREEDY.max_tokens)
    assert must["drafted"] > 0
    assert (outs[k].metrics.spec.verifications, outs[k].metrics.spec.drafted, outs[k].metrics.spec.accepted) == \
        (must["verifications"], must["drafted"], must["accepted"])
    assert outs[k].outputs[0].token_ids == engine(tiny_art).generate([repeat], [GREEDY])[0].outputs[0].token_ids


def test_token_ids_outside_the_vocabulary_or_unmeetable_min_tokens_fail_alone(tiny_art):
    eng = engine(tiny_art)
    vocab = tiny_art.config.vocab_size
    params = [SamplingParams(temperature=0, max_tokens=4, logit_bias={vocab: 1.0}),
              SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[3, vocab + 5]),
              SamplingParams(temperature=0, max_tokens=4, allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2),
              GREEDY]
    outs = eng.generate([PROMPTS[0]] * 4, params)
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error", "error", "length"]
    assert str(outs[0].error).startswith("logit_bias has token ids outside the vocabulary")
    assert str(outs[1].error).startswith("allowed_token_ids has token ids outside the vocabulary")
    assert "min_tokens cannot be met" in str(outs[2].error)


def test_n_completions_share_the_prompt_and_each_keeps_its_own_tokens(tiny_art):
    """n = 4: completion 0 is the n = 1 run; completion j is a single request seeded
    completion_seed(seed, j) (in a batch or not); the prompt's full blocks are computed once."""
    from deepfuse.runtime.request import completion_seed

    prompt = [(7 * i) % 120 for i in range(43)]
    base = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    eng = engine(tiny_art, num_blocks=128)
    out = eng.generate([prompt, PROMPTS[1]], [SamplingParams(n=4, seed=7, **base), GREEDY])
    assert [[c.index for c in o.outputs] for o in out] == [[0, 1, 2, 3], [0]]
    got = [s.token_ids for s in out[0].outputs]
    assert len({tuple(t) for t in got}) == 4  # four different completions
    solo = [engine(tiny_art).generate([prompt], [SamplingParams(seed=completion_seed(7, j), **base)])[0].outputs[0].token_ids
            for j in range(4)]
    assert got == solo and completion_seed(7, 0) == 7
    assert out[1].outputs[0].token_ids == engine(tiny_art).generate([PROMPTS[1]], [GREEDY])[0].outputs[0].token_ids
    # the first completion computes the prompt; the others only its last, partial block (43 = 10 * 4 + 3)
    assert eng.stats.prompt_tokens_computed == 43 + 3 * 3 + len(PROMPTS[1])
    assert out[0].num_cached_tokens == 0  # completion 0's
    # without a seed the completions are drawn independently; greedy ones are all the argmax
    free = engine(tiny_art).generate([prompt], [SamplingParams(n=3, **base)])[0]
    assert len({tuple(s.token_ids) for s in free.outputs}) == 3
    greedy = engine(tiny_art).generate([prompt], [SamplingParams(n=3, temperature=0, max_tokens=8)])[0]
    assert all(s.token_ids == greedy.outputs[0].token_ids for s in greedy.outputs)


def test_n_is_checked_and_only_generate_takes_it(tiny_art):
    eng = engine(tiny_art)
    with pytest.raises(ValueError, match="^n must be an int >= 1"):
        SamplingParams(n=0)
    with pytest.raises(DeepfuseError, match="add one request per completion"):
        eng.add_request([1, 2], SamplingParams(n=2))
    with pytest.raises(DeepfuseError, match="cannot be used with n > 1"):
        eng.generate([[1, 2]], [SamplingParams(n=2)], on_token=lambda i, t: None)
    out = eng.generate([[], [1, 2]], [SamplingParams(n=3), SamplingParams(n=2, max_tokens=3)])
    assert [c.finish_reason for c in out[0].outputs] == ["error"] * 3 and out[0].error is not None
    assert [len(s.token_ids) for s in out[1].outputs] == [3, 3]
    assert not eng.has_unfinished()


def test_a_raising_callback_leaves_the_engine_clean(tiny_art):
    """on_token raising (or Ctrl-C) ends generate with the exception; its requests leave the
    engine, their blocks are freed, and the next call gives what a fresh engine gives."""
    eng = engine(tiny_art)
    other = eng.add_request(PROMPTS[3], GREEDY)  # added outside the call: it stays

    def on_token(i: int, _tok: int) -> None:
        if i == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS[:3], [GREEDY] * 3, on_token)
    assert list(eng.requests) == [other]
    while eng.has_unfinished():
        eng.step()
    assert eng.kv.pool.num_used() == 0
    assert tokens(eng.generate(PROMPTS, [GREEDY] * 4)) == tokens(engine(tiny_art).generate(PROMPTS, [GREEDY] * 4))


def test_a_callback_raising_inside_step_loses_no_output(tiny_art):
    """step(on_token) raising mid-step, with speculation accepting several tokens a step: every
    request's state stays whole, the outputs that finished in that step come back from the next
    step(), and all requests end as they would without the callback."""
    from deepfuse.runtime.spec import SpecConfig

    repeat = [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6]
    prompts = [repeat, PROMPTS[0], repeat[1:], PROMPTS[2]]
    params = [GREEDY, SamplingParams(temperature=0, max_tokens=3), GREEDY, SamplingParams(temperature=0, max_tokens=5)]
    want = tokens(engine(tiny_art).generate(prompts, params))
    eng = engine(tiny_art, spec=SpecConfig(num_draft_tokens=3, schedule="fixed"))
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    calls, outs = [0], {}

    def flaky(_rid: str, _tok: int) -> None:
        calls[0] += 1
        if calls[0] % 7 == 0:
            raise RuntimeError("callback failed")

    raised = 0
    while eng.has_unfinished():
        try:
            outs.update((o.request_id, o) for o in eng.step(flaky))
        except RuntimeError:
            raised += 1
    assert raised >= 2 and eng.spec_stats.accepted > 0 and eng.kv.pool.num_used() == 0
    assert [outs[i].outputs[0].token_ids for i in ids] == want


def test_prompt_logprobs_in_chunks_batches_and_preemption(tiny_art):
    """Prompt logprobs: None, then one entry per prompt token; the same through 5-token chunks,
    beside other requests, after preemption and with the prefix cached by another request;
    the generated tokens are the run's without them."""
    prompt = [(7 * i) % 120 for i in range(23)]
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    want = engine(tiny_art).generate([prompt], [sampled])[0]
    ask = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, prompt_logprobs=2)
    alone = engine(tiny_art).generate([prompt], [ask])[0]
    assert alone.outputs[0].token_ids == want.outputs[0].token_ids and want.prompt_logprobs is None
    lps = alone.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    assert all(prompt[i] in e and len(e) in (2, 3) and max(v.logprob for v in e.values()) <= 0 for i, e in enumerate(lps) if i)
    assert all(sorted(v.rank for v in e.values())[:2] == [1, 2] and e[prompt[i]].rank >= 1 for i, e in enumerate(lps) if i)
    chunked = engine(tiny_art, max_num_tokens=5)
    cached = chunked.generate([prompt], [sampled])[0]  # caches the prompt's blocks
    outs = chunked.generate([prompt, PROMPTS[1], prompt], [ask, GREEDY, sampled])
    assert outs[0].num_cached_tokens == 0 and outs[2].num_cached_tokens == 20
    assert cached.outputs[0].token_ids == want.outputs[0].token_ids
    small = engine(tiny_art, num_blocks=12, max_num_tokens=4)
    cut = []  # (request id, prompt tokens computed) at each preemption
    preempt = small.scheduler._preempt
    small.scheduler._preempt = lambda r: (cut.append((r.request_id, r.computed)), preempt(r))
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    many = small.generate([PROMPTS[1], PROMPTS[3], prompt], [long, long, ask])
    assert any(rid == "2" and 0 < c < len(prompt) for rid, c in cut), cut  # preempted mid-prompt
    for got in (outs[0], many[2]):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert [None if e is None else sorted(e) for e in got.prompt_logprobs] == [None if e is None else sorted(e) for e in lps]
        assert all(e is None or max(abs(e[t].logprob - lps[i][t].logprob) for t in e) < 1e-4
                   for i, e in enumerate(got.prompt_logprobs))


@pytest.mark.parametrize("dtype,quant,kv", [("bf16", "int4", None), ("bf16", "w8a8", "int8")])
def test_prompt_logprobs_of_quantized_builds(tiny_model, tiny_art, dtype, quant, kv):
    """Every row's logits come through the quantized LM heads too: the prompt logprobs are
    the f32 build's within bf16 rounding, and the tokens are the build's own without them."""
    art = deepfuse.compile(tiny_model, dtype=dtype, quant=quant, kv_cache_dtype=kv)
    prompt = [(7 * i) % 120 for i in range(23)]
    ask = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    got = engine(art, max_num_tokens=8).generate([prompt], [ask])[0]
    assert got.outputs[0].token_ids == engine(art).generate([prompt], [GREEDY])[0].outputs[0].token_ids[:6]
    want = engine(tiny_art).generate([prompt], [ask])[0].prompt_logprobs
    assert len(got.prompt_logprobs) == len(prompt) and all(len(e) == 1 for e in got.prompt_logprobs[1:])
    assert max(abs(got.prompt_logprobs[i][t].logprob - want[i][t].logprob)
               for i, t in enumerate(prompt) if i) < 0.05  # spread: ~0.5


def test_min_tokens_holds_back_stop_ids(tiny_art):
    free = engine(tiny_art).generate([PROMPTS[0]], [GREEDY])[0].outputs[0].token_ids
    stop = free[2]  # the free run would stop at its third token
    p = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop], min_tokens=6)
    out = engine(tiny_art).generate([PROMPTS[0]], [p])[0]
    assert stop not in out.outputs[0].token_ids[:6] and out.outputs[0].token_ids[:2] == free[:2]
    assert out.outputs[0].finish_reason == ("stop" if len(out.outputs[0].token_ids) < 10 else "length")


def test_prompts_of_the_wrong_type_fail_alone(tiny_art):
    eng = engine(tiny_art)
    bad = [5, None, [1.5, 2], ["a"], [[1, 2]], [True, 3], {"x": 1}]
    outs = eng.generate([PROMPTS[0], *bad, (1, 2, 3)], [GREEDY] * (len(bad) + 2))
    assert outs[0].outputs[0].finish_reason == outs[-1].outputs[0].finish_reason == "length"  # a tuple of ids is a prompt too
    for o, want in zip(outs[1:-1], ["got int", "got NoneType", "holding float", "holding str", "holding list",
                                    "holding bool", "got dict"]):
        assert o.outputs[0].finish_reason == "error" and isinstance(o.error, ValueError), o
        assert str(o.error).startswith("prompt must be token ids") and want in str(o.error), o.error


def test_sliding_window_policy_releases_blocks_and_keeps_outputs(swa_model):
    """Mistral-style window 8, block size 4: at most 3-4 blocks per sequence stay held."""
    from tests.helpers import eager_step, greedy_with

    eng = engine(deepfuse.compile(swa_model), num_blocks=64)
    prompt = list(range(3, 23))
    held = []
    rid = eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    out = None
    while eng.has_unfinished():
        held.append(eng.kv.pool.num_used())
        fin = eng.step()
        out = fin[0] if fin else out
    assert out.request_id == rid
    want, _ = greedy_with(eager_step(swa_model), swa_model.config, prompt, 16)
    assert out.outputs[0].token_ids == want
    assert max(held[2:]) <= 4  # 20 + 16 tokens would need 9 blocks without the window policy


def test_sliding_window_prefix_cache_needs_only_the_windows_blocks(swa_model):
    """Window 8, blocks of 4: a request continuing a cached 40-token prefix reads only the
    prefix's last blocks, so it is served from the cache although the blocks before the window
    were freed as soon as the window passed them (no boundary needs them); outputs equal the
    cache-off run."""
    art = deepfuse.compile(swa_model)
    prefix = [(7 * i) % 120 for i in range(40)]
    prompts = [prefix + [100 + i, 3, 4] for i in range(4)]
    want = tokens(engine(art, cache={"enable_prefix_caching": False}).generate(prompts, [GREEDY] * 4))
    eng = engine(art, num_blocks=32)
    first = eng.generate(prompts[:1], [GREEDY])[0]
    assert first.outputs[0].token_ids == want[0] and first.num_cached_tokens == 0
    # the window policy released the prefix's early blocks while the request ran, unnamed: only
    # the windows before its prompt's boundary (43 tokens: blocks 8 and 9) and its end stay cached
    assert not eng.kv.pool.holds(block_hash(b"", prefix[:4]))  # the prefix's block 0 is gone
    assert eng.kv.usage()["blocks_cached_unused"] == 2 + 2 and eng.kv.pool.evictions == 0
    other = eng.generate([[1 + i % 50 for i in range(80)]], [SamplingParams(temperature=0, max_tokens=1)])[0]
    assert other.outputs[0].finish_reason == "length"
    computed = eng.stats.prompt_tokens_computed
    got = eng.generate(prompts[1:], [GREEDY] * 3)
    assert tokens(got) == want[1:]
    assert [o.num_cached_tokens for o in got] == [40] * 3  # 10 blocks, of which queries from 40 on read 8 and 9
    assert eng.stats.prompt_tokens_computed - computed == 3 * 3
    assert eng.kv.pool.num_used() == 0


def test_sliding_window_prefix_match_stops_where_the_windows_blocks_are_missing(swa_model):
    """The match is the longest run of whole blocks whose window is cached; a gap inside the
    window ends it there, and every block of the table it returns holds a reference."""
    eng = engine(deepfuse.compile(swa_model), num_blocks=32)
    kv = eng.kv
    toks = list(range(1, 42))  # 10 full blocks before the last token
    seq = kv.match_prefix(toks)
    assert seq.table == [] and seq.names == []
    kv.allocate(seq, toks, 40)  # all ten named, as a step that computes them would leave them
    kv.computed(seq, 40)  # the window policy keeps the blocks positions 33.. live in: 8 and 9
    assert seq.table[:8] == [-1] * 8 and min(seq.table[8:]) >= 0
    hit = kv.match_prefix(toks)
    assert len(hit.table) == 10 and hit.table[:8] == [-1] * 8 and hit.table[8:] == seq.table[8:]
    assert [kv.pool.refs[b] for b in hit.table[8:]] == [2, 2]
    kv.free(hit)
    kv.free(seq)
    kv.pool.allocate(kv.pool.num_available() - 1)  # evicts every cached block but the last released (8)
    assert kv.match_prefix(toks).table == []  # block 9 is gone, and no shorter prefix has its window cached


def test_sliding_window_sequences_may_outgrow_the_cache(swa_model):
    """Window 8, blocks of 4, an 8-token budget: a sequence holds at most 6 blocks, so a cache of
    6 blocks (24 tokens) runs two requests of 60-64 tokens, preempting one for the other, with
    the tokens eager decoding gives. A cache too small for that bound caps sequences as before."""
    from tests.helpers import eager_step, greedy_with

    art = deepfuse.compile(swa_model)
    eng = engine(art, num_blocks=6, max_num_tokens=8)
    assert eng.max_model_len == swa_model.config.max_position
    prompts = [[(5 * i + 1) % 120 for i in range(40)], [(3 * i + 2) % 120 for i in range(44)]]
    outs = eng.generate(prompts, [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2)
    for prompt, out in zip(prompts, outs):
        want, _ = greedy_with(eager_step(swa_model), swa_model.config, prompt, 20)
        assert out.outputs[0].finish_reason == "length" and out.outputs[0].token_ids == want
    assert eng.scheduler.num_preemptions > 0 and eng.kv.pool.num_used() == 0
    small = engine(art, num_blocks=5, max_num_tokens=8)
    assert small.max_model_len == 20
    assert small.generate([prompts[0]], [GREEDY])[0].outputs[0].finish_reason == "error"


@pytest.mark.parametrize("window,spec,overlap", [(False, False, False), (True, False, False), (False, True, False),
                                                 (False, False, True), (True, False, True)])
def test_random_workload_loses_nothing(tiny_art, swa_model, window, spec, overlap):
    """Many requests of random sizes, many sharing prefixes, greedy or seeded sampling, some with
    stop ids or logprobs, through a small cache, arriving over time, some aborted: every request
    ends exactly once, the pool comes back whole, and each completed request's tokens equal its
    run alone. With the sliding window too (prefix hits there come from the window's blocks
    alone), with speculative decoding (n-gram drafts verified in the step), and with the
    overlapped loop (runtime/overlap.py: decode steps launched before the last one is read)."""
    import random

    from deepfuse.runtime.spec import SpecConfig

    art = deepfuse.compile(swa_model) if window else tiny_art
    rng = random.Random(7)
    blocks = 12 if window else 24  # a window holds fewer blocks a sequence: a smaller cache still preempts
    drafts = SpecConfig(num_draft_tokens=3, schedule="fixed") if spec else None
    eng = engine(art, num_blocks=blocks, max_num_tokens=16, max_num_seqs=6, spec=drafts, overlap=overlap)
    bases = [[rng.randrange(128) for _ in range(24)] for _ in range(3)]

    def params() -> SamplingParams:
        kind = rng.choice(["greedy", "seeded", "stop", "logprobs"])
        n = rng.randint(1, 12)
        if kind == "seeded":
            return SamplingParams(temperature=0.8, top_k=rng.choice([0, 20]), max_tokens=n, seed=rng.randrange(99),
                                  ignore_eos=True)
        return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2 if kind == "logprobs" else None,
                              stop_token_ids=rng.sample(range(128), 12) if kind == "stop" else [])

    specs = [(rng.choice(bases)[:rng.randint(0, 24)] + [rng.randrange(128) for _ in range(rng.randint(1, 12))],
              params()) for _ in range(40)]
    pending = list(enumerate(specs))
    ids, ended, aborted = {}, {}, set()
    step = 0
    while pending or eng.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                i, (prompt, p) = pending.pop(0)
                ids[eng.add_request(prompt, p)] = i
        if step % 7 == 3 and eng.requests:
            rid = rng.choice(sorted(eng.requests))
            out = eng.abort(rid)
            assert out.outputs[0].finish_reason == "abort" and rid not in ended
            ended[rid] = out
            aborted.add(rid)
        for out in eng.step():
            assert out.request_id not in ended  # never finished twice
            ended[out.request_id] = out
        step += 1
    assert set(ended) == set(ids) and aborted and eng.scheduler.num_preemptions > 0
    assert eng.kv.pool.num_used() == 0 and eng.kv.pool.num_available() == blocks
    # prefix hits: each request's cached tokens at its first admission (whole blocks, never its last
    # token, never more than it shares with a request that arrived before it)
    assert eng.kv.stats.prefix_hits == sum(o.num_cached_tokens for o in ended.values()) > 0
    order = sorted(ended, key=lambda rid: ids[rid])
    for j, rid in enumerate(order):
        prompt = specs[ids[rid]][0]
        seen = {e: specs[ids[e]][0] + ended[e].outputs[0].token_ids for e in order[:j]}
        shared = max([next((i for i, (x, y) in enumerate(zip(prompt, seen[e])) if x != y), min(len(prompt), len(seen[e])))
                      for e in order[:j]],
                     default=0)
        n = ended[rid].num_cached_tokens
        assert n % 4 == 0 and n <= min(len(prompt) - 1, shared), (n, len(prompt), shared)
    if spec:
        assert 0 < eng.spec_stats.accepted <= eng.spec_stats.drafted
    assert (eng.stats.ahead_steps > 0) == overlap
    solo = engine(art, cache={"enable_prefix_caching": False})
    stopped = 0
    for rid, out in ended.items():
        if rid in aborted:
            continue
        prompt, p = specs[ids[rid]]
        alone = solo.generate([prompt], [p])[0]
        got, want = out.outputs[0], alone.outputs[0]
        assert (got.finish_reason, got.token_ids) == (want.finish_reason, want.token_ids)
        stopped += got.finish_reason == "stop"
        if p.logprobs:
            assert len(got.logprobs) == len(got.token_ids) and all(t in lp for t, lp in zip(got.token_ids, got.logprobs))
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(abs(a[k].logprob - b[k].logprob) < 1e-4 for k in a)
    assert stopped > 0


def test_cache_layers_are_zeroed_separate_and_on_huge_page_boundaries():
    import torch

    from deepfuse.runtime.block_pool import HUGE_PAGE, zeros_on_huge_pages
    from deepfuse.runtime.kv_cache import KVCache

    layers = zeros_on_huge_pages(3, (2, 5, 16, 3, 8), torch.bfloat16)
    assert [t.shape for t in layers] == [(2, 5, 16, 3, 8)] * 3 and all(t.dtype == torch.bfloat16 for t in layers)
    assert all(t.is_contiguous() and t.data_ptr() % HUGE_PAGE == 0 and not t.any() for t in layers)
    layers[1].fill_(2.5)
    assert not layers[0].any() and not layers[2].any() and bool((layers[1] == 2.5).all())
    cache = KVCache(4, 2, 8, torch.float32, CacheConfig(block_size=4, num_blocks=3))
    assert len({t.data_ptr() for t in cache.layers}) == 4 and all(t.shape == (2, 3, 4, 2, 8) for t in cache.layers)
