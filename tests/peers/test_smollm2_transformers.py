"""SmolLM2-135M-Instruct (Q4_1 GGUF): deepfuse vs transformers loading the same GGUF."""
import os

import pytest
import torch

from deepfuse.ir import interpret
from deepfuse.models import smollm2_gguf_path
from tests.helpers import eager_step, greedy_with, hf_greedy

PROMPTS = ["The three primary colors are", "def fibonacci(n):", "Paris is the capital of"]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = smollm2_gguf_path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_32_and_first_logits_match_transformers(prompt, hf_model, smollm2, smollm2_compiled):
    model, tok = smollm2
    ids = tok.encode(prompt)
    want, want_logits = hf_greedy(hf_model, ids, 32)
    got, logits = greedy_with(smollm2_compiled, model.config, ids, 32, block_size=16)
    assert (logits[0] - want_logits).abs().max().item() <= 1e-3
    assert got == want


def test_eager_interpreted_compiled_artifact_agree(smollm2, smollm2_compiled, tmp_path):
    import deepfuse

    model, tok = smollm2
    ids = tok.encode(PROMPTS[0])
    n = 8
    compiled = greedy_with(smollm2_compiled, model.config, ids, n)[0]
    eager = greedy_with(eager_step(model), model.config, ids, n)[0]
    from deepfuse.compiler import trace_model

    g = trace_model(model)
    traced = greedy_with(lambda i: interpret(g, i), model.config, ids, n)[0]
    smollm2_compiled.save(str(tmp_path / "art"))
    loaded = greedy_with(deepfuse.load(str(tmp_path / "art")), model.config, ids, n)[0]
    assert eager == traced == compiled == loaded


def test_chat_template_matches_transformers(smollm2):
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    hf_tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert smollm2[1].render_chat(msgs) == want
    assert smollm2[1].encode(want) == hf_tok(want, add_special_tokens=False).input_ids


def test_prompt_logprobs_match_transformers(hf_model, smollm2, smollm2_compiled):
    """Engine prompt logprobs (in 32-token chunks, beside another request) equal log_softmax of
    transformers' logits at every prompt position; the top-5 are transformers' top-5."""
    from deepfuse.runtime.engine import Engine, SamplingParams

    tok = smollm2[1]
    ids = tok.encode("The history of the printing press begins in China, where woodblock printing was "
                     "used on cloth and later on paper. Movable type came much later, and in Europe "
                     "Gutenberg's press of about 1440 made books cheap enough for many readers.")
    with torch.no_grad():
        want = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)  # [P, V]
    eng = Engine(smollm2_compiled, max_num_tokens=32)
    out = eng.generate([ids, tok.encode("Hello")], [SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=5),
                                                   SamplingParams(temperature=0, max_tokens=4)])[0]
    got = out.prompt_logprobs
    assert len(ids) > 40 and len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        assert abs(got[i][ids[i]].logprob - want[i - 1, ids[i]].item()) < 2e-3, i
        top, sixth = want[i - 1].topk(5), want[i - 1].topk(6).values[5].item()
        if top.values[4].item() - sixth > 1e-3:  # no near-tie at the edge of the top 5
            assert set(top.indices.tolist()) <= set(got[i]), i
            assert max(abs(got[i][t].logprob - v) for t, v in zip(top.indices.tolist(), top.values.tolist())) < 2e-3
