"""SmolLM2 in bf16 with int4 weights, compiled batch-invariant: a request's tokens are the same
alone, in a batch whose token budget chunks its prompt differently, and with speculative
decoding; a saved artifact keeps the property. (Without it this build's steps of a few rows
take torch's int4 GEMM and prompt chunks the native prefill kernel, and tokens drift apart.)"""
import pytest

import deepfuse
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.loader import load
from deepfuse.runtime.spec import SpecConfig

TOPICS = ["the ocean", "a lighthouse", "mountains", "bread", "a violin", "winter", "bees", "chess"]


@pytest.fixture(scope="module")
def invariant(smollm2, native):
    if not native.bf16_gemm_available():
        pytest.skip("neither AMX nor AVX512-BF16 on this machine: bf16 batch invariance is refused here")
    model, tok = smollm2
    return deepfuse.compile(model, dtype="bf16", quant="int4", tokenizer=tok, batch_invariant=True)


@pytest.fixture(scope="module")
def prompts(smollm2):
    tok = smollm2[1]
    short = [tok.encode(f"Write two sentences about {t}.") for t in TOPICS]
    story = " ".join(f"On day {i} the keeper wrote that the {w} had {v}." for i, (w, v) in
                     enumerate(zip(["lamp", "boat", "gull", "storm"] * 40, ["moved", "gone", "returned", "grown"] * 40)))
    return short + [tok.encode(story)[:n] for n in (180, 420, 700)]


def tokens(art, prompts, params, **engine):
    eng = Engine(art, CacheConfig(num_blocks=1024), **engine)
    return [o.outputs[0].token_ids for o in eng.generate(prompts, params, use_tqdm=False)]


def test_tokens_alone_equal_tokens_in_any_batch(invariant, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=7, ignore_eos=True)
    params = [greedy] * (len(prompts) - 1) + [seeded]
    # a 128-token budget splits the long prompts into chunks shared with other sequences' decodes
    together = tokens(invariant, prompts, params, max_num_tokens=128)
    alone = [tokens(invariant, [p], [q], max_num_tokens=1024)[0] for p, q in zip(prompts, params)]
    assert together == alone
    speculative = tokens(invariant, prompts, params, max_num_tokens=1024, spec=SpecConfig(num_draft_tokens=3))
    assert speculative == together


def test_artifact_keeps_batch_invariance(invariant, prompts, tmp_path):
    invariant.save(str(tmp_path))
    loaded = load(str(tmp_path))
    assert loaded.batch_invariant
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert tokens(loaded, prompts[-2:], [greedy] * 2, max_num_tokens=64) == \
        tokens(invariant, prompts[-2:], [greedy] * 2, max_num_tokens=1024)
