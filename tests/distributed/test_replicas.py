"""Two SmolLM2 engine replicas as Ray actors on this machine (one Ray session for the module):
the single engine's outputs, requests routed to the replica that caches their prefix (seen in the
replica's own prefix-cache hits), aborts and bad requests, the HTTP app over replicas, and a
replica that dies. A missing `ray` fails this module's import (it is in the dev extra)."""
import asyncio
import json
import socket
import threading
import time
import urllib.request

import pytest
import ray
import uvicorn

from deepfuse import LLM, SamplingParams
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.async_llm import EngineFailure
from deepfuse.runtime.replicas import Replicas, ReplicatedLLM
from deepfuse.runtime.router import prompt_block_names
from deepfuse.serve import build_app

GREEDY = SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def offline(smollm2_compiled):
    llm = ReplicatedLLM(smollm2_compiled, replicas=2, num_blocks=128)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def ref(smollm2_compiled):
    return LLM(smollm2_compiled, num_blocks=128)


@pytest.fixture(scope="module")
def prefixes(smollm2):
    """Two different 5-block (80-token) prefixes, as token ids, and question token ids."""
    tok = smollm2[1]
    text_a = "You are a careful assistant for a museum of natural history. Answer visitors briefly. " * 8
    text_b = "Du bist ein Assistent einer Bibliothek in Berlin und antwortest immer auf Deutsch, knapp. " * 8
    a, b = tok.encode(text_a)[:80], tok.encode(text_b)[:80]
    questions = [tok.encode(q) for q in (" Where are the dinosaurs?", " When do you open?", " Is there a cafe?",
                                         " How much is a ticket?")]
    return a, b, questions


def placements(replicas, monkeypatch) -> dict[str, int]:
    """request id -> the replica the router chose, recorded as requests start."""
    seen, started = {}, replicas.router.started

    def spy(r, request_id, names):
        seen[request_id] = r
        started(r, request_id, names)

    monkeypatch.setattr(replicas.router, "started", spy)
    return seen


async def final(replicas, prompt, params, rid, delay=0.0):
    await asyncio.sleep(delay)
    outs = [out async for out in replicas.generate(prompt, params, rid)]
    return outs[-1]


def settle(replicas, timeout=10.0):
    end = time.time() + timeout
    while time.time() < end:
        s = replicas.stats()
        if s.running == s.waiting == s.blocks_used == 0:
            return s
        time.sleep(0.05)
    return replicas.stats()


def test_outputs_equal_one_engine(offline, ref, prefixes):
    a, b, qs = prefixes
    prompts = [a + qs[0], "The capital of France is", b + qs[1], a + qs[2], "Bread is made from", [1] * 5000]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3, max_tokens=8), GREEDY,
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6), SamplingParams(temperature=0, max_tokens=20,
                                                                                         stop=["."]), GREEDY]
    got = offline.generate(prompts, params)
    want = ref.generate(prompts, params, use_tqdm=False)
    for g, w in zip(got, want):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.text for c in g.outputs] == [c.text for c in w.outputs]
        assert [c.finish_reason for c in g.outputs] == [c.finish_reason for c in w.outputs]
        assert g.prompt == w.prompt
    assert got[-1].outputs[0].finish_reason == "error" and "context" in str(got[-1].error)


