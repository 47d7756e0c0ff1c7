"""The OpenAI-compatible server on SmolLM2, driven over loopback by the official `openai`
client: every answer must parse as the client expects and agree with LLM.generate."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from deepfuse import LLM, SamplingParams
from deepfuse.runtime.async_llm import AsyncLLM
from deepfuse.serve import build_app

KEY = "test-key"
NAME = "smollm2"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def server(smollm2_compiled):
    """(base url, AsyncLLM) of a server in a thread of this process, on a free loopback port."""
    served = AsyncLLM(LLM(smollm2_compiled, num_blocks=256))
    app = build_app(served, NAME, api_key=KEY, max_body_bytes=LIMIT)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not srv.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", served
    srv.should_exit = True
    thread.join(10)
    served.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref(smollm2_compiled):
    return LLM(smollm2_compiled, num_blocks=256)


def settle(served, timeout=5.0):
    """The engine's stats once no request runs and no block is held (or at timeout)."""
    end = time.time() + timeout
    while time.time() < end and (served.stats().running or served.stats().blocks_used):
        time.sleep(0.02)
    return served.stats()


def post(url, body: bytes, key=KEY, content_type="application/json"):
    """(status, parsed JSON body) of a raw POST."""
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": content_type,
                                                                         **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_completions_and_chat_equal_offline_generation(client, ref, smollm2):
    tok = smollm2[1]
    got = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=8, temperature=0)
    want = ref.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert got.object == "text_completion" and got.model == NAME and got.id.startswith("cmpl-")
    assert got.choices[0].text == want.outputs[0].text and got.choices[0].finish_reason == want.outputs[0].finish_reason
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(want.prompt_token_ids), len(want.outputs[0].token_ids))
    talk = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=NAME, messages=talk, max_completion_tokens=12, temperature=0)
    want = ref.chat(talk, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == want.outputs[0].text and "Paris" in want.outputs[0].text
    assert chat.usage.prompt_tokens == len(tok.encode(tok.render_chat(talk)))
    assert [m.id for m in client.models.list().data] == [NAME]


def test_streams_reassemble_to_the_whole_answer_with_a_usage_chunk(client):
    talk = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=NAME, messages=talk, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=talk, max_tokens=16, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks) and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # completions, n = 2, seeded: the stream's pieces per index are the whole answer's choices
    kw = dict(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=1.0, seed=3, n=2)
    whole = client.completions.create(**kw)
    parts = {}
    for c in client.completions.create(stream=True, **kw):
        for ch in c.choices:
            parts[ch.index] = parts.get(ch.index, "") + ch.text
    assert parts == {ch.index: ch.text for ch in whole.choices} and parts[0] != parts[1]


def test_n_seed_and_stop_strings(client, ref):
    got = client.completions.create(model=NAME, prompt=["One, two,", "Red, green,"], max_tokens=10, temperature=0.9,
                                    seed=11, n=3)
    assert [c.index for c in got.choices] == list(range(6))
    want = ref.generate(["One, two,", "Red, green,"], SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=10),
                        use_tqdm=False)
    assert [c.text for c in got.choices] == [c.text for o in want for c in o.outputs]
    stopped = client.completions.create(model=NAME, prompt="One, two, three, four,", max_tokens=20, temperature=0,
                                        stop=[","])
    c = stopped.choices[0]
    assert c.finish_reason == "stop" and "," not in c.text and c.model_extra["stop_reason"] == ","
    extra = client.completions.create(model=NAME, prompt="One, two, three, four,", max_tokens=5, temperature=0,
                                      extra_body={"ignore_eos": True, "min_tokens": 5, "top_k": 5,
                                                  "repetition_penalty": 1.1})
    assert extra.usage.completion_tokens == 5 and extra.choices[0].finish_reason == "length"


def test_logprobs_are_the_models(client, ref):
    got = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=2)
    want = ref.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=6, logprobs=2),
                        use_tqdm=False)[0].outputs[0]
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(want.token_ids)
    for tok, v, top, entry in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert v == pytest.approx(entry[tok].logprob, abs=1e-5) and len(top) == 2 and max(top.values()) == pytest.approx(v)
    assert "".join(lp.tokens) == got.choices[0].text and lp.text_offset[0] == 0
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Say hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob for t in content)


