"""AsyncLLM on SmolLM2: many coroutines at once, requests arriving and leaving at any time,
streamed outputs that only grow, aborts that free their blocks, bad requests that fail alone."""
import asyncio
import time

import pytest

from deepfuse import LLM, SamplingParams
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.async_llm import AsyncLLM, EngineFailure

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.fixture(scope="module")
def llms(smollm2_compiled):
    """(AsyncLLM, an LLM of the same model for references)."""
    served = AsyncLLM(LLM(smollm2_compiled, num_blocks=256))
    yield served, LLM(smollm2_compiled, num_blocks=256)
    served.shutdown()


async def collect(llm, prompt, params, rid, delay=0.0):
    await asyncio.sleep(delay)
    outs = [out async for out in llm.generate(prompt, params, rid)]
    return outs


def settle(llm, timeout=10.0):
    """Waits until the engine thread reports no requests; returns its stats."""
    end = time.time() + timeout
    while time.time() < end:
        s = llm.stats()
        if s.running == s.waiting == 0 and s.blocks_used == 0:
            return s
        time.sleep(0.02)
    return llm.stats()


def test_concurrent_requests_equal_offline_and_stream_growing_text(llms):
    served, ref = llms
    prompts = ["The capital of France is", "Bread is made from", "One, two, three,", "The sky is"]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=12),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=8), SamplingParams(temperature=0, max_tokens=30,
                                                                                          stop=["."])]

    async def main():
        return await asyncio.gather(*[collect(served, p, q, f"r{i}", delay=0.05 * i)
                                      for i, (p, q) in enumerate(zip(prompts, params))])

    streams = asyncio.run(main())
    for prompt, p, outs in zip(prompts, params, streams):
        want = ref.generate([prompt], p, use_tqdm=False)[0]
        last = outs[-1]
        assert last.finished and not any(o.finished for o in outs[:-1]) and last.prompt == prompt
        assert [c.token_ids for c in last.outputs] == [c.token_ids for c in want.outputs]
        assert [c.text for c in last.outputs] == [c.text for c in want.outputs]
        assert [c.finish_reason for c in last.outputs] == [c.finish_reason for c in want.outputs]
        for j in range(p.n):  # cumulative: each output extends the one before
            texts = [o.outputs[j].text for o in outs]
            ids = [o.outputs[j].token_ids for o in outs]
            assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
            assert all(b[:len(a)] == a for a, b in zip(ids, ids[1:]))
    stopped = streams[3][-1].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "." and "." not in stopped.text
    assert all("." not in o.outputs[0].text for o in streams[3])  # the stop string never streamed
    assert settle(served).blocks_used == 0


