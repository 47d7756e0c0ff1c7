"""Decode bursts (runtime/decode_burst.py) on the CPU build: each request's outputs are the one-step
engine's (the reference: the same engine with decode_steps=1), the prefix cache names the same
blocks with the same KV, nothing leaks, the steps after the first rerun the executor's prepared
calls, and a fault inside a burst leaves the engine as if the burst never ran."""
import pytest

import deepfuse
from deepfuse.codegen.cpu.executor import CpuExecutor
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.batch import StepBuffers
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.spec import SpecConfig
from tests.runtime.test_interrupted_step import no_leaks
from tests.runtime.test_overlap import (
    EOS,
    PROMPTS,
    Letters,
    ending_params,
    llm_outcomes,
    outcome,
    same_prefix_cache,
    smollm2_ending_requests,
)


@pytest.fixture(scope="module")
def tiny_art(tiny_model):
    return deepfuse.compile(tiny_model)


def engine(art, decode_steps: int, num_blocks: int = 64, **kw) -> Engine:
    eng = Engine(art, CacheConfig(block_size=4, num_blocks=num_blocks), decode_steps=decode_steps, **kw)
    eng.tokenizer, eng.eos = Letters(), {EOS}
    return eng


@pytest.fixture
def reruns(monkeypatch) -> list:
    """Each executor rerun: True where it ran the prepared calls, False where it gave None."""
    log, real = [], CpuExecutor.rerun

    def rerun(self, inputs):
        out = real(self, inputs)
        log.append(out is not None)
        return out

    monkeypatch.setattr(CpuExecutor, "rerun", rerun)
    return log


@pytest.mark.parametrize("steps", [2, 5])
def test_bursts_give_the_one_step_outputs_and_prefix_cache(tiny_art, reruns, steps):
    """Greedy and seeded requests ending at different steps by max_tokens, a stop id, EOS and stop
    strings (kept in the text or not): the same outputs, tokens generated and named KV."""
    params = ending_params(tiny_art)
    runs = {}
    for k in (1, steps):
        eng = engine(tiny_art, k)
        runs[k] = eng, [outcome(o) for o in eng.generate(PROMPTS, params)]
    (one, want), (burst, got) = runs[1], runs[steps]
    assert got == want
    assert {o[2] for o in want} == {"length", "stop"} and len({len(o[1]) for o in want}) >= 4
    assert burst.stats.burst_steps > 0 and one.stats.burst_steps == 0
    assert burst.stats.tokens_generated == one.stats.tokens_generated
    assert any(reruns) and all(reruns)  # the steps after a burst's first ran the prepared calls again
    no_leaks(burst)
    same_prefix_cache(burst, one)


def test_a_wrong_feed_is_caught(tiny_art, monkeypatch):
    """The comparison has teeth: a burst whose later steps feed each row another row's token
    changes the outputs."""
    real = StepBuffers.advance_decode
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * 3
    want = [o.outputs[0].token_ids for o in engine(tiny_art, 1).generate(PROMPTS[:3], params)]
    monkeypatch.setattr(StepBuffers, "advance_decode", lambda self, tokens: real(self, tokens[::-1]))
    got = [o.outputs[0].token_ids for o in engine(tiny_art, 4).generate(PROMPTS[:3], params)]
    assert got != want


def test_a_burst_is_cut_to_the_fewest_tokens_left_and_ends_once_every_request_has_stopped(tiny_art):
    """max_tokens 6 with 4 steps a burst: the prefill step's token, then bursts of 4 and 1. Two
    greedy requests that sample a stop id at different steps of one burst: the burst runs until
    the later one has stopped and no further, as many steps as one step at a time."""
    eng = engine(tiny_art, 4)
    out = eng.generate([PROMPTS[0]], [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)])[0]
    assert len(out.outputs[0].token_ids) == 6
    assert (eng.stats.steps, eng.stats.burst_steps) == (3 + 3, 3)  # prefill, burst of 4 (3 after the first), 1
    free = [o.outputs[0].token_ids for o in engine(tiny_art, 1).generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PROMPTS))]
    # a request and the token it stops at: the first time it samples that token, at different steps
    cuts = {}
    for i, toks in enumerate(free):
        cut = next((toks.index(t) for t in toks[1:7] if toks.index(t) > 0 and toks.index(t) not in cuts), None)
        if cut is not None:
            cuts[cut] = i
    (early, a), (late, b) = sorted(cuts.items())[:2]
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[i][cut]], ignore_eos=True)
              for i, cut in ((a, early), (b, late))]
    runs = {}
    for k in (1, 8):
        eng = engine(tiny_art, k)
        runs[k] = [o.outputs[0].token_ids for o in eng.generate([PROMPTS[a], PROMPTS[b]], params)], eng.stats
    assert runs[8][0] == runs[1][0] == [free[a][:early + 1], free[b][:late + 1]]
    assert runs[8][1].steps == runs[1][1].steps == 1 + late  # the prefill step, then steps up to the later stop
    assert runs[8][1].burst_steps == late - 1


