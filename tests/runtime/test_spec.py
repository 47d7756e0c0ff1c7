"""Speculative decoding: multi-row sampling, the n-gram drafter, identical outputs with and
without drafts (greedy and seeded sampling, SmolLM2), the target distribution at temperature 1,
metrics, and bad configuration."""
import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu.native import kernels as native_kernels
from deepfuse.errors import DeepfuseError
from deepfuse.ir import interpret
from deepfuse.models import Llama
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig, KVCache
from deepfuse.runtime.request import Request
from deepfuse.runtime.spec import (
    AGREE_ALL,
    AGREE_ONLY,
    AGREE_SPLIT,
    Draft,
    Drafter,
    LatencyModel,
    NgramDrafter,
    SpecConfig,
    choose_drafts,
)
from tests.helpers import check_spec_accounting, ngram_spec_counts

PASSAGE = ("The quick brown fox jumps over the lazy dog. The dog was not amused, and the fox ran away into the "
           "forest, where it met a wise old owl who told it a story about the moon and the stars.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"


def test_a_chunk_samples_its_last_rows_like_one_token_steps(tiny_model):
    art = deepfuse.compile(tiny_model)
    c = tiny_model.config
    cache = lambda: KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(4, 16))
    seq = [5, 17, 99, 3, 42, 7]
    many = build_step([SeqChunk(seq, 0, [], samples=3), SeqChunk([9, 2], 0, [])], cache())
    assert many["sample_rows"].tolist() == [3, 4, 5, 7]
    logits, _, hidden = art(many)
    for i, n in enumerate((4, 5, 6)):
        one, _, one_hidden = art(build_step([SeqChunk(seq[:n], 0, [])], cache()))
        torch.testing.assert_close(logits[i], one[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[i], one_hidden[0], atol=1e-5, rtol=1e-5)  # the MTP head's input
    torch.testing.assert_close(logits, interpret(art.graph, build_step(
        [SeqChunk(seq, 0, [], samples=3), SeqChunk([9, 2], 0, [])], cache()))[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cannot sample its last 3"):
        build_step([SeqChunk([1, 2], 0, [], samples=3)], cache())


def test_ngram_drafter_continues_the_latest_earlier_occurrence():
    d = NgramDrafter(SpecConfig(num_draft_tokens=3, max_ngram=3))
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert d.lookup(toks, 3) == ([7, 8, 1], 3, AGREE_SPLIT)  # [1, 2, 3] was followed by 4, later by 7
    assert d.lookup(toks[:-1], 3) == ([3, 7, 8], 2, AGREE_ALL)  # [1, 2] was followed by 3 each time
    assert d.lookup([4, 5, 6, 4], 3) == ([5, 6, 4], 1, AGREE_ONLY)  # [4] occurred once before
    assert d.lookup([1, 2, 3, 4], 3) == ([], 0, AGREE_ONLY)  # nothing repeats


def test_ngram_confidence_is_learned_per_kind_of_draft():
    """Copied runs are accepted whole or not at all: after such verifications the chance of
    draft 2 given draft 1 is high although only half of first drafts are accepted. The kind
    of draft includes how the request's last verification went, and kinds are shared: a new
    request that has just had all its drafts accepted gets the confidence others earned."""
    d = NgramDrafter(SpecConfig(num_draft_tokens=4, max_ngram=3))
    toks = [1, 2, 3, 9, 1, 2, 3]
    reqs = [Request(str(i), toks, None, 0, 0.0, list(toks)) for i in range(3)]
    assert d.propose_batch(reqs[:1], [4])[0].confidence == pytest.approx([0.5, 0.4, 0.32, 0.256])  # the prior
    for _ in range(20):
        drafts = d.propose_batch(reqs[:2], [4, 4])
        assert drafts[0].tokens == [9, 1, 2, 3]
        d.observe(reqs[0], 4, 4)
        d.observe(reqs[1], 4, 0)
    copying, rejected = d.propose_batch(reqs[:2], [4, 4])
    assert copying.confidence[3] > 0.8 and rejected.confidence[0] < 0.1
    d.propose_batch(reqs[2:], [4])
    d.observe(reqs[2], 2, 2)
    assert d.propose_batch(reqs[2:], [4])[0].confidence == copying.confidence
    new = d.propose_batch([Request("new", toks, None, 0, 0.0, list(toks))], [4])[0].confidence
    # the first round's kind (no verification yet): prior 1/2 and 4/5, then all, none and 2 of 2 accepted
    assert new == pytest.approx([3 / 5, 3 / 5 * 6 / 7, 3 / 5 * 6 / 7 * 5 / 6, 3 / 5 * 6 / 7 * 5 / 6 * 5 / 6])


@pytest.mark.parametrize("bad,match", [(dict(num_draft_tokens=0), "num_draft_tokens must be >= 1"),
                                       (dict(method="medusa"), "unknown speculative method"),
                                       (dict(min_ngram=3, max_ngram=2), "min_ngram"),
                                       (dict(schedule="sometimes"), "unknown schedule")])
def test_bad_spec_config_is_refused(bad, match):
    with pytest.raises(DeepfuseError, match=match):
        SpecConfig(**bad)


@pytest.mark.slow
def test_smollm2_outputs_are_identical_with_speculation(smollm2, smollm2_compiled, tmp_path):
    _, tok = smollm2
    prompts = [tok.encode(tok.render_chat([{"role": "user", "content": "Repeat this text exactly: " + PASSAGE}])),
               tok.encode(CODE), tok.encode("The three primary colors are")]
    params = [SamplingParams(temperature=0, max_tokens=40), SamplingParams(temperature=0, max_tokens=40),
              SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=40)]
    plain = Engine(smollm2_compiled).generate(prompts, params)
    eng = Engine(smollm2_compiled, spec=SpecConfig(num_draft_tokens=5, schedule="fixed"))
    spec = eng.generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert spec[0].metrics.spec.acceptance_rate > 0.5 and spec[0].metrics.spec.mean_accepted_length > 2
    # what prompt lookup must draft and keep for each request, from its tokens (runtime/spec.py's
    # rules), and the steps: one prefill for all three, then the longest request's decode steps
    must = [ngram_spec_counts(pr, o.outputs[0].token_ids, 5, p.max_tokens) for pr, o, p in zip(prompts, spec, params)]
    assert [(o.metrics.spec.verifications, o.metrics.spec.drafted, o.metrics.spec.accepted) for o in spec] == \
        [(m["verifications"], m["drafted"], m["accepted"]) for m in must]
    assert eng.spec_stats.drafted == sum(m["drafted"] for m in must) > 0
    assert eng.stats.steps == 1 + max(m["decode_steps"] for m in must)
    # the confidence schedule verifies what the (machine-dependent) latency table says pays; same tokens
    confident = Engine(smollm2_compiled, spec=SpecConfig(num_draft_tokens=5)).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in confident] == [o.outputs[0].token_ids for o in plain]
    # a self-drafter: SmolLM2's first 8 of 30 layers and its head
    model, _ = smollm2
    draft = deepfuse.compile(model.first_layers(8))
    eng = Engine(smollm2_compiled, spec=SpecConfig(method="draft", num_draft_tokens=3, schedule="fixed"),
                 draft_model=draft)
    outs = eng.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    check_spec_accounting(eng, outs, 3)  # untrained, its drafts are rarely right (see benchmarks/spec.py)
    # an MTP head after a few training steps (how good it is: benchmarks/spec.py)
    from deepfuse.runtime.train_drafter import TrainConfig, train_drafter

    head = str(tmp_path / "head.safetensors")
    train_drafter(smollm2_compiled, head, TrainConfig(num_prompts=8, max_tokens=24, steps=3), log=lambda *_: None)
    eng = Engine(smollm2_compiled, spec=SpecConfig(method="mtp", draft_head=head, num_draft_tokens=3,
                                                   schedule="fixed"))
    outs = eng.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    check_spec_accounting(eng, outs, 3)


class FixedDrafter(Drafter):
    """Always proposes the same tokens (a deterministic drafter the target often rejects)."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose_batch(self, requests, ks):
        return [Draft(self.tokens[:k], [r.spec.recent_rate] * min(k, len(self.tokens))) for r, k in zip(requests, ks)]


def test_temperature_one_keeps_the_target_distribution(tiny_model):
    """A tiny model with a peaked head (lm_head x20), so its exact next-token probabilities
    are far from uniform. The second token of each request is verified against a fixed
    draft; over 2000 seeds, among requests whose first token is the most common one, the
    second token's frequencies match the model's exact softmax (total variation within 3
    sigma of sampling noise), and every token equals decoding without drafts."""
    weights = dict(tiny_model.weights)
    weights["lm_head.weight"] = weights["lm_head.weight"] * 20
    art = deepfuse.compile(Llama(tiny_model.config, weights))
    c = tiny_model.config
    prompt = [5, 17, 99, 3, 5, 17, 99]
    cache = lambda: KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(4, 16))
    first_probs = torch.softmax(art(build_step([SeqChunk(prompt, 0, [])], cache()))[0][0], -1)
    t1 = int(first_probs.argmax())
    probs = torch.softmax(art(build_step([SeqChunk(prompt + [t1], 0, [])], cache()))[0][0], -1)
    draft = [int(i) for i in probs.topk(2).indices.flip(0)]  # the runner-up, then the favourite
    n = 2000
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3) for s in range(n)]  # token 2 is verified
    config = dict(cache=CacheConfig(4, 8192), max_num_tokens=4096, max_num_seqs=512)
    eng = Engine(art, spec=SpecConfig(num_draft_tokens=2, schedule="fixed"), **config)
    eng.drafter = FixedDrafter(draft)
    outs = eng.generate([prompt] * n, params)
    assert eng.spec_stats.verifications >= n and 0 < eng.spec_stats.acceptance_rate < 1
    seconds = torch.tensor([o.outputs[0].token_ids[1] for o in outs if o.outputs[0].token_ids[0] == t1])
    m = len(seconds)
    assert m > n * 0.3
    freq = torch.bincount(seconds, minlength=c.vocab_size).float() / m
    tv = 0.5 * float((freq - probs).abs().sum())
    bound = 3 * 0.5 * float(torch.sqrt(probs * (1 - probs) / m).sum())
    assert tv < bound, (tv, bound)
    plain = Engine(art, **config).generate([prompt] * n, params)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outs]


def test_confidence_schedule_verifies_drafts_only_when_they_pay():
    """Cheap extra tokens (a flat latency curve) make every likely draft worth verifying; a
    steep one (each token costs a whole step) makes none worth it; low confidence stops early."""
    drafts = [Draft([1, 2, 3], [0.9, 0.81, 0.73]), Draft([4, 5], [0.2, 0.04]), Draft([], [])]
    flat = LatencyModel({(1, 1): 10.0, (1, 64): 11.0})
    assert choose_drafts(drafts, 3, 3, 3.0, flat) == [3, 2, 0]
    steep = LatencyModel({(1, 1): 10.0, (1, 2): 20.0, (1, 64): 640.0})
    assert choose_drafts(drafts, 3, 3, 3.0, steep) == [0, 0, 0]
    mid = LatencyModel({(1, 1): 10.0, (1, 16): 16.0})  # +0.4 ms per token on a 10 ms step
    assert choose_drafts(drafts, 3, 3, 3.0, mid) == [3, 1, 0]
    # a step in the curve (one more token crosses a tile edge) is not the end: the best prefix wins
    stair = LatencyModel({(1, 3): 10.0, (1, 4): 14.0, (1, 8): 14.0, (1, 9): 30.0})
    assert choose_drafts(drafts, 3, 3, 3.0, stair) == [3, 2, 0]


def test_latency_model_is_a_grid_over_sequences_and_tokens():
    m = LatencyModel({(1, 1): 10.0, (1, 4): 16.0, (4, 4): 40.0, (4, 16): 64.0})
    assert m.predict(1, 1) == 10.0 and m.predict(1, 2) == 12.0 and m.predict(1, 8) == 24.0
    assert m.predict(4, 10) == 52.0 and m.predict(8, 16) == 64.0  # past the last row: the last row
    assert m.predict(2, 4) == pytest.approx(16.0 + (40.0 - 16.0) / 3)  # a third of the way from 1 to 4 rows
    m.observe(1, 4, 26.0, weight=0.5)
    assert m.predict(1, 4) == 21.0 and m.predict(1, 1) == 10.0
    before = m.predict(1, 2)
    m.observe(1, 2, 22.0, weight=1.0)  # a third of the way from 1 to 4 tokens: a third of the error goes to 4
    err = 22.0 - before
    assert m.ms[0] == pytest.approx([10.0 + 2 / 3 * err, 21.0 + 1 / 3 * err])
    assert LatencyModel(dict(((s, t), ms) for s, t, ms in m.to_json())).ms == m.ms


def test_engine_with_confidence_schedule_keeps_greedy_outputs(tiny_model, tmp_path, monkeypatch):
    native_kernels()  # the native kernel's build cache is under the real ~/.cache: load it first
    monkeypatch.setenv("HOME", str(tmp_path))  # the latency table cache goes under ~/.cache
    art = deepfuse.compile(tiny_model)
    prompt = [5, 17, 99, 3, 5, 17, 99, 3, 5, 17]
    p = [SamplingParams(temperature=0, max_tokens=24)] * 3
    plain = Engine(art).generate([prompt] * 3, p)
    eng = Engine(art, spec=SpecConfig(num_draft_tokens=4))
    assert eng.latency is not None and eng.latency.seqs[0] == 1
    assert [o.outputs[0].token_ids for o in eng.generate([prompt] * 3, p)] == [o.outputs[0].token_ids for o in plain]
    cached = list((tmp_path / ".cache" / "deepfuse" / "latency").iterdir())
    again = Engine(art, spec=SpecConfig()).latency  # read from the cache: the same grid
    assert len(cached) == 1 and (again.seqs, again.tokens) == (eng.latency.seqs, eng.latency.tokens)


def test_draft_model_drafter_keeps_outputs_and_a_copy_of_the_target_is_always_right(tiny_model):
    target = deepfuse.compile(tiny_model)
    prompts = [[5, 17, 99, 3, 42], [9, 2, 64, 1, 7, 7, 8], [100]]
    params = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16)]
    plain = Engine(target).generate(prompts, params)
    half = Engine(target, spec=SpecConfig(method="draft", num_draft_tokens=3, schedule="fixed"),
                  draft_model=deepfuse.compile(tiny_model.first_layers(1)))
    outs = half.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    check_spec_accounting(half, outs, 3)
    same = Engine(target, spec=SpecConfig(method="draft", num_draft_tokens=4, schedule="fixed"),
                  draft_model=deepfuse.compile(tiny_model))
    outs = same.generate(prompts[:2], params[:2])  # greedy drafts of the target itself are never wrong
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain[:2]]
    assert same.spec_stats.acceptance_rate == 1.0 and same.spec_stats.mean_accepted_length > 3
    # every draft kept: each verification drafts all it may (min(4, max_tokens - generated - 1))
    # and gains that many tokens and one more. A drafter as costly as the target (cost 1: r + ... +
    # r^4 never exceeds 4) drafts for a request's first two verifications, then only every 8th
    # round (DraftGate's probe); the rounds between are plain decode steps
    for o, p in zip(outs, params):
        generated, drafted, verifications, skipped = 1, 0, 0, 0
        while generated < len(o.outputs[0].token_ids):
            room = min(4, p.max_tokens - generated - 1)
            if room > 0 and verifications >= 2:
                skipped = (skipped + 1) % 8
            if room > 0 and (verifications < 2 or skipped == 0):
                drafted, verifications, generated = drafted + room, verifications + 1, generated + room + 1
            else:
                generated += 1
        assert (o.metrics.spec.drafted, o.metrics.spec.verifications) == (drafted, verifications)


def test_draft_model_with_another_vocabulary_or_none_is_refused(tiny_model, tmp_path):
    from transformers import LlamaForCausalLM

    from deepfuse.models import load_model
    from tests.conftest import tiny_hf_config

    LlamaForCausalLM(tiny_hf_config(vocab_size=64)).save_pretrained(tmp_path)
    other = deepfuse.compile(load_model(str(tmp_path), with_tokenizer=False)[0])
    target = deepfuse.compile(tiny_model)
    with pytest.raises(DeepfuseError, match=r"vocabulary \(64 tokens\) differs from the target's \(128\)"):
        Engine(target, spec=SpecConfig(method="draft"), draft_model=other)
    with pytest.raises(DeepfuseError, match="needs a draft_model"):
        Engine(target, spec=SpecConfig(method="draft"))
    with pytest.raises(ValueError, match="1 <= n < 2"):
        tiny_model.first_layers(2)


def test_spec_verify_op_keeps_each_sequence_until_its_first_rejected_draft():
    """The step's spec_verify against the plain loop it replaces, on random groups of rows."""
    import random

    from deepfuse.ir import OPS

    def loop(tokens, drafts):
        out, keep = [], True
        for t, d in zip(tokens, drafts):
            out.append(t if keep else -1)
            keep = d < 0 or (keep and t == d)
        return out

    rng = random.Random(0)
    for _ in range(500):
        tokens, drafts = [], []
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(1, 5)
            tokens += [rng.randint(0, 3) for _ in range(n)]
            drafts += [rng.randint(0, 3) for _ in range(n - 1)] + [-1]
        got = OPS["spec_verify"].reference(torch.tensor(tokens), torch.tensor(drafts)).tolist()
        assert got == loop(tokens, drafts)
    assert OPS["spec_verify"].reference(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)).numel() == 0


