"""The overlapped engine loop (runtime/overlap.py) on the CPU build: each request's outputs, and the
step() call it comes back from, are the synchronous engine's (the reference: the same engine with
overlap off); rows of requests that finished are dropped without leaking blocks or naming
their KV; requests that need their tokens on the host run synchronously."""
import random

import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.runtime import overlap as overlap_module
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.spec import SpecConfig
from tests.runtime.test_interrupted_step import no_leaks

PROMPTS = [[5, 17, 99, 3, 42], [7, 64, 1], [9, 11, 23, 31, 40, 2, 8, 8, 8], [8, 77], [101, 6, 6, 6, 6, 6, 6], [33]]
EOS = 3  # the stand-in tokenizer's


@pytest.fixture(scope="module")
def tiny_art(tiny_model):
    return deepfuse.compile(tiny_model)


class Letters:
    """A stand-in tokenizer: token t reads as the letter chr(97 + t % 26)."""

    eos_ids = [EOS]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    @property
    def backend(self):
        return self


def engine(art, overlap: bool, num_blocks: int = 64, **kw) -> Engine:
    eng = Engine(art, CacheConfig(block_size=4, num_blocks=num_blocks), overlap=overlap, **kw)
    eng.tokenizer, eng.eos = Letters(), {EOS}
    return eng


def outcome(out) -> tuple:
    c = out.outputs[0]
    lps = [sorted((t, round(lp.logprob, 4)) for t, lp in d.items()) for d in c.logprobs or []]
    return out.request_id, c.token_ids, c.finish_reason, c.stop_reason, c.text, lps


def named_kv(eng: Engine) -> dict:
    """{prefix-cache name: its block's k/v in every layer}."""
    return {name: [layer[:, b] for layer in eng.cache.layers] for name, b in eng.kv.pool.by_name.items()}


def same_prefix_cache(a: Engine, b: Engine) -> None:
    """The same blocks named, each holding the same KV."""
    ka, kb = named_kv(a), named_kv(b)
    assert ka.keys() == kb.keys()
    for name in ka:
        for x, y in zip(ka[name], kb[name]):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def ending_params(art) -> list[SamplingParams]:
    """Requests that end at different steps, for reasons picked from the synchronous greedy run:
    max_tokens, a stop id, EOS, a stop string (kept in the text or not), seeded sampling."""
    free = [o.outputs[0].token_ids for o in engine(art, False).generate(
        PROMPTS, [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * len(PROMPTS))]
    letters = Letters().decode
    return [SamplingParams(temperature=0, max_tokens=3),
            SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[free[1][4]], ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=12, stop=[letters(free[2][5:7])]),
            SamplingParams(temperature=0, max_tokens=12, stop=[letters(free[3][2:3])], include_stop_str_in_output=True),
            SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=9),
            SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=12)]


def test_greedy_seeded_and_stopping_requests_give_the_synchronous_outputs(tiny_art):
    """Each finish reason, at different steps; and EOS in every output but the first (ignore_eos
    off): the engines agree on outputs, statistics and the prefix cache, and nothing leaks."""
    params = ending_params(tiny_art)
    runs = {}
    for overlap in (False, True):
        eng = engine(tiny_art, overlap)
        runs[overlap] = eng, [outcome(o) for o in eng.generate(PROMPTS, params)]
    (sync, want), (over, got) = runs[False], runs[True]
    assert got == want
    assert {o[2] for o in want} == {"length", "stop"} and len({len(o[1]) for o in want}) >= 4
    assert over.stats.ahead_steps > 0 and sync.stats.ahead_steps == 0
    assert (over.stats.steps, over.stats.tokens_computed) == (sync.stats.steps, sync.stats.tokens_computed)
    no_leaks(over)
    same_prefix_cache(over, sync)


def drive(eng: Engine, script: list, abort_at: dict) -> list:
    """Adds script[i]'s requests before call i and aborts abort_at[i]'s after it; returns what each
    call gave back (and each abort)."""
    log, call = [], 0
    while call < len(script) or eng.has_unfinished():
        for prompt, p, rid in script[call] if call < len(script) else []:
            eng.add_request(prompt, p, rid)
        log.append(sorted(outcome(o) for o in eng.step()))
        for rid in abort_at.get(call, []):
            out = eng.abort(rid)
            log.append(outcome(out) if out is not None else None)
        log.append(settled(eng))
        call += 1
    return log