@pytest.mark.parametrize("why", ["drafts", "penalty", "logprobs", "waiting request"])
def test_steps_that_need_the_host_between_them_do_not_burst(tiny_art, why):
    kw = {"penalty": dict(repetition_penalty=1.2), "logprobs": dict(logprobs=1)}.get(why, {})
    spec = SpecConfig(num_draft_tokens=2, schedule="fixed") if why == "drafts" else None
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kw)] * 3
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 9, 9, 9], [1, 2, 3]]
    runs = {}
    for k in (1, 4):
        eng = engine(tiny_art, k, spec=spec, max_num_seqs=2 if why == "waiting request" else 64)
        runs[k] = [outcome(o) for o in eng.generate(prompts, params)], eng
    assert runs[4][0] == runs[1][0]
    if why == "waiting request":  # the third request waits for a slot until the first two finish
        assert 0 < runs[4][1].stats.burst_steps < 7 + 7
    else:
        assert runs[4][1].stats.burst_steps == 0
    no_leaks(runs[4][1])


def test_a_tight_cache_runs_one_step_at_a_time(tiny_art):
    """Blocks for a burst's positions are not at hand: the steps run one by one, the scheduler
    preempts, and every request's tokens are those it gets alone."""
    prompts = [[(5 * i + j) % 128 for j in range(6 + i)] for i in range(6)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.7, seed=i, max_tokens=10, ignore_eos=True) for i in range(6)]
    eng = engine(tiny_art, 4, num_blocks=14, max_num_tokens=16)
    got = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
    alone = engine(tiny_art, 1)
    assert got == [alone.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert eng.scheduler.num_preemptions > 0 and 0 < eng.stats.burst_steps
    no_leaks(eng)


@pytest.mark.parametrize("at", [1, 3])
def test_a_fault_inside_a_burst_undoes_it(tiny_art, monkeypatch, at):
    """An exception in the burst's step `at` (after the first): step() raises, no request took a
    token or kept a block of the burst, and the engine then gives the one-step outputs."""
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=7, ignore_eos=True)]
    want = [outcome(o) for o in engine(tiny_art, 1).generate(PROMPTS[:2], params)]
    eng = engine(tiny_art, 4)
    rids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS[:2], params)]
    eng.step()  # the prompts
    real, calls = eng.model.rerun, []

    def rerun(inputs):
        calls.append(1)
        if len(calls) == at:
            raise KeyboardInterrupt
        return real(inputs)

    monkeypatch.setattr(eng.model, "rerun", rerun)
    before = [(list(eng.requests[r].tokens), eng.requests[r].computed, [list(t) for t in eng.requests[r].kv.tables])
              for r in rids]
    used = eng.kv.usage()["blocks_used"]
    with pytest.raises(KeyboardInterrupt):
        eng.step()
    assert [(list(eng.requests[r].tokens), eng.requests[r].computed, [list(t) for t in eng.requests[r].kv.tables])
            for r in rids] == before
    assert eng.kv.usage()["blocks_used"] == used and not eng.kv.pool.pending
    assert (eng.stats.steps, eng.stats.burst_steps) == (1, 0)  # the prompts' step alone
    monkeypatch.undo()
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: outcome(o) for o in eng.step()})
    assert [done[r][1:] for r in rids] == [w[1:] for w in want]
    no_leaks(eng)


