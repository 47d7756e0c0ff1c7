"""vLLM's offline examples (generate, chat, n > 1), written as a vLLM user writes them: only the
import and the model differ. The outputs must have vLLM's shape (RequestOutput with
CompletionOutputs) and agree with the tokenizer and with each other."""
import contextlib
import io

import pytest

from deepfuse import LLM, CompletionOutput, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def model(smollm2_compiled):
    return smollm2_compiled  # the model name a vLLM example gives


def run_printing(fn) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn()
    return out.getvalue()


def test_basic_generate_example(model, smollm2):
    prompts = [
        "Hello, my name is",
        "The president of the United States is",
        "The capital of France is",
        "The future of AI is",
    ]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95)
    llm = LLM(model=model)
    outputs = []

    def main():
        outputs.extend(llm.generate(prompts, sampling_params))
        print("\nGenerated Outputs:\n" + "-" * 60)
        for output in outputs:
            prompt = output.prompt
            generated_text = output.outputs[0].text
            print(f"Prompt:    {prompt!r}")
            print(f"Output:    {generated_text!r}")
            print("-" * 60)

    printed = run_printing(main)
    tok = smollm2[1]
    assert [o.prompt for o in outputs] == prompts
    for output in outputs:
        assert isinstance(output, RequestOutput) and output.finished and output.request_id
        assert output.prompt_token_ids == tok.encode(output.prompt) and output.prompt_logprobs is None
        done = output.outputs[0]
        assert isinstance(done, CompletionOutput) and done.index == 0 and done.finished()
        assert done.finish_reason in ("stop", "length") and 0 < len(done.token_ids) <= 16  # vLLM's default max_tokens
        assert done.text == tok.decode(done.token_ids) and f"Output:    {done.text!r}" in printed
        assert done.cumulative_logprob is None and done.logprobs is None
        assert output.metrics.ttft_s > 0 and len(done.token_times) == len(done.token_ids)


def test_chat_example(model, smollm2):
    llm = LLM(model=model)
    sampling_params = SamplingParams(temperature=0.5, max_tokens=24)

    def print_outputs(outputs):
        print("\nGenerated Outputs:\n" + "-" * 80)
        for output in outputs:
            prompt = output.prompt
            generated_text = output.outputs[0].text
            print(f"Prompt: {prompt!r}\n")
            print(f"Generated text: {generated_text!r}")
            print("-" * 80)

    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I assist you today?"},
        {"role": "user", "content": "Write an essay about the importance of higher education."},
    ]
    got = []

    def main():
        outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
        print_outputs(outputs)
        got.append(outputs)
        conversations = [conversation for _ in range(3)]
        outputs = llm.chat(conversations, sampling_params, use_tqdm=True)
        print_outputs(outputs)
        got.append(outputs)

    printed = run_printing(main)
    tok = smollm2[1]
    one, batch = got
    assert len(one) == 1 and len(batch) == 3
    rendered = tok.render_chat(conversation)
    for output in one + batch:
        assert output.prompt == rendered and output.prompt_token_ids == tok.encode(rendered)
        assert output.outputs[0].text and f"Generated text: {output.outputs[0].text!r}" in printed


def test_parallel_sampling_example(model):
    """n completions of each prompt, each its own CompletionOutput (vLLM's n > 1)."""
    llm = LLM(model=model)
    prompts = ["Hello, my name is", "The capital of France is"]
    sampling_params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_tokens=12, seed=0)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        assert [o.index for o in output.outputs] == [0, 1, 2]
        assert len({tuple(o.token_ids) for o in output.outputs}) == 3  # seeded apart
        for i, o in enumerate(output.outputs):
            print(f"{output.prompt!r} sample {i}: {o.text!r}")
    # completion 0 is the n = 1 run, the others are seeded from (seed, j)
    alone = llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.95, max_tokens=12, seed=0))
    assert [o.outputs[0].token_ids for o in alone] == [o.outputs[0].token_ids for o in outputs]
