"""A step interrupted by an exception or Ctrl-C leaves the KV cache and the queues as if it
never ran: no block is found by prefix lookup before the step that writes it completes, no
block leaks, and the same prompts then give the tokens a fresh engine gives. With the overlapped
loop too (runtime/overlap.py; the fresh engine, the reference, is synchronous): a fault while a
step is launched ahead, fed, or while the last step's tokens are awaited or taken."""
import pytest

import deepfuse
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.spec import SpecConfig

LONG = [(7 * i + 3) % 120 for i in range(29)]  # 7 full blocks of 4 and a token
REPEATS = [5, 6, 7, 8] * 6  # the n-gram drafter finds drafts that verify
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_art(tiny_model):
    return deepfuse.compile(tiny_model)


class Interrupt(BaseException):
    """Stands for Ctrl-C (a BaseException, like KeyboardInterrupt)."""


class FailingModel:
    """Wraps a CompiledModel; its call (or its rerun of the last call) raises on the first step
    for which when(inputs) holds (once): before running anything, or with after=True once the
    step has written its KV. fired: False, then "call" or "rerun".
    Everything else is the model's."""

    def __init__(self, model, when, error=Interrupt, after=False, paths=("call", "rerun")):
        self.model, self.when, self.error, self.after, self.fired = model, when, error, after, False
        self.paths = paths  # where it may fire: the model's call, its rerun of the last call (or both)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs):
        return self._run(self.model, inputs)

    def rerun(self, inputs):
        """The engine's one-step decode reruns the last call's prepared calls: faults go there too."""
        return self._run(self.model.rerun, inputs, "rerun")

    def _run(self, call, inputs, how="call"):
        if not self.fired and how in self.paths and self.when(inputs):
            out = call(inputs) if self.after else None
            if how == "rerun" and self.after and out is None:
                return None  # nothing ran: the engine calls the model afresh (the fault comes there)
            self.fired = how
            raise self.error("injected fault")
        return call(inputs)


def engine(art, **kw):
    return Engine(art, CacheConfig(block_size=4, num_blocks=64), max_num_tokens=kw.pop("max_num_tokens", 64), **kw)


def prefill_chunk(inputs) -> bool:
    return int(inputs["query_lens"].max()) > 1 and int(inputs["positions"][0]) > 0  # a later chunk of a prompt


def decode_step(inputs) -> bool:
    return int(inputs["query_lens"].max()) == 1 and int(inputs["positions"][0]) > 30


def verify_step(inputs) -> bool:
    return len(inputs["sample_rows"]) > len(inputs["query_lens"])  # some chunk samples drafts


def any_step(inputs) -> bool:
    return True


def no_leaks(eng: Engine) -> None:
    use = eng.kv.usage()
    assert use["blocks_used"] == 0 and use["blocks_free"] + use["blocks_cached_unused"] == use["blocks_total"]
    assert not eng.kv.pool.pending


CASES = {  # name: (fault condition, prompts, params, engine settings)
    "prefill chunk": (prefill_chunk, [LONG, LONG[:13]], GREEDY, {"max_num_tokens": 8}),
    "decode step": (decode_step, [LONG, REPEATS], GREEDY, {}),
    "verify step": (verify_step, [REPEATS, LONG], GREEDY, {"spec": SpecConfig(num_draft_tokens=3, schedule="fixed")}),
    "n > 1": (any_step, [LONG], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True), {}),
    "first step, an exception": (any_step, [LONG, LONG], GREEDY, {}),
}


