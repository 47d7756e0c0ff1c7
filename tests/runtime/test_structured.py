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
from deepfuse.runtime.spec import SpecConfig

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


def test_json_schemas_hold_beside_speculating_requests(smollm2_compiled, chat):
    """In a speculating engine (the other tests run without speculation)."""
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
    alone = Engine(smollm2_compiled, CacheConfig(num_blocks=256)).generate([repeat], [plain])[0]
    assert outs[-1].outputs[0].token_ids == alone.outputs[0].token_ids  # f32: speculation keeps the tokens
    # the unconstrained request speculated; the constrained ones took no drafts
    assert outs[-1].metrics.spec.drafted > 0 and all(o.metrics.spec.drafted == 0 for o in outs[:-1])
    assert len(eng.grammars().cache) == len(SCHEMAS)  # each schema compiled once


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