def settled(eng: Engine) -> list:
    """Each running request's tokens and computed positions, and the waiting queue."""
    return [(r.request_id, list(r.tokens), r.computed) for r in eng.scheduler.running] + \
        [r.request_id for r in eng.scheduler.waiting]


def workload(seed: int) -> tuple[list, dict]:
    """14 requests queued at once (admitted as budget and sequence slots allow): greedy, seeded,
    stop ids, and requests the host samples or that ask for logprobs (synchronous steps while
    they run); aborts after calls 5 and 9."""
    rng = random.Random(seed)

    def params(kind: str) -> SamplingParams:
        n = rng.randint(4, 16) if kind in ("greedy", "seeded", "stop") else rng.randint(1, 4)
        if kind == "seeded":
            return SamplingParams(temperature=0.9, top_k=rng.choice([0, 20]), seed=rng.randrange(99), max_tokens=n)
        extra = {"stop": dict(stop_token_ids=rng.sample(range(128), 10)), "logprobs": dict(logprobs=2),
                 "penalty": dict(repetition_penalty=1.3), "min": dict(min_tokens=min(n, 3), stop_token_ids=[EOS]),
                 "prompt_logprobs": dict(prompt_logprobs=1)}.get(kind, {})
        return SamplingParams(temperature=0, max_tokens=n, **extra)

    kinds = ["greedy", "seeded", "stop"] * 3 + ["logprobs", "penalty", "min", "prompt_logprobs"]
    requests = [([rng.randrange(128) for _ in range(rng.randint(1, 14))], params(rng.choice(kinds)), f"r{i}")
                for i in range(14)]
    return [requests], {5: ["r1", "r4"], 9: ["r6", "r12"]}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_mixed_workload_gives_each_call_the_synchronous_outputs(tiny_art, seed):
    """More requests than sequence slots, some that need their tokens on the host, some aborted
    mid-run: every step() call returns what the synchronous engine's returns, every abort the same
    output, and the requests stand alike after each call. (Requests added while a step is in
    flight come a call later: test_engine.py's random workload checks those against runs alone.)"""
    script, aborts = workload(seed)
    logs, engines = {}, {}
    for overlap in (False, True):
        engines[overlap] = eng = engine(tiny_art, overlap, num_blocks=256, max_num_tokens=16, max_num_seqs=4)
        logs[overlap] = drive(eng, script, aborts)
    assert logs[True] == logs[False]
    over = engines[True]
    assert 0 < over.stats.ahead_steps < over.stats.steps  # some steps went ahead, some waited for tokens
    assert sum(1 for entry in logs[True] if isinstance(entry, tuple) and entry[2] == "abort") >= 2
    no_leaks(over)
    same_prefix_cache(over, engines[False])


def test_a_tight_cache_falls_back_and_preempts_as_synchronously(tiny_art):
    """A cache that runs short: steps whose blocks are not at hand wait for their tokens, the scheduler
    preempts, and every request's tokens are those it gets alone."""
    prompts = [[(5 * i + j) % 128 for j in range(6 + i)] for i in range(6)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.7, seed=i, max_tokens=10, ignore_eos=True) for i in range(6)]
    eng = engine(tiny_art, True, num_blocks=14, max_num_tokens=16)
    got = [o.outputs[0].token_ids for o in eng.generate(prompts, params)]
    alone = engine(tiny_art, False)
    assert got == [alone.generate([p], [sp])[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    assert eng.scheduler.num_preemptions > 0 and 0 < eng.stats.ahead_steps < eng.stats.steps
    no_leaks(eng)


@pytest.mark.parametrize("why", ["drafts", "penalty", "logprobs", "structured-like: allowed ids"])
def test_requests_that_need_their_tokens_on_the_host_run_synchronously(tiny_art, why):
    kw = {"drafts": {}, "penalty": dict(repetition_penalty=1.2), "logprobs": dict(logprobs=1),
          "structured-like: allowed ids": dict(allowed_token_ids=list(range(0, 128, 3)))}[why]
    spec = SpecConfig(num_draft_tokens=2, schedule="fixed") if why == "drafts" else None
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, **kw)] * 3
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 9, 9, 9], [1, 2, 3]]
    runs = {}
    for overlap in (False, True):
        eng = engine(tiny_art, overlap, spec=spec)
        runs[overlap] = [outcome(o) for o in eng.generate(prompts, params)], eng
    assert runs[True][0] == runs[False][0]
    assert runs[True][1].stats.ahead_steps == 0
    no_leaks(runs[True][1])