def all_tokens(outs):
    return [[s.token_ids for s in o.outputs] for o in outs]


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("case", CASES)
def test_generate_after_an_interrupted_step_gives_the_fresh_engines_tokens(tiny_art, case, overlap):
    when, prompts, params, kw = CASES[case]
    want = all_tokens(engine(tiny_art, **kw).generate(prompts, [params] * len(prompts)))
    eng = engine(tiny_art, overlap=overlap, **kw)
    eng.model = FailingModel(eng.model, when, RuntimeError if "exception" in case else Interrupt)
    with pytest.raises((RuntimeError, Interrupt), match="injected"):
        eng.generate(prompts, [params] * len(prompts))
    assert eng.model.fired and not eng.has_unfinished()
    no_leaks(eng)
    assert all_tokens(eng.generate(prompts, [params] * len(prompts))) == want
    no_leaks(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("after", [False, True], ids=["before the kernels", "after the kernels"])
@pytest.mark.parametrize("case", CASES)
def test_stepping_on_after_a_failed_step_continues_as_if_it_never_ran(tiny_art, case, after, overlap):
    """Engine.step raising leaves every request where it was: stepping on gives a fresh engine's
    tokens, whether the failed step wrote its KV or not."""
    when, prompts, params, kw = CASES[case]
    params = params if params.n == 1 else SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    want = all_tokens(engine(tiny_art, **kw).generate(prompts, [params] * len(prompts)))
    eng = engine(tiny_art, overlap=overlap, **kw)
    eng.model = FailingModel(eng.model, when, after=after)
    ids = [eng.add_request(p, params) for p in prompts]
    done, failures = {}, 0
    while eng.has_unfinished():
        try:
            outs = eng.step()
        except Interrupt:
            failures += 1
            continue
        done.update((o.request_id, o) for o in outs)
    assert failures == 1
    assert [[done[i].outputs[0].token_ids] for i in ids] == want
    no_leaks(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_on_token_raising_leaves_a_cache_that_serves_correct_prefixes(tiny_art, overlap):
    want = all_tokens(engine(tiny_art).generate([LONG, REPEATS], [GREEDY] * 2))
    eng = engine(tiny_art, overlap=overlap)

    def on_token(i: int, tok: int) -> None:
        raise Interrupt("injected in on_token")

    with pytest.raises(Interrupt):
        eng.generate([LONG, REPEATS], [GREEDY] * 2, on_token)
    no_leaks(eng)
    again = eng.generate([LONG, REPEATS], [GREEDY] * 2)
    assert all_tokens(again) == want
    assert again[0].num_cached_tokens == 28  # the completed prefill's 7 full blocks are found, and are right
    no_leaks(eng)


def test_a_block_is_found_by_prefix_lookup_only_after_its_step_completes(tiny_art):
    eng = engine(tiny_art)
    eng.add_request(LONG, GREEDY)
    scheduled = eng.scheduler.schedule()  # allocates and names the prompt's blocks, runs nothing
    assert scheduled and eng.kv.pool.pending
    other = eng.kv.match_prefix(LONG)  # within the step (same-step sharing): the pending names are seen
    assert len(other.table) == 7
    eng.kv.free(other)
    eng.kv.discard_pending()  # the step failed
    assert eng.kv.match_prefix(LONG).table == []


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("case", ["decode step", "verify step"])
def test_an_error_while_a_step_s_tokens_are_taken_leaves_requests_that_continue(tiny_art, case, monkeypatch, overlap):
    """An error (a tokenizer's, a Ctrl-C) while the step's tokens are appended: the step ran, so
    its blocks stay named; the request keeps what it took and continues to a fresh engine's tokens."""
    _, prompts, params, kw = CASES[case]
    want = all_tokens(engine(tiny_art, **kw).generate(prompts, [params] * len(prompts)))
    eng = engine(tiny_art, overlap=overlap, **kw)
    real, calls = eng._append, []

    def append(req, tok, now, logprobs):
        calls.append(tok)
        if len(calls) == 5:
            raise Interrupt("injected while appending")
        real(req, tok, now, logprobs)

    monkeypatch.setattr(eng, "_append", append)
    ids = [eng.add_request(p, params) for p in prompts]
    done, failures = {}, 0
    while eng.has_unfinished():
        try:
            done.update((o.request_id, o) for o in eng.step())
        except Interrupt:
            failures += 1
    assert failures == 1 and [[done[i].outputs[0].token_ids] for i in ids] == want
    no_leaks(eng)


def test_an_error_while_scheduling_is_undone(tiny_art, monkeypatch):
    """schedule() itself raising, after it admitted requests and took blocks, is undone too."""
    want = all_tokens(engine(tiny_art).generate([LONG, REPEATS], [GREEDY] * 2))
    eng = engine(tiny_art)
    real, calls = eng.kv.allocate, []

    def allocate(seq, tokens, num_tokens):
        calls.append(num_tokens)
        if len(calls) == 2:  # the second request's admission: after the first was admitted
            raise Interrupt("injected in allocate")
        real(seq, tokens, num_tokens)

    monkeypatch.setattr(eng.kv, "allocate", allocate)
    ids = [eng.add_request(p, GREEDY) for p in (LONG, REPEATS)]
    with pytest.raises(Interrupt):
        eng.step()
    assert eng.kv.usage()["blocks_used"] == 0 and not eng.kv.pool.pending and not eng.scheduler.running
    monkeypatch.undo()
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step())
    assert [[done[i].outputs[0].token_ids] for i in ids] == want
    no_leaks(eng)


def test_names_only_blocks_whose_kv_a_completed_step_wrote(tiny_model):
    """A draft model's blocks are reserved, not named: a decoding request that a step's budget
    leaves out (its drafts reserved a block holding its last, uncomputed token) has no block
    found by prefix lookup before the target computes it."""
    target, draft = deepfuse.compile(tiny_model), deepfuse.compile(tiny_model.first_layers(1))
    spec = SpecConfig(method="draft", num_draft_tokens=3, schedule="fixed")
    eng = Engine(target, CacheConfig(block_size=4, num_blocks=64), max_num_tokens=4, spec=spec, draft_model=draft)
    for p in ([1], [9, 8, 7], [42, 43]):  # both decode after one step; then drafts fill the budget, [9, 8, 7, t] waits
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    skipped = 0
    while eng.has_unfinished():
        decoding = {id(r): r.computed for r in eng.scheduler.running if r.remaining == 1}
        eng.step()
        for req in eng.scheduler.running:
            skipped += decoding.get(id(req)) == req.computed  # decoding, but not scheduled this step
            for i, name in enumerate(req.kv.names):
                if eng.kv.pool.by_name.get(name) == req.kv.table[i]:
                    assert (i + 1) * 4 <= req.computed, f"block {i} named before its KV was computed"
    assert skipped > 0  # the budget did leave decoding requests out


def test_smollm2_prompt_after_a_ctrl_c_in_its_first_step(smollm2_compiled):
    """The reported reproduction: Ctrl-C in the first model call of a generate, then the same prompt."""
    from deepfuse import LLM

    prompt = "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of " \
             "Constantinople. " * 3
    params = SamplingParams(temperature=0, max_tokens=12)
    want = LLM(smollm2_compiled).generate(prompt, params)[0]
    llm = LLM(smollm2_compiled)
    llm.engine.model = FailingModel(llm.engine.model, any_step, KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt, params)
    out = llm.generate(prompt, params)[0]
    assert out.outputs[0].token_ids == want.outputs[0].token_ids and out.outputs[0].text == want.outputs[0].text
    assert out.num_cached_tokens == 0  # nothing was written, so nothing is found
    no_leaks(llm.engine)


def standing(eng: Engine) -> tuple:
    """(settled, raw): where the requests and the pool stand with the step in flight (overlap) left
    out: each running request's tokens, computed positions, table sizes (an ahead step's rows:
    before it) and block names, the waiting queue, blocks in use (less the ahead step's), names
    and pending names; and the table sizes and blocks in use as they are."""
    flight = eng.overlap.inflight if eng.overlap else None
    before = {}
    if flight is not None:
        before = {id(r): b for (r, _), b in zip(flight.step.scheduled, flight.before) if not r.finish}
    reqs, extra = [], 0
    for r in eng.scheduler.running:
        sizes = before.get(id(r), [len(t) for t in r.kv.tables])
        extra += sum(len(t) - n for t, n in zip(r.kv.tables, sizes))
        reqs.append((r.request_id, list(r.tokens), r.computed, sizes, list(r.kv.names)))
    pool = eng.kv.pool
    settled = reqs, [r.request_id for r in eng.scheduler.waiting], eng.kv.num_used() - extra, set(pool.by_name), \
        set(pool.pending)
    return settled, ([[len(t) for t in r.kv.tables] for r in eng.scheduler.running], eng.kv.num_used())


def as_before(eng: Engine, before: tuple) -> bool:
    """Whether eng stands as `before` (standing()): settled alike, and where a step is still in
    flight (the one launched before the failed call), its blocks too."""
    now = standing(eng)
    return now[0] == before[0] and (eng.overlap.inflight is None or now[1] == before[1])


def arm_at_a_new_block(eng: Engine, done: dict) -> None:
    """Steps until a step is in flight and the one after it needs a fresh block for some request."""
    while not (eng.overlap.inflight is not None and any(
            eng.kv.blocks_needed(r.kv, len(r.tokens) + 1) for r in eng.scheduler.running)):
        done.update((o.request_id, o) for o in eng.step())


class Once:
    """Makes cls.name raise Interrupt on its next call once armed (after the real call with after=True)."""

    def __init__(self, monkeypatch, cls, name: str, after: bool = False):
        self.armed, real = False, getattr(cls, name)

        def call(*args, **kw):
            if not self.armed:
                return real(*args, **kw)
            self.armed = False
            if after:
                real(*args, **kw)
            raise Interrupt(f"injected in {name}")

        monkeypatch.setattr(cls, name, call)


OVERLAP_FAULTS = {  # where: (class, method, after the real call)
    "launching the next step, before its kernels": ("model", "__call__", False),
    "launching the next step, after its kernels": ("model", "__call__", True),
    "feeding the next step's tokens": ("feed", "__call__", False),
    "awaiting the last step's tokens (Ctrl-C)": ("inflight", "tokens", False),
}


def overlapped_fault(monkeypatch, where: str) -> Once:
    from deepfuse.runtime import overlap

    what, name, after = OVERLAP_FAULTS[where]
    cls = {"model": FailingModel, "feed": overlap.TokenFeed, "inflight": overlap.InFlight}[what]
    return Once(monkeypatch, cls, name, after)


@pytest.mark.parametrize("where", OVERLAP_FAULTS)
def test_an_overlapped_step_that_fails_leaves_everything_as_it_was(tiny_art, monkeypatch, where):
    """A fault while the next step is launched (or fed), or while the last one's tokens are awaited,
    at a step that takes a fresh block: the requests, their tables and names, and the pool are as
    before the call (the step ahead gave its block back); stepping on gives the synchronous
    engine's tokens and prefix cache, and nothing leaks."""
    prompts, params = [LONG, REPEATS, [1, 2, 3]], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    sync = engine(tiny_art)
    want = all_tokens(sync.generate(prompts, [params] * 3))
    eng = engine(tiny_art, overlap=True)
    eng.model = FailingModel(eng.model, lambda inputs: False)
    fault = overlapped_fault(monkeypatch, where)
    ids, done = [eng.add_request(p, params) for p in prompts], {}
    arm_at_a_new_block(eng, done)
    before = standing(eng)
    fault.armed = True
    with pytest.raises(Interrupt):
        eng.step()
    assert not fault.armed and as_before(eng, before)
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step())
    assert [[done[i].outputs[0].token_ids] for i in ids] == want
    assert eng.stats.ahead_steps > 0
    no_leaks(eng)
    assert set(eng.kv.pool.by_name) == set(sync.kv.pool.by_name)


