"""Host-side sampling settings (runtime/host_sampling.py) on SmolLM2 (f32) against transformers'
own logits processors where it has them (repetition_penalty, min_new_tokens, sequence_bias,
prefix_allowed_tokens_fn, MinPLogitsWarper) and against a plain loop over transformers' logits
for presence and frequency (vLLM's definitions)."""
import math
import os
from collections import Counter

import pytest
import torch

from deepfuse.models import smollm2_gguf_path
from deepfuse.runtime.engine import Engine, SamplingParams


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


def hf_generate(hf_model, ids: list[int], n: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, len(ids):].tolist()


def test_repetition_penalty_matches_transformers(hf_model, smollm2, smollm2_compiled):
    tok = smollm2[1]
    ids = tok.encode("List the planets of the solar system: Mercury, Venus,")
    eng = Engine(smollm2_compiled)
    plain = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=24)])[0].outputs[0].token_ids
    for r in (1.3, 0.8):
        want = hf_generate(hf_model, ids, 24, repetition_penalty=r)
        got = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=24, repetition_penalty=r)])[0].outputs[0].token_ids
        assert got == want and got != plain, r


def test_min_tokens_matches_transformers_min_new_tokens(hf_model, smollm2, smollm2_compiled):
    tok = smollm2[1]
    ids = tok.encode(tok.render_chat([{"role": "user", "content": "What is the capital of France?"}]))
    eng = Engine(smollm2_compiled)
    short = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=40)])[0]
    n = len(short.outputs[0].token_ids)  # its last token is EOS
    assert short.outputs[0].finish_reason == "stop" and n < 12  # ends early on its own
    for m in (n - 1, n, 16):  # EOS allowed at token n; the first min_tokens that bans it there; more
        want = hf_generate(hf_model, ids, 40, min_new_tokens=m)
        got = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=40, min_tokens=m)])[0]
        assert got.outputs[0].token_ids == want and len(got.outputs[0].token_ids) > m - (m < n), m
        assert got.outputs[0].finish_reason == ("stop" if len(got.outputs[0].token_ids) < 40 else "length")
        assert not set(got.outputs[0].token_ids[:m]) & set(tok.eos_ids)


def test_presence_and_frequency_follow_their_definition(hf_model, smollm2, smollm2_compiled):
    """Greedy over transformers' logits with logit[t] -= frequency * count(t) + presence * (count(t) > 0),
    count over the output so far, written out as a loop."""
    tok = smollm2[1]
    ids = tok.encode("Write the word 'apple' ten times:")
    eng = Engine(smollm2_compiled)
    plain = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)])[0].outputs[0].token_ids
    for presence, frequency in ((1.5, 0.0), (0.0, 0.7), (0.5, 0.5)):
        out, counts, past, step_ids = [], Counter(), None, torch.tensor([ids])
        with torch.no_grad():
            for _ in range(20):
                res = hf_model(step_ids, past_key_values=past, use_cache=True)
                past, logits = res.past_key_values, res.logits[0, -1].clone()
                for t, c in counts.items():
                    logits[t] -= frequency * c + presence
                nxt = int(logits.argmax())
                out.append(nxt)
                counts[nxt] += 1
                step_ids = torch.tensor([[nxt]])
        p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=presence,
                           frequency_penalty=frequency)
        assert eng.generate([ids], [p])[0].outputs[0].token_ids == out != plain, (presence, frequency)


def test_logit_bias_and_allowed_token_ids_match_transformers(hf_model, smollm2, smollm2_compiled):
    tok = smollm2[1]
    ids = tok.encode("The capital of France is")
    eng = Engine(smollm2_compiled)
    plain = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=12)])[0].outputs[0].token_ids
    bias = {plain[0]: -5.0, plain[1]: -2.5, tok.encode(" a")[0]: 3.0}
    want = hf_generate(hf_model, ids, 12, sequence_bias=[[[t], b] for t, b in bias.items()])
    got = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=12, logit_bias=bias)])[0].outputs[0].token_ids
    assert got == want != plain
    allowed = sorted({*tok.encode(" Paris, London and Rome are cities."), *tok.eos_ids})
    want = hf_generate(hf_model, ids, 12, prefix_allowed_tokens_fn=lambda _b, _ids: allowed)
    got = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=allowed)])[0]
    assert got.outputs[0].token_ids == want and set(got.outputs[0].token_ids) <= set(allowed)


def test_min_p_keeps_the_tokens_transformers_keeps(hf_model, smollm2, smollm2_compiled):
    """The tokens min_p leaves to draw from equal transformers' MinPLogitsWarper's on the same
    logits at the same temperature; every drawn token is one of them; min_p = 1 is greedy."""
    from transformers.generation.logits_process import MinPLogitsWarper

    from deepfuse.runtime.host_sampling import TokenCounts, adjust

    tok = smollm2[1]
    ids = tok.encode("My favourite food is")
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1:].float()
    for temperature, min_p in ((1.0, 0.05), (1.5, 0.1), (0.7, 0.3)):
        ours = logits.clone()
        p = SamplingParams(temperature=temperature, min_p=min_p)
        adjust(ours, [p], [TokenCounts(ids, [])], [[]])
        theirs = MinPLogitsWarper(min_p)(torch.tensor([ids]), logits / temperature)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(theirs)), (temperature, min_p)
        assert 3 <= int(torch.isfinite(ours).sum()) < 100  # a cut, not all or one
    eng = Engine(smollm2_compiled)
    base = dict(max_tokens=24, ignore_eos=True, seed=11, logprobs=1)
    for temperature, min_p in ((1.5, 0.1), (1.0, 0.3)):
        free = eng.generate([ids], [SamplingParams(temperature=temperature, **base)])[0]
        cut = eng.generate([ids], [SamplingParams(temperature=temperature, min_p=min_p, **base)])[0]
        gap = lambda out, T: [(max(v.logprob for v in lp.values()) - lp[t].logprob) / T
                              for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        assert max(gap(cut, temperature)) <= -math.log(min_p) + 1e-4 < max(gap(free, temperature))
    greedy = eng.generate([ids], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)])[0].outputs[0].token_ids
    assert eng.generate([ids], [SamplingParams(temperature=1.3, seed=2, min_p=1.0, max_tokens=24,
                                               ignore_eos=True)])[0].outputs[0].token_ids == greedy