def test_a_client_leaving_a_stream_aborts_it_and_frees_its_blocks(client, server):
    _, served = server
    stream = client.completions.create(model=NAME, prompt="Tell me a long story.", max_tokens=3000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    seen = 0
    for _ in stream:
        seen += 1
        if seen == 3:
            break
    assert served.stats().running == 1
    stream.close()
    s = settle(served)  # 3000 tokens take a minute: only an abort ends it this soon
    assert (s.running, s.waiting, s.blocks_used) == (0, 0, 0)
    assert client.completions.create(model=NAME, prompt="Hi", max_tokens=2).usage.completion_tokens >= 1


def test_bad_requests_get_openai_error_bodies(client, server):
    url = server[0]
    bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=NAME, prompt="Hi", max_tokens=2)
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    assert post(url + "/v1/completions", b'{"prompt": "Hi"}', key=None)[0] == 401
    with pytest.raises(openai.BadRequestError, match="temperature must be") as e:
        client.completions.create(model=NAME, prompt="Hi", temperature=-1)
    assert e.value.param == "temperature" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="exceeds the context"):
        client.completions.create(model=NAME, prompt="x " * 4000, max_tokens=200)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.UnprocessableEntityError, match="messages"):
        client.chat.completions.create(model=NAME, messages=[])
    cases = [(b'{"prompt": "Hi", ', 400, "malformed JSON"), (b'{"prompt": 3}', 422, "prompt"),
             (b'{"prompt": "Hi", "frobnicate": 1}', 422, "frobnicate"), (b'[1, 2]', 422, "body"),
             (b'{"prompt": "Hi", "n": 0}', 400, "n must be"), (b'{"prompt": "Hi", "echo": true}', 400, "echo"),
             (json.dumps({"prompt": "x" * (LIMIT + 1)}).encode(), 413, "over the limit"), (b"\xff\xfe", 400, "malformed")]
    for body, status, words in cases:
        got, err = post(url + "/v1/completions", body)
        assert got == status and words in err["error"]["message"], (body[:40], got, err)
        assert set(err["error"]) == {"message", "type", "param", "code"}
    assert post(url + "/v1/nowhere", b"{}")[0] == 404
    assert settle(server[1]).blocks_used == 0  # nothing was left running


def test_structured_outputs_through_response_format_and_vllms_field(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    talk = [{"role": "user", "content": "Name a large city and its population, as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    got = client.chat.completions.create(model=NAME, messages=talk, max_tokens=60, temperature=0.7, seed=1,
                                         response_format=fmt)
    assert got.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)
    streamed = client.chat.completions.create(model=NAME, messages=talk, max_tokens=60, temperature=0.7, seed=1,
                                              response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == got.choices[0].message.content
    obj = client.chat.completions.create(model=NAME, messages=talk, max_tokens=60, temperature=0.7, seed=2,
                                         response_format={"type": "json_object"})
    assert isinstance(json.loads(obj.choices[0].message.content), dict)
    picked = client.completions.create(model=NAME, prompt="Is the sky green? Answer:", max_tokens=5, n=2, seed=3,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert all(c.text in ("yes", "no") for c in picked.choices)
    with pytest.raises(openai.BadRequestError, match="cannot be compiled") as e:
        client.completions.create(model=NAME, prompt="Hi", extra_body={"structured_outputs": {"regex": "([a-z"}})
    assert e.value.param == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="not both"):
        client.chat.completions.create(model=NAME, messages=talk, response_format={"type": "json_object"},
                                       extra_body={"structured_outputs": {"choice": ["a"]}})


def test_health_and_prometheus_metrics(server, client):
    url, served = server
    client.completions.create(model=NAME, prompt="Hello", max_tokens=3)
    with urllib.request.urlopen(url + "/health") as r:
        assert r.status == 200
    with urllib.request.urlopen(url + "/metrics") as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    for name in ("deepfuse_num_requests_running", "deepfuse_num_requests_waiting", "deepfuse_kv_cache_usage_perc",
                 "deepfuse_prefix_cache_hit_rate", "deepfuse_generation_tokens_per_second",
                 "deepfuse_spec_decode_acceptance_rate"):
        assert families[name].type == "gauge", name
    ttft = {s.name: s.value for s in families["deepfuse_time_to_first_token_seconds"].samples}
    assert families["deepfuse_time_to_first_token_seconds"].type == "histogram" and ttft[
        "deepfuse_time_to_first_token_seconds_count"] >= 1
    assert "deepfuse_time_per_output_token_seconds" in families and "deepfuse_e2e_request_latency_seconds" in families
    generated = families["deepfuse_generation_tokens"].samples[0].value
    assert generated >= 3 and families["deepfuse_kv_cache_usage_perc"].samples[0].value == 0.0
    assert families["deepfuse_generation_tokens_per_second"].samples[0].value > 0  # tokens came in the last 10 s
