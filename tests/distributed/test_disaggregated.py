"""Prefill/decode disaggregation: a request whose prompt one engine computed and another engine
took over (its KV moved between their caches) gives one engine's tokens and logprobs (f32); in
two worker processes, likewise, with errors per request and nothing lost."""
from dataclasses import replace

import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.models import load_model
from deepfuse.runtime.disaggregated import DisaggregatedEngine, WorkerOptions
from deepfuse.runtime.engine import Engine
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.request import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7, 64, 1], [9, 9, 2], list(range(20, 60)), [11, 12, 13]]
PARAMS = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=1),
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, seed=7, n=2),
          SamplingParams(temperature=0.7, seed=3, max_tokens=9, min_tokens=4, stop_token_ids=[12, 40], logit_bias={40: 3.0})]


def _engine(path: str, blocks: int = 128) -> Engine:
    model, _ = load_model(path, with_tokenizer=False)
    return Engine(deepfuse.compile(model), CacheConfig(4, blocks), 32, 4)


def _same(want, got) -> None:
    assert got.error is None and [c.token_ids for c in got.outputs] == [c.token_ids for c in want.outputs]
    assert [c.finish_reason for c in got.outputs] == [c.finish_reason for c in want.outputs]
    for w, g in zip(want.outputs[0].logprobs or [], got.outputs[0].logprobs or []):
        assert w.keys() == g.keys() and max(abs(w[t].logprob - g[t].logprob) for t in w) <= 1e-5
    for w, g in zip((want.prompt_logprobs or [])[1:], (got.prompt_logprobs or [])[1:]):
        assert w.keys() == g.keys() and max(abs(w[t].logprob - g[t].logprob) for t in w) <= 1e-5


def test_a_request_taken_over_with_its_prompts_kv_gives_one_engines_tokens(tiny_dir):
    prefill, decode, one = _engine(tiny_dir), _engine(tiny_dir), _engine(tiny_dir)
    prompt = PROMPTS[2]
    p = SamplingParams(temperature=0.9, seed=5, max_tokens=10, logprobs=2)
    want = one.generate([prompt], [p])[0]
    first = prefill.generate([prompt], [SamplingParams(temperature=0.9, seed=5, max_tokens=1, logprobs=2)])[0]
    # the prompt's KV, read out of the prefill engine's cache: its blocks are cached by name after the request
    seq = prefill.kv.match_prefix(prompt + [0])
    rows = torch.zeros(prefill.model.config.num_layers, 2, len(prompt), *prefill.cache.layers[0].shape[3:])
    full = len(seq.table) * 4
    rows[:, :, :full] = prefill.cache.read_rows(seq.table, full)
    # the rows land where read_rows reads them
    decode.add_prefilled(prompt[:full], replace(p, logprobs=None), 0, rows[:, :, :full], "x")
    assert torch.equal(decode.cache.read_rows(decode.requests["x"].kv.table, full), rows[:, :, :full])
    decode.abort("x")
    assert decode.kv.num_used() == 0
    # the whole prompt: its last block is not cached, so this time the rows come straight from the request
    rows = []

    class Keep(Engine):
        def _retire(self, req):
            rows.append(self.cache.read_rows(req.kv.table, len(req.prompt)))
            super()._retire(req)

    keep = Keep(prefill.model, CacheConfig(4, 128), 32, 4)
    keep.generate([prompt], [SamplingParams(temperature=0.9, seed=5, max_tokens=1, logprobs=2)])
    decode.add_prefilled(prompt, p, first.outputs[0].token_ids[0], rows[0], seed=5,
                         logprobs=first.outputs[0].logprobs[0])
    outs = []
    while decode.has_unfinished():
        outs += decode.step()
    assert outs[0].outputs[0].token_ids == want.outputs[0].token_ids
    for w, g in zip(want.outputs[0].logprobs[1:], outs[0].outputs[0].logprobs[1:]):
        assert max(abs(w[t].logprob - g[t].logprob) for t in w) <= 1e-5


def test_add_prefilled_refuses_bad_rows_and_no_room_and_changes_nothing(tiny_dir):
    eng = _engine(tiny_dir, blocks=8)
    L = eng.model.config.num_layers
    row = eng.cache.layers[0].shape[3:]
    with pytest.raises(DeepfuseError, match="kv_rows has shape"):
        eng.add_prefilled([1, 2, 3], SamplingParams(max_tokens=2), 4, torch.zeros(L, 2, 2, *row))
    with pytest.raises(DeepfuseError, match="no room"):
        eng.add_prefilled(list(range(40)), SamplingParams(max_tokens=2), 4, torch.zeros(L, 2, 40, *row))
    with pytest.raises(DeepfuseError, match="outside the vocabulary"):
        eng.add_prefilled([1, 10 ** 6], SamplingParams(max_tokens=2), 4, torch.zeros(L, 2, 2, *row))
    with pytest.raises(RuntimeError):  # rows of another width fail once the blocks are allocated
        eng.add_prefilled([1, 2, 3, 4, 5], SamplingParams(max_tokens=2), 4, torch.zeros(L, 2, 5, row[0], row[1] + 1))
    assert not eng.requests and not eng.has_unfinished() and eng.kv.num_used() == 0
    assert not eng.kv.pool.pending
    eng.add_prefilled([1, 2, 3], SamplingParams(max_tokens=1), 4, torch.zeros(L, 2, 3, *row), "done-at-once")
    out = eng.step()  # its first token ended it: it comes back from the next step, its blocks freed
    assert [o.request_id for o in out] == ["done-at-once"] and out[0].outputs[0].token_ids == [4]
    assert eng.kv.num_used() == 0 and not eng.has_unfinished()


def test_two_workers_give_one_engines_tokens_and_report_bad_requests_alone(tiny_dir):
    want = _engine(tiny_dir).generate(PROMPTS, PARAMS)
    eng = DisaggregatedEngine(tiny_dir, WorkerOptions(with_tokenizer=False, block_size=4, num_blocks=128,
                                                      max_num_tokens=32, max_num_seqs=4))
    try:
        got = eng.generate(PROMPTS + [[1] * 500], PARAMS + [SamplingParams(max_tokens=4)])
        for w, g in zip(want, got):
            _same(w, g)
        assert got[-1].error is not None and "context" in str(got[-1].error)
        assert all(o.metrics.ttft_s > 0 for o in got[:-1])
        again = eng.generate(PROMPTS[:1], PARAMS[:1])  # the workers keep serving
        _same(want[0], again[0])
        # requests added one at a time while others run
        first = eng.add_request(PROMPTS[0], PARAMS[0])
        outs = eng.get_finished()
        later = eng.add_request(PROMPTS[3], PARAMS[3], "later")
        with pytest.raises(DeepfuseError, match="already in use"):
            eng.add_request(PROMPTS[3], PARAMS[3], "later")
        with pytest.raises(DeepfuseError, match="n = 2"):
            eng.add_request(PROMPTS[2], PARAMS[2])
        while eng.has_unfinished():
            outs += eng.get_finished()
        by_id = {o.request_id: o for o in outs}
        assert by_id.keys() == {first, later}
        _same(want[0], by_id[first])
        _same(want[3], by_id[later])
    finally:
        eng.close()
