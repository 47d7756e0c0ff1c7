"""LLM, the offline face, on SmolLM2: text prompts, chat conversations, n completions."""
import pytest

from deepfuse import LLM
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.engine import Engine, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(smollm2_compiled):
    return LLM(smollm2_compiled, num_blocks=256)


def test_text_prompts_equal_the_engine_on_their_token_ids(llm, smollm2, smollm2_compiled):
    tok = smollm2[1]
    texts = ["The capital of France is", "Bread is made from"]
    got = llm.generate(texts, GREEDY)
    want = Engine(smollm2_compiled).generate([tok.encode(t) for t in texts], [GREEDY] * 2)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [tok.decode(o.outputs[0].token_ids) for o in want]
    assert llm.generate("The capital of France is", GREEDY)[0].outputs[0].token_ids == got[0].outputs[0].token_ids


def test_chat_takes_a_message_a_conversation_or_a_list_of_them(llm, smollm2):
    tok = smollm2[1]
    question = "What is the capital of France?"
    one, = llm.chat(question, GREEDY)
    want = llm.generate([tok.render_chat([{"role": "user", "content": question}])], GREEDY)[0]
    assert one.outputs[0].token_ids == want.outputs[0].token_ids and "Paris" in one.outputs[0].text
    talk = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": question}]
    alone, = llm.chat(talk, GREEDY)
    assert alone.outputs[0].token_ids == llm.generate([tok.render_chat(talk)], GREEDY)[0].outputs[0].token_ids
    both = llm.chat([talk, [{"role": "user", "content": question}]], GREEDY)
    assert [o.outputs[0].token_ids for o in both] == [alone.outputs[0].token_ids, one.outputs[0].token_ids]
    for bad in ([{"role": "user"}], [], [{"role": "user", "content": 3}], 42):
        with pytest.raises(DeepfuseError, match="conversation must be"):
            llm.chat(bad, GREEDY)


def test_n_completions_through_llm(llm):
    out = llm.generate(["Once upon a time"], SamplingParams(n=3, temperature=1.0, seed=4, max_tokens=10))[0]
    assert len(out.outputs) == 3 and len({tuple(s.token_ids) for s in out.outputs}) == 3
    first = llm.generate(["Once upon a time"], SamplingParams(temperature=1.0, seed=4, max_tokens=10))[0]
    assert first.outputs[0].token_ids == out.outputs[0].token_ids


def test_vllm_prompt_dicts_and_keyword_equal_their_plain_forms(llm, smollm2):
    tok = smollm2[1]
    text = "The capital of France is"
    want = llm.generate([text], GREEDY)[0].outputs[0].token_ids
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": tok.encode(text)}, {"prompt_ids": [1, 2]},
                         {"prompt": text, "extra": 1}], GREEDY)
    assert [o.outputs[0].token_ids for o in outs[:2]] == [want, want]
    assert [o.outputs[0].finish_reason for o in outs[2:]] == ["error", "error"]
    assert "{'prompt_token_ids': [int]}; got dict" in str(outs[2].error)
    assert llm.generate({"prompt": text}, sampling_params=GREEDY)[0].outputs[0].token_ids == want  # vLLM's keyword
