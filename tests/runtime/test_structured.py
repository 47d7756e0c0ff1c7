"""Structured outputs on SmolLM2: JSON schemas (nested objects, enums, arrays, bounded numbers),
regexes, choices and EBNF grammars hold for sampled outputs, alone and beside speculating
requests; bad specs fail alone with the reason; grammars are compiled once."""
import json
import re

import jsonschema
import pytest

from deepfuse import SamplingParams, StructuredOutputsParams
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.engine import Engine
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.spec import Draft, Drafter, SpecConfig

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "bright": {"type": "boolean"}},
     "required": ["color", "bright"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -10, "maximum": 10}, "y": {"type": "number", "minimum": 0, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1, "maximum": 5},
                                      "items": {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 4}},
     "required": ["score", "items"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def chat(smollm2):
    tok = smollm2[1]
    return lambda text: tok.encode(tok.render_chat([{"role": "user", "content": text}]))


def sampled(seed, **so):
    return SamplingParams(temperature=0.8, seed=seed, max_tokens=80, structured_outputs=StructuredOutputsParams(**so))


def test_params_are_checked():
    for bad in ({}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"choice": ["", "x"]}, {"grammar": 3},
                {"json": 5}):
        with pytest.raises(DeepfuseError, match="structured_outputs"):
            StructuredOutputsParams(**bad)
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")
    with pytest.raises(DeepfuseError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a+"})
    with pytest.raises(DeepfuseError, match="must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs="json")


def test_json_schemas_hold_under_speculation_with_the_tokens_of_plain_decoding(smollm2_compiled, chat):
    """Constrained requests verify n-gram drafts in a speculating engine (the other tests run
    without speculation) and keep the tokens a plain engine gives them (f32)."""
    eng = Engine(smollm2_compiled, CacheConfig(num_blocks=256), spec=SpecConfig(num_draft_tokens=3, schedule="fixed"))
    prompts = [chat(f"Answer with JSON for example number {i}.") for i in range(len(SCHEMAS))]
    params = [sampled(i, json=SCHEMAS[i % len(SCHEMAS)]) for i in range(len(prompts))]
    repeat = chat("Repeat exactly: one two three four, one two three four, one two three four.")
    plain = SamplingParams(temperature=0, max_tokens=24)
    outs = eng.generate(prompts + [repeat], params + [plain])
    for i, out in enumerate(outs[:-1]):
        done = out.outputs[0]
        assert done.finish_reason == "stop", (i, done.text)
        jsonschema.validate(json.loads(done.text), SCHEMAS[i % len(SCHEMAS)])
    alone = Engine(smollm2_compiled, CacheConfig(num_blocks=256)).generate(prompts + [repeat], params + [plain])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in alone]
    spec = [o.metrics.spec for o in outs]
    assert outs[-1].metrics.spec.drafted > 0 and sum(s.drafted for s in spec[:-1]) > 0
    assert sum(s.accepted for s in spec[:-1]) > 0  # drafts were kept, not only tried
    assert len(eng.grammars().cache) == len(SCHEMAS)  # each schema compiled once


class _FixedDrafts(Drafter):
    """Proposes the next k - 1 of `ids` (a request's known output) and then a token the grammar
    forbids; records every verification (output so far, drafts verified, accepted)."""

    def __init__(self, ids: list[int], forbidden: int):
        self.ids, self.forbidden, self.verified = ids, forbidden, []

    def propose_batch(self, requests, ks):
        drafts = []
        for r, k in zip(requests, ks):
            toks = (self.ids[len(r.generated):][:k - 1] + [self.forbidden])[:k]
            drafts.append(Draft(toks, [0.9] * len(toks)))
        return drafts

    def observe(self, request, drafted, accepted):
        self.verified.append((len(request.generated), drafted, accepted))


def test_drafts_the_grammar_forbids_are_never_verified(smollm2_compiled, smollm2, chat):
    prompt = chat("Give me an identifier.")
    p = SamplingParams(temperature=0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{3}-[0-9]{4}"))
    plain = Engine(smollm2_compiled, CacheConfig(num_blocks=64)).generate([prompt], [p])[0].outputs[0]
    eng = Engine(smollm2_compiled, CacheConfig(num_blocks=64), spec=SpecConfig(num_draft_tokens=4, schedule="fixed"))
    eng.drafter = drafter = _FixedDrafts(list(plain.token_ids), smollm2[1].encode("!")[0])
    out = eng.generate([prompt], [p])[0].outputs[0]
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", out.text) and out.token_ids == plain.token_ids
    # every draft ends in "!", which the regex never allows: only the known tokens before it are
    # verified (all of them, and all kept); without the grammar's cut, "!" would be verified too
    assert drafter.verified and all(n == a == min(3, len(plain.token_ids) - at)
                                    for at, n, a in drafter.verified)


def test_regex_choice_grammar_and_any_json_object(smollm2_compiled, chat):
    eng = Engine(smollm2_compiled, CacheConfig(num_blocks=256))
    prompt = chat("Give me an identifier.")
    kinds = [dict(regex=r"[A-Z]{2}-[0-9]{3,5}"), dict(choice=["yes", "no", "maybe (a.k.a. unsure)"]),
             dict(grammar='root ::= "The answer is " [0-9]+ "."'), dict(json_object=True)]
    outs = eng.generate([prompt] * 8, [sampled(s, **k) for s in (1, 2) for k in kinds])
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    for s in (0, 4):
        assert re.fullmatch(r"[A-Z]{2}-[0-9]{3,5}", texts[s]) and texts[s + 1] in kinds[1]["choice"]
        assert re.fullmatch(r"The answer is [0-9]+\.", texts[s + 2]) and isinstance(json.loads(texts[s + 3]), dict)


def test_specs_that_cannot_compile_fail_alone(smollm2_compiled, chat):
    eng = Engine(smollm2_compiled, CacheConfig(num_blocks=256))
    prompt = chat("Hi")
    bad = [dict(regex="([a-z"), dict(json="{nope"), dict(grammar="root ::= missing_rule")]
    outs = eng.generate([prompt] * 4, [sampled(0, **b) for b in bad] + [SamplingParams(temperature=0, max_tokens=4)])
    assert [o.outputs[0].finish_reason for o in outs[:3]] == ["error"] * 3
    assert "Unclosed" in str(outs[0].error) and "not valid JSON" in str(outs[1].error)
    assert "missing_rule" in str(outs[2].error) and outs[3].outputs[0].finish_reason in ("stop", "length")
    assert eng.kv.pool.num_used() == 0