def test_leaving_a_stream_or_abort_frees_its_blocks_and_others_go_on(llms):
    served, ref = llms
    ended = {}
    served.on_finish = lambda out: ended.setdefault(out.request_id, out.outputs[0].finish_reason)
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)  # far longer than the test

    async def leave_early():
        async for out in served.generate("Tell me a long story", long, "leaver"):
            if len(out.outputs[0].token_ids) >= 3:
                break

    async def aborted():
        outs = []
        async for out in served.generate("Count to a thousand", long, "aborted"):
            outs.append(out)
            if len(out.outputs[0].token_ids) >= 2:
                await served.abort("aborted")
        return outs

    async def main():
        return await asyncio.gather(leave_early(), aborted(), collect(served, "The sky is", GREEDY, "stays"))

    _, cut, kept = asyncio.run(main())
    assert cut[-1].finished and cut[-1].outputs[0].finish_reason == "abort" and len(cut[-1].outputs[0].token_ids) < 200
    assert kept[-1].outputs[0].token_ids == ref.generate(["The sky is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    s = settle(served, timeout=5.0)
    assert (s.running, s.waiting, s.blocks_used) == (0, 0, 0)
    assert ended == {"leaver": "abort", "aborted": "abort", "stays": kept[-1].outputs[0].finish_reason}
    served.on_finish = None


def test_bad_requests_raise_alone(llms):
    served, _ = llms

    async def bad(prompt, params, rid):
        with pytest.raises(DeepfuseError) as e:
            await collect(served, prompt, params, rid)
        return str(e.value)

    async def main():
        async def twice():  # the same id twice at once: the second is refused
            first = asyncio.ensure_future(collect(served, "Hello", GREEDY, "dup"))
            await asyncio.sleep(0)
            msg = await bad("Hello", GREEDY, "dup")
            return msg, await first

        return await asyncio.gather(bad("x " * 5000, GREEDY, "long"), bad([], GREEDY, "empty"), twice(),
                                    collect(served, "Hello", GREEDY, "fine"))

    too_long, empty, (dup, first), fine = asyncio.run(main())
    assert "exceeds the context" in too_long and "prompt is empty" in empty and "already in use" in dup
    assert first[-1].finished and fine[-1].outputs[0].finish_reason in ("stop", "length")
    assert settle(served).blocks_used == 0


def test_a_step_that_raises_fails_the_requests_in_flight_and_the_engine_goes_on(llms):
    served, ref = llms
    engine, real = served.engine, served.engine._run_step
    calls = []

    def faulty():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real()

    async def main():
        with pytest.raises(EngineFailure, match="the engine failed in a step: injected fault"):
            await collect(served, "The capital of France is", GREEDY, "doomed")
        engine._run_step = real
        return await collect(served, "The sky is", GREEDY, "after")

    engine._run_step = faulty
    try:
        after = asyncio.run(main())
    finally:
        engine._run_step = real
    assert after[-1].outputs[0].token_ids == ref.generate(["The sky is"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert settle(served).blocks_used == 0


def test_served_decode_bursts_stream_the_one_step_tokens_several_at_a_time(smollm2_compiled, llms):
    """AsyncLLM over an engine that runs 4 decode steps a burst (`deepfuse serve --decode-steps 4`):
    each request streams the tokens of the one-step engine (greedy and seeded, a stop string), its
    outputs grow by up to 4 tokens, at least one burst gives more than one, and nothing stays."""
    _, ref = llms
    served = AsyncLLM(LLM(smollm2_compiled, num_blocks=256, decode_steps=4))
    try:
        prompts = ["The capital of France is", "One, two, three,"]
        params = [SamplingParams(temperature=0, max_tokens=14),
                  SamplingParams(temperature=0.8, seed=7, max_tokens=11, stop=["seven"])]

        async def main():
            return await asyncio.gather(*[collect(served, p, q, f"b{i}") for i, (p, q) in enumerate(zip(prompts, params))])

        streams = asyncio.run(main())
        grew = []
        for prompt, p, outs in zip(prompts, params, streams):
            want = ref.generate([prompt], p, use_tqdm=False)[0].outputs[0]
            got = outs[-1].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
            sizes = [len(o.outputs[0].token_ids) for o in outs]
            grew += [b - a for a, b in zip(sizes, sizes[1:])]
        assert max(grew) > 1 and all(0 <= g <= 4 for g in grew)
        assert served.engine.stats.burst_steps > 0
        assert settle(served).blocks_used == 0
    finally:
        served.shutdown()


def test_an_llm_given_by_its_arguments_is_built_on_the_engine_thread(smollm2_compiled, monkeypatch):
    """AsyncLLM(model, **kwargs) builds the LLM on the thread that then runs its steps (one
    OpenMP thread pool in the process, see runtime/async_llm.py), and it serves; a model that
    cannot be built raises on the caller's thread."""
    import threading

    import deepfuse.runtime.async_llm as async_llm

    built_on = []

    class Recording(async_llm.LLM):
        def __init__(self, *args, **kwargs):
            built_on.append(threading.get_ident())
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(async_llm, "LLM", Recording)
    served = AsyncLLM(smollm2_compiled, num_blocks=64)
    try:
        assert built_on == [served._thread.ident] and built_on[0] != threading.get_ident()

        async def main():
            return await collect(served, "The sky is", GREEDY, "t0")

        assert asyncio.run(main())[-1].finished
    finally:
        served.shutdown()
    engines = lambda: sum(t.name == "deepfuse-engine" and t.is_alive() for t in threading.enumerate())  # noqa: E731
    before = engines()
    with pytest.raises(DeepfuseError, match="unknown model 'nope'"):
        AsyncLLM("nope")
    end = time.time() + 5
    while engines() > before and time.time() < end:  # the failed build's thread ends
        time.sleep(0.01)
    assert engines() == before