def test_an_overlapped_first_step_whose_next_step_fails_is_undone(tiny_art, monkeypatch):
    """The first call launches a step the scheduler chose, then the step ahead: that launch failing
    rolls both back (the requests wait again, no block is held or named)."""
    eng = engine(tiny_art, overlap=True)
    calls = []
    eng.model = FailingModel(eng.model, lambda inputs: calls.append(1) or len(calls) == 2)
    ids = [eng.add_request(p, GREEDY) for p in (LONG, REPEATS)]
    with pytest.raises(Interrupt):
        eng.step()
    assert [r.request_id for r in eng.scheduler.waiting] == ids and not eng.scheduler.running
    assert eng.kv.num_used() == 0 and not eng.kv.pool.pending and not eng.kv.pool.by_name
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step())
    assert [[done[i].outputs[0].token_ids] for i in ids] == all_tokens(engine(tiny_art).generate([LONG, REPEATS],
                                                                                                 [GREEDY] * 2))
    no_leaks(eng)


@pytest.mark.parametrize("fault", ["on_token", "appending"])
def test_a_fault_while_tokens_are_taken_leaves_the_synchronous_engines_state(tiny_art, monkeypatch, fault):
    """on_token or appending a token raising while an overlapped step's tokens are given out: what
    was taken stands and the step ahead never ran, so the engine stands as the synchronous one
    does after the same fault."""
    prompts, params = [LONG, REPEATS, [1, 2, 3]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    states = {}
    for overlap in (False, True):
        eng = engine(tiny_art, overlap=overlap)

        def hook(*args, count=[]):  # noqa: B006  (one list per engine: a new function each time)
            count.append(1)
            if len(count) == 14:  # the fifth step's second token
                raise Interrupt("injected")

        if fault == "appending":
            monkeypatch.setattr(eng, "_append", lambda *a, real=eng._append, hook=hook: (hook(), real(*a)))
        for p in prompts:
            eng.add_request(p, params)
        with pytest.raises(Interrupt):
            while eng.has_unfinished():
                eng.step(hook if fault == "on_token" else None)
        assert eng.overlap is None or eng.overlap.inflight is None
        states[overlap] = standing(eng)[0]
        while eng.has_unfinished():
            eng.step()
        no_leaks(eng)
    assert states[True] == states[False]


def test_the_check_catches_an_ahead_step_that_keeps_its_blocks(tiny_art, monkeypatch):
    """The state check has teeth: if a failed step ahead did not give its reserved block back, the
    engine would not stand as before the call."""
    from deepfuse.runtime import overlap

    monkeypatch.setattr(overlap, "give_back", lambda eng, scheduled, before: None)
    eng = engine(tiny_art, overlap=True)
    eng.model = FailingModel(eng.model, lambda inputs: False)
    fault = overlapped_fault(monkeypatch, "launching the next step, before its kernels")
    for p in (LONG, REPEATS, [1, 2, 3]):
        eng.add_request(p, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    arm_at_a_new_block(eng, {})
    before = standing(eng)
    fault.armed = True
    with pytest.raises(Interrupt):
        eng.step()
    assert eng.overlap.inflight is not None and not as_before(eng, before)
