"""Batch-invariant sm90 builds (compile(..., target="sm90", batch_invariant=True)), in Triton's
interpreter, f32: a sequence's logits are bit-identical whether its prompt runs as one chunk or
as a long chunk plus a short one, alone or beside another sequence's long chunk (a step of more
than 64 rows), and likewise for a decode step; the default (sized) build differs in those bits,
so the comparison can fail. Dense Llama and Mixtral (grouped MoE GEMMs)."""
import os

import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
PROMPT = [(5 * i + 3) % 120 + 1 for i in range(20)]
OTHER = [(7 * i + 1) % 120 + 1 for i in range(70)]  # with PROMPT: 90 rows, past the decode GEMMs' 64


def last_logits(art, config, chunks_of_probe: list[int], beside: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The probe's logits after its prompt (run as chunks of the given sizes, the other
    sequence's 70-token chunk in the last step when `beside`) and after one decode step (again
    beside the other's chunk when `beside`)."""
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32,
                    CacheConfig(block_size=16, num_blocks=32))
    probe, other = [0, 1, 2], [10, 11, 12, 13, 14]
    start = 0
    for i, n in enumerate(chunks_of_probe):
        chunks = [SeqChunk(PROMPT[start:start + n], start, probe)]
        if beside and i == len(chunks_of_probe) - 1:
            chunks.append(SeqChunk(OTHER, 0, other))
        logits, _, _ = art(build_step(chunks, cache))
        start += n
    prefill = logits[0].clone()
    chunks = [SeqChunk([PROMPT[-1]], len(PROMPT), probe)]  # the same token id: only the rows around it change
    if beside:
        chunks.append(SeqChunk(OTHER[:69], 0, [20, 21, 22, 23, 24]))
    logits, _, _ = art(build_step(chunks, cache))
    return prefill, logits[0].clone()


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def model(request, tiny_model, tmp_path_factory):
    if request.param == "llama":
        return tiny_model
    from transformers import MixtralConfig, MixtralForCausalLM

    from deepfuse.models import load_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mixtral_bi")
    MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    ).eval().save_pretrained(path)
    return load_model(str(path), with_tokenizer=False)[0]


def runs(art, config) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {"one chunk, alone": last_logits(art, config, [20], beside=False),
            "17 + 3, alone": last_logits(art, config, [17, 3], beside=False),
            "one chunk, beside 70 rows": last_logits(art, config, [20], beside=True)}


def test_a_rows_logits_do_not_depend_on_its_step(model):
    art = deepfuse.compile(model, target="sm90", batch_invariant=True)
    assert art.batch_invariant and art.runner.kernel_source == "interpret"
    got = runs(art, model.config)
    (want_prefill, want_decode), *others = got.values()
    for name, (prefill, decode) in list(got.items())[1:]:
        assert torch.equal(prefill, want_prefill), name
        assert torch.equal(decode, want_decode), name
    # the same comparisons on the default build: split-K decode GEMMs up to 64 rows, split-KV
    # attention for a chunk of a few queries, so the bits move with the step
    sized = runs(deepfuse.compile(model, target="sm90"), model.config)
    (base_prefill, base_decode), *_ = sized.values()
    assert any(not torch.equal(p, base_prefill) or not torch.equal(d, base_decode) for p, d in list(sized.values())[1:])
    torch.testing.assert_close(base_prefill, want_prefill, rtol=1e-4, atol=1e-4)  # the same function


def test_invariant_plan_runs_one_kernel_form_per_op(tiny_model):
    plan = deepfuse.compile(tiny_model, target="sm90", batch_invariant=True).plan
    names = [spec["name"] for p in plan["launches"] for spec in p.get("kernels", [])]
    assert not any("when" in spec for p in plan["launches"] for spec in p.get("kernels", []))
    assert any(n.endswith("_decode") for n in names) and not any(n.endswith("_split") for n in names)
    assert plan["batch_invariant"]


def test_targets_without_batch_invariance_refuse_it(tiny_model):
    with pytest.raises(DeepfuseError, match="cpu, sm90, sm100 targets, not 'ascend950'"):
        deepfuse.compile(tiny_model, target="ascend950", batch_invariant=True)