def test_the_host_never_has_an_ahead_steps_tokens_and_reads_one_step_behind(tiny_art, monkeypatch):
    """An ahead step's chunks carry placeholder tokens (0): its tokens come from the feed alone; each
    step's tokens are read only after the next step was launched."""
    events, real_forward, real_tokens = [], Engine.forward, overlap_module.InFlight.tokens

    def forward(self, chunks, tokens=None):
        events.append(("launch", tokens is not None, [c.tokens for c in chunks]))
        return real_forward(self, chunks, tokens)

    def tokens(self):
        events.append(("read",))
        return real_tokens(self)

    monkeypatch.setattr(Engine, "forward", forward)
    monkeypatch.setattr(overlap_module.InFlight, "tokens", tokens)
    eng = engine(tiny_art, True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in eng.generate(PROMPTS[:3], [params] * 3)]
    monkeypatch.undo()
    assert got == [o.outputs[0].token_ids for o in engine(tiny_art, False).generate(PROMPTS[:3], [params] * 3)]
    kinds = [e[0] if e[0] == "read" else "ahead" if e[1] else "launch" for e in events]
    assert kinds == ["launch"] + ["ahead", "read"] * 5 + ["read"]  # 6 tokens: the prefill step, 5 decode steps
    assert all(e[2] == [[0]] * 3 for e in events if e[0] == "launch" and e[1])


def test_a_wrong_feed_is_caught(tiny_art, monkeypatch):
    """The comparison has teeth: feeding each row another row's token changes the outputs."""
    real = overlap_module.TokenFeed.__call__
    monkeypatch.setattr(overlap_module.TokenFeed, "__call__", lambda self, last, rows: real(self, last, rows[::-1]))
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 3
    got = [o.outputs[0].token_ids for o in engine(tiny_art, True).generate(PROMPTS[:3], params)]
    monkeypatch.undo()
    assert got != [o.outputs[0].token_ids for o in engine(tiny_art, False).generate(PROMPTS[:3], params)]


def test_llm_takes_overlap_and_the_sharded_engine_refuses_it():
    from deepfuse import LLM

    with pytest.raises(DeepfuseError, match="does not support overlap"):
        LLM("smollm2", tensor_parallel_size=2, overlap=True)


def smollm2_ending_requests(tok) -> tuple[list[list[int]], list[SamplingParams]]:
    """Six SmolLM2 requests that end each way: two chat prompts at EOS (after 5 and 13 greedy
    tokens), stop strings kept in the text and not, max_tokens, and a seeded sampled one."""
    chat = [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n")
            for q in ("Reply with the single word hello.", "Say yes once.")]
    prompts = chat + [tok.encode("The three primary colors are")] * 2 + [tok.encode("Once upon a time")] * 2
    params = [SamplingParams(temperature=0, max_tokens=16)] * 2 + [
        SamplingParams(temperature=0, max_tokens=16, stop=["color model"]),
        SamplingParams(temperature=0, max_tokens=16, stop=["RGB"], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=5),
        SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_tokens=9)]
    return prompts, params


def llm_outcomes(llm, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple]:
    """Each request's (token ids, text, finish reason, stop reason) from llm.generate."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in (o.outputs[0] for o in outs)]


def test_smollm2_with_its_tokenizer_eos_and_stop_strings_overlapped(smollm2_compiled):
    """The real SmolLM2 (f32) and tokenizer through LLM(overlap=True): chat prompts that end at EOS,
    a stop string (kept in the text and not), max_tokens and a seeded request give the
    synchronous LLM's token ids, texts and finish reasons, with the decode steps launched ahead."""
    from deepfuse import LLM

    prompts, params = smollm2_ending_requests(smollm2_compiled.tokenizer)
    runs = {}
    for overlap in (False, True):
        llm = LLM(smollm2_compiled, num_blocks=64, overlap=overlap)  # a small cache: quick to make
        runs[overlap] = llm_outcomes(llm, prompts, params)
        if overlap:
            assert llm.engine.stats.ahead_steps > 0
            no_leaks(llm.engine)
    assert runs[True] == runs[False]
    assert [r[2:] for r in runs[True][:4]] == [("stop", None)] * 2 + [("stop", "color model"), ("stop", "RGB")]
    assert len({len(r[0]) for r in runs[True]}) >= 5  # EOS after 5 and 13 tokens, stop strings, max_tokens
