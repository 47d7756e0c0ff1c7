"""DeepSeek-V3-style MoE (sigmoid scores, score-correction bias, grouped top-k, routed scaling,
shared experts) against transformers' own DeepseekV3MoE block, same weights: the IR
reference, the dense decomposition and the CPU grouped-GEMM kernel."""
import pytest
import torch

from deepfuse.codegen.cpu.kernels import PREPACKED
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import OPS, interpret
from deepfuse.passes import fuse_moe
from deepfuse.passes.decompose import decompose_unsupported


@pytest.fixture(scope="module")
def block():
    return make_block()


def make_block():
    """(config, transformers' DeepseekV3MoE) with random weights and score bias."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(0)
    cfg = DeepseekV3Config(hidden_size=64, moe_intermediate_size=32, n_routed_experts=16, num_experts_per_tok=4,
                           n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
    m = DeepseekV3MoE(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
        m.gate.e_score_correction_bias.normal_(0, 0.1)
    return cfg, m


def routing(cfg):
    return dict(top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob, scoring="sigmoid",
                routed_scaling=cfg.routed_scaling_factor, n_group=cfg.n_group, topk_group=cfg.topk_group)


def weights(m):
    sh = m.shared_experts
    return {"router": m.gate.weight.detach(), "w13": m.experts.gate_up_proj.detach(),
            "w2": m.experts.down_proj.detach(), "bias": m.gate.e_score_correction_bias.detach(),
            "shared_w13": torch.cat((sh.gate_proj.weight, sh.up_proj.weight)).detach(),
            "shared_w2": sh.down_proj.weight.detach()}


def test_moe_block_matches_transformers_every_way(block):
    cfg, m = block
    w = weights(m)
    x = torch.randn(9, 64)
    with torch.no_grad():
        want = m(x[None])[0]

    def fn(x):
        routed = ops.moe(x, ops.linear(x, w["router"]), w["w13"], w["w2"], w["bias"], **routing(cfg))
        shared = ops.linear(ops.swiglu(ops.linear(x, w["shared_w13"])), w["shared_w2"])
        return ops.add(routed, shared)

    g = trace(fn, Spec("x", "f32", ("T", 64)), weights=w)
    torch.testing.assert_close(interpret(g, {"x": x})[0], want, atol=1e-5, rtol=1e-5)
    fused = fuse_moe(g.copy())
    assert fuse_moe.fn.fired == {"fused_moe": 0, "fused_moe_biased": 1}
    torch.testing.assert_close(interpret(fused, {"x": x})[0], want, atol=1e-5, rtol=1e-5)
    dense = decompose_unsupported(set(OPS) - {"moe", "fused_moe"})(fused.copy())
    assert "moe_routing" in dense.op_counts()
    torch.testing.assert_close(interpret(dense, {"x": x})[0], want, atol=1e-5, rtol=1e-5)
    node = next(n for n in fused.nodes if n.op == "fused_moe")
    packed = PREPACKED["fused_moe"].pack(torch.float32, w["router"], w["w13"], w["w2"])
    routed = PREPACKED["fused_moe"].make(node.attrs)(x, packed, w["bias"])
    shared = torch.nn.functional.linear(OPS["swiglu"].reference(x @ w["shared_w13"].T), w["shared_w2"])
    torch.testing.assert_close(routed + shared, want, atol=1e-5, rtol=1e-5)


def test_bad_routing_attrs_are_refused():
    from deepfuse.ir import TensorType

    t = lambda *s: TensorType("f32", s)
    with pytest.raises(ValueError, match="scoring must be softmax or sigmoid"):
        OPS["moe"].infer([t("T", 8), t("T", 4), t(4, 6, 8), t(4, 8, 3)], {"top_k": 2, "renormalize": True, "scoring": "relu"})
    with pytest.raises(ValueError, match="groups 3/1 do not fit 4 experts"):
        OPS["moe"].infer([t("T", 8), t("T", 4), t(4, 6, 8), t(4, 8, 3)], {"top_k": 2, "renormalize": True, "n_group": 3})


def test_fusion_pipeline_keeps_the_router_out_of_the_shared_expert_merge(block):
    """The router and the shared expert's gate/up all read x: fuse_moe runs before
    fuse_sibling_linears, so the router stays fused_moe's; gate/up merge, become a swiglu,
    and fuse_shared_experts folds the shared MLP into fused_moe as an always-on expert."""
    from deepfuse.passes import PassManager, cleanup_passes, fusion_passes

    cfg, m = block
    w = weights(m)
    sh = m.shared_experts
    w.update(gate=sh.gate_proj.weight.detach(), up=sh.up_proj.weight.detach())

    def fn(x):
        routed = ops.moe(x, ops.linear(x, w["router"]), w["w13"], w["w2"], w["bias"], **routing(cfg))
        gate, up = ops.silu(ops.linear(x, w["gate"])), ops.linear(x, w["up"])
        return ops.add(routed, ops.linear(ops.mul(gate, up), w["shared_w2"]))

    g, _ = PassManager(cleanup_passes() + fusion_passes()).run(trace(fn, Spec("x", "f32", ("T", 64)), weights=w))
    counts = g.op_counts()
    assert counts == {"fused_moe": 1}, counts
    node = g.nodes[0]
    assert node.attrs["num_shared"] == 1 and node.inputs[2].type.shape[0] == cfg.n_routed_experts + 1
    from deepfuse.codegen.cpu import CpuExecutor, build_plan

    x = torch.randn(5, 64)
    with torch.no_grad():
        want = m(x[None])[0]
    torch.testing.assert_close(interpret(g, {"x": x})[0], want, atol=1e-5, rtol=1e-5)
    cpu = CpuExecutor(build_plan(g), g.weights)  # the grouped GEMM with the shared expert as expert 16
    torch.testing.assert_close(cpu({"x": x})[0], want, atol=1e-5, rtol=1e-5)
