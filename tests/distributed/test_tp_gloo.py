"""Tensor / expert parallelism in 2 rank processes over gloo: the same greedy tokens as one process,
and log-probabilities (logits up to log_softmax's shift) within 1e-5."""
import dataclasses

import pytest
import torch

import deepfuse
from deepfuse.models import load_model
from deepfuse.runtime.distributed import RankOptions, ShardedEngine
from deepfuse.runtime.engine import Engine
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.request import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7, 64, 1], [9, 9, 2], list(range(20, 60))]
OPTIONS = RankOptions(with_tokenizer=False, block_size=4, num_blocks=128, max_num_tokens=32, max_num_seqs=4)


def _one_process(path: str) -> Engine:
    model, _ = load_model(path, with_tokenizer=False)
    return Engine(deepfuse.compile(model), CacheConfig(4, 128), 32, 4)


def _check_same(path: str, options: RankOptions = OPTIONS) -> None:
    params = [SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)] * len(PROMPTS) + \
             [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6, seed=7)]
    prompts = PROMPTS + [[11, 12, 13]]
    want = _one_process(path).generate(prompts, params)
    eng = ShardedEngine(path, 2, options)
    try:
        got = eng.generate(prompts, params)
    finally:
        eng.close()
    for w, g in zip(want, got):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
    for w, g in zip(want[:3], got[:3]):
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs):
            assert lw.keys() == lg.keys()
            assert max(abs(lw[t].logprob - lg[t].logprob) for t in lw) <= 1e-5


def test_tp2_tiny_llama_same_tokens_as_one_process(tiny_dir):
    _check_same(tiny_dir)


def test_ep2_tiny_moe_same_tokens_as_one_process(tmp_path):
    from tests.models.test_moe_families import qwen3_moe

    torch.manual_seed(0)
    qwen3_moe().eval().save_pretrained(tmp_path)
    _check_same(str(tmp_path))


def test_a_model_that_does_not_split_is_refused_before_starting_ranks(tiny_model):
    with pytest.raises(deepfuse.errors.DeepfuseError, match="num_kv_heads = 2 cannot be split over 4 ranks"):
        ShardedEngine(tiny_model, 4, OPTIONS)


@pytest.mark.slow
def test_tp2_smollm2_through_llm_same_tokens_as_one_process(smollm2_compiled):
    """SmolLM2's 3 kv heads split unevenly (1 and 2); its logits reach ~25, so the summation order of
    the partial sums moves them by a few 1e-5: log-probabilities are compared relative to that scale."""
    from deepfuse import LLM

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    want = LLM(smollm2_compiled, max_num_tokens=64, num_blocks=64).generate(prompts, params)
    llm = LLM("smollm2", tensor_parallel_size=2, max_num_tokens=64, num_blocks=64)
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.engine.close()
    for w, g in zip(want, got):
        w, g = w.outputs[0], g.outputs[0]
        assert g.token_ids == w.token_ids and g.text == w.text
        for lw, lg in zip(w.logprobs, g.logprobs):
            assert lw.keys() == lg.keys() and max(abs(lw[t].logprob - lg[t].logprob) for t in lw) <= 1e-4


def test_llm_refuses_settings_the_sharded_engine_does_not_take():
    from deepfuse import LLM

    with pytest.raises(deepfuse.errors.DeepfuseError, match="does not support kv_cache_dtype, quant yet"):
        LLM("smollm2", tensor_parallel_size=2, quant="int4", kv_cache_dtype="int8")
    with pytest.raises(deepfuse.errors.DeepfuseError, match="give tensor_parallel_size > 1"):
        LLM("smollm2", moe_dispatch="all_to_all")
    with pytest.raises(deepfuse.errors.DeepfuseError, match="moe_dispatch must be one of"):
        LLM("smollm2", tensor_parallel_size=2, moe_dispatch="a2a")


def test_tp2_on_sm90_in_the_interpreter_same_tokens_as_one_cpu_process(tiny_dir):
    """The sm90 target partitioned over 2 ranks, its kernels in Triton's interpreter and its
    collectives over gloo (NCCL where the ranks have GPUs): the one-process CPU build's greedy tokens."""
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)] * 2
    prompts = PROMPTS[:2]
    want = _one_process(tiny_dir).generate(prompts, params)
    eng = ShardedEngine(tiny_dir, 2, dataclasses.replace(OPTIONS, target="sm90", block_size=16, num_blocks=32))
    try:
        got = eng.generate(prompts, params)
    finally:
        eng.close()
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]


def test_tensor_parallel_refuses_an_unknown_target_before_starting_ranks(tiny_dir):
    from deepfuse import LLM

    with pytest.raises(deepfuse.errors.DeepfuseError, match="unknown target 'tpu9'"):
        LLM(tiny_dir, target="tpu9", tensor_parallel_size=2)


def test_ep2_all_to_all_tiny_moe_same_tokens_as_one_process(tmp_path):
    from tests.models.test_moe_families import mixtral

    torch.manual_seed(0)
    mixtral().eval().save_pretrained(tmp_path)
    _check_same(str(tmp_path), dataclasses.replace(OPTIONS, moe_dispatch="all_to_all"))