def test_host_sampled_requests_verify_drafts_and_keep_their_tokens(tiny_model):
    """Requests drawn on the host (host_sampling.py) verify drafts there, row by row, and keep the
    tokens decoding without drafts gives them; those whose penalties count the output take none."""
    target = deepfuse.compile(tiny_model)
    prompts = [[5, 17, 99, 3, 42], [9, 2, 64, 1, 7, 7, 8], [100, 5, 17], [3, 3, 4], [42, 41]]
    params = [SamplingParams(temperature=0, max_tokens=16, logit_bias={5: 1.5, 17: -2.0}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16, min_p=0.05),
              SamplingParams(temperature=0, max_tokens=16, allowed_token_ids=list(range(0, 128, 3))),
              SamplingParams(temperature=0.7, seed=11, max_tokens=16, min_tokens=8, stop_token_ids=[17, 99]),
              SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3)]
    plain = [o.outputs[0].token_ids for o in Engine(target).generate(prompts, params)]
    by_model = Engine(target, spec=SpecConfig(method="draft", num_draft_tokens=3, schedule="fixed"),
                      draft_model=deepfuse.compile(tiny_model))
    outs = by_model.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert all(o.metrics.spec.drafted > 0 for o in outs[:4]) and outs[4].metrics.spec.drafted == 0
    check_spec_accounting(by_model, outs, 3)
    by_ngram = Engine(target, spec=SpecConfig(num_draft_tokens=3, schedule="fixed"))
    outs = by_ngram.generate(prompts, params)  # the first request repeats a token: its copies are kept
    assert [o.outputs[0].token_ids for o in outs] == plain and outs[0].metrics.spec.accepted >= 6