def test_shared_prefixes_go_to_the_replica_that_caches_them(offline, prefixes, monkeypatch):
    replicas = offline.replicas
    a, b, qs = prefixes
    a, b = [4321] + a[1:], [4321] + b[1:]  # prefixes no earlier test has cached: every block name differs
    where = placements(replicas, monkeypatch)
    first = asyncio.run(final(replicas, a + qs[3], GREEDY, "a-first"))
    home = where["a-first"]
    names = prompt_block_names(a + qs[3], replicas.block_size)
    assert len(names) >= 5 and set(names[:5]) <= replicas.router.replicas[home].reported  # the replica's own report
    assert first.finished

    async def burst():
        order = [("a1", a + qs[0]), ("b1", b + qs[0]), ("a2", a + qs[1]), ("b2", b + qs[1]), ("a3", a + qs[2])]
        return await asyncio.gather(*[final(replicas, p, GREEDY, rid, delay=0.01 * i) for i, (rid, p) in enumerate(order)])

    a1, b1, a2, b2, a3 = asyncio.run(burst())
    assert [where[r] for r in ("a1", "a2", "a3")] == [home] * 3
    assert where["b1"] == where["b2"] == 1 - home  # a new prefix goes to the less loaded replica, then stays
    # the replica really held the prefix: it served a's 80 tokens from its cache
    assert [o.num_cached_tokens >= 80 for o in (a1, a2, a3)] == [True] * 3
    assert b2.num_cached_tokens >= 80  # b2 found b1's blocks on the same replica
    assert replicas.router.load(0) == replicas.router.load(1) == 0


def test_aborts_and_bad_requests(offline, prefixes):
    replicas = offline.replicas
    a, _, qs = prefixes
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def leave_early():
        seen = 0
        async for out in replicas.generate(a + qs[0], long, "leaver"):
            seen += 1
            if seen == 2:
                assert not out.finished
                break

    async def abort_explicitly():
        stream = await replicas.add_request(a + qs[1], long, "stopped")
        with pytest.raises(DeepfuseError, match="already in use"):
            await replicas.add_request("hi", GREEDY, "stopped")
        await replicas.abort("stopped")
        outs = [out async for out in stream]
        return outs[-1]

    async def close_unread():  # as the app does with the requests added before one that fails
        stream = await replicas.add_request(a + qs[2], long, "unread")
        await stream.aclose()

    async def too_long():
        await replicas.add_request([1] * 5000, GREEDY, "too-long")

    asyncio.run(leave_early())
    asyncio.run(close_unread())
    last = asyncio.run(abort_explicitly())
    assert last.finished and last.outputs[0].finish_reason == "abort" and len(last.outputs[0].token_ids) < 200
    with pytest.raises(DeepfuseError, match="context"):
        asyncio.run(too_long())
    s = settle(replicas)
    assert (s.running, s.waiting, s.blocks_used) == (0, 0, 0)
    assert replicas.router.load(0) == replicas.router.load(1) == 0 and not replicas._running
    assert s.prefix_queries > 0 and s.prefix_hit_rate == pytest.approx(s.prefix_hits / s.prefix_queries)


def test_http_app_over_replicas(offline, ref):
    replicas = offline.replicas
    app = build_app(replicas, "smollm2")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            card = json.loads(r.read())["data"][0]
    finally:
        srv.should_exit = True
        thread.join(10)
    want = ref.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert got["choices"][0]["text"] == want.outputs[0].text
    assert "deepfuse_prefix_cache_hit_rate" in metrics and 'deepfuse_request_success_total{finished_reason="length"}' in metrics
    assert card["max_model_len"] == ref.engine.max_model_len


def test_replicas_that_cannot_start_say_why():
    with pytest.raises(DeepfuseError, match="unknown model 'nope'"):
        Replicas(2, model="nope")
    with pytest.raises(DeepfuseError, match="routing policy"):
        Replicas(2, routing="random")


def test_a_dead_replica_fails_its_requests_and_the_other_serves(offline, ref, prefixes, monkeypatch):
    """Kills a replica: runs last in this module."""
    replicas = offline.replicas
    a, b, qs = prefixes
    where = placements(replicas, monkeypatch)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def killed_mid_stream():
        stream = await replicas.add_request(a + qs[0], long, "doomed")
        got = await stream.__anext__()
        assert not got.finished
        ray.kill(replicas.workers[where["doomed"]])
        async for _ in stream:
            pass

    with pytest.raises(EngineFailure):
        asyncio.run(killed_mid_stream())
    dead = where["doomed"]
    assert replicas.router.live() == [1 - dead]
    prompts = [a + qs[1], b + qs[2], "Bread is made from"]
    got = offline.generate(prompts, GREEDY)
    want = ref.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [where[o.request_id] for o in got] == [1 - dead] * 3
    assert replicas.stats().running == 0