def test_steps_the_executor_cannot_rerun_run_as_new_calls(tiny_art, monkeypatch):
    """Where the executor gives None for a rerun (its last call did not run bound to its end, or a
    guard fails) and where the buffers cannot advance (graphed buckets, cuda_graphs=True: each
    step a padded bucket), a burst's later steps run as new model calls: the same tokens."""
    params = [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=4, max_tokens=7, ignore_eos=True)]
    want = [outcome(o)[1:] for o in engine(tiny_art, 1).generate(PROMPTS[:2], params)]
    calls = []
    real = CpuExecutor.__call__
    monkeypatch.setattr(CpuExecutor, "__call__", lambda self, inputs: calls.append(1) or real(self, inputs))
    monkeypatch.setattr(CpuExecutor, "rerun", lambda self, inputs: None)
    eng = engine(tiny_art, 4)
    assert [outcome(o)[1:] for o in eng.generate(PROMPTS[:2], params)] == want
    assert eng.stats.burst_steps > 0 and len(calls) == eng.stats.steps
    monkeypatch.undo()
    eng = engine(tiny_art, 4, cuda_graphs=True)
    assert [outcome(o)[1:] for o in eng.generate(PROMPTS[:2], params)] == want
    assert eng.stats.burst_steps > 0
    no_leaks(eng)


def test_a_sliding_window_model_keeps_the_one_step_prefix_cache(swa_model):
    """Mistral-style window 8, blocks of 4: a request that ends inside a burst another request
    keeps going hands its blocks back named as one step at a time does (the window policy runs
    on the positions it computed up to its last token, not on the burst's)."""
    art = deepfuse.compile(swa_model)
    prompts = [list(range(3, 23)), list(range(40, 52))]
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    free = [o.outputs[0].token_ids for o in engine(art, 1).generate(prompts, [plain] * 2)]
    cut = next(i for i in range(8, 14) if free[0].index(free[0][i]) == i)  # past the prompt's blocks: named ones
    params = [SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[free[0][cut]], ignore_eos=True), plain]
    runs = {}
    for k in (1, 16):
        eng = engine(art, k)
        runs[k] = [o.outputs[0].token_ids for o in eng.generate(prompts, params)], eng
    assert runs[16][0] == runs[1][0] == [free[0][:cut + 1], free[1]]
    assert runs[16][1].stats.burst_steps > 0
    no_leaks(runs[16][1])
    same_prefix_cache(runs[16][1], runs[1][1])


def test_decode_steps_is_checked_and_excludes_overlap(tiny_art):
    with pytest.raises(DeepfuseError, match="decode_steps must be an integer >= 1"):
        engine(tiny_art, 0)
    with pytest.raises(DeepfuseError, match="choose one"):
        engine(tiny_art, 4, overlap=True)


def test_llm_takes_decode_steps_and_the_sharded_engine_refuses_it():
    from deepfuse import LLM

    with pytest.raises(DeepfuseError, match="decode_steps > 1 runs in one process"):
        LLM("smollm2", tensor_parallel_size=2, decode_steps=4)


def test_smollm2_with_its_tokenizer_eos_and_stop_strings_in_bursts(smollm2_compiled, reruns):
    """The real SmolLM2 (f32) and tokenizer through LLM(decode_steps=4): chat prompts that end at EOS,
    stop strings (kept in the text and not), max_tokens and a seeded request give the one-step
    LLM's token ids, texts and finish reasons, the later steps of its bursts rerun."""
    from deepfuse import LLM

    prompts, params = smollm2_ending_requests(smollm2_compiled.tokenizer)
    runs = {}
    for k in (1, 4):
        llm = LLM(smollm2_compiled, num_blocks=64, decode_steps=k)  # a small cache: quick to make
        runs[k] = llm_outcomes(llm, prompts, params)
        if k > 1:
            assert llm.engine.stats.burst_steps > 0 and any(reruns) and all(reruns)
            no_leaks(llm.engine)
    assert runs[4] == runs[1]
    assert [r[2:] for r in runs[4][:4]] == [("stop", None)] * 2 + [("stop", "color model"), ("stop", "RGB")]
