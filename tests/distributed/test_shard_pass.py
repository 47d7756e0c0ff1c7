"""The partitioning pass: golden per-rank IR of a tiny Llama at TP=2, and the numerics of all
ranks' graphs run together (collectives simulated) against the unpartitioned graph."""
import pytest
import torch

from deepfuse.codegen import get_target
from deepfuse.compiler import trace_model
from deepfuse.errors import DeepfuseError
from deepfuse.ir import interpret, parse_graph, print_graph, verify
from deepfuse.ir.spmd import SimulatedRanks
from deepfuse.models import load_model
from deepfuse.models.sharding import llama_sharding
from deepfuse.passes import PassManager
from deepfuse.passes.shard import R, S, ShardingSpec, partition, shard_pass
from tests.helpers import greedy_with

PROMPT = [5, 17, 99, 3, 42, 7, 64, 1]

LAYER = ["rms_norm", "linear", "linear", "rope", "rope", "linear", "attention", "linear", "all_reduce", "add",
         "rms_norm", "linear", "silu", "linear", "mul", "linear", "all_reduce", "add"]


def test_golden_tiny_llama_tp2(tiny_model):
    g = trace_model(tiny_model)
    spec = llama_sharding(tiny_model.config, 2)
    ranks = [partition(g, spec, r) for r in range(2)]
    for r in ranks:
        verify(r)
    want = ["vocab_embedding", "all_reduce"] + LAYER * 2 + ["rms_norm", "logits", "all_gather", "sample",
                                                            "spec_verify", "take_rows"]
    assert [n.op for n in ranks[0].nodes] == want == [n.op for n in ranks[1].nodes]
    text = [print_graph(r) for r in ranks]
    # 4 query heads and 2 kv heads of 16 over 2 ranks; o and down take half of their input features
    for line in ("param %model.layers.0.self_attn.q_proj.weight: f32[32,64]",
                 "param %model.layers.0.self_attn.k_proj.weight: f32[16,64]",
                 "param %model.layers.0.self_attn.o_proj.weight: f32[64,32]",
                 "param %model.layers.1.mlp.down_proj.weight: f32[64,48]",
                 "param %lm_head.weight: f32[64,64]", "%kv_cache.1: f32[2,N,BS,1,16]",
                 "%0: f32[T,64] = vocab_embedding(%model.embed_tokens.weight, %tokens) {start=0}",
                 "%1: f32[T,64] = all_reduce(%0) {world=2}",
                 "= attention(%5, %6, %7, %kv_cache.0, %slot_mapping, %block_tables, %seq_lens, %query_lens) "
                 "{head_dim=16, num_heads=2, num_kv_heads=1, scale=0.25, window=0}",
                 "%40: f32[R,128] = all_gather(%39) {dim=1, world=2}", "return %40, %42, %43"):
        assert line in text[0], line
    assert "vocab_embedding(%model.embed_tokens.weight, %tokens) {start=64}" in text[1]
    assert print_graph(parse_graph(text[1])) == text[1]  # the collectives round-trip like any op
    assert torch.equal(ranks[1].weights["model.layers.0.self_attn.k_proj.weight"],
                       g.weights["model.layers.0.self_attn.k_proj.weight"][16:])
    # every weight but the norms is split: the ranks together hold the model once, plus the norms twice
    norms = sum(w.numel() for k, w in g.weights.items() if k.endswith("norm.weight"))
    held = sum(w.numel() for r in ranks for w in r.weights.values())
    assert held == sum(w.numel() for w in g.weights.values()) + norms


def test_fusions_run_after_partitioning_and_dumps_show_collectives(tiny_model, tmp_path):
    spec = llama_sharding(tiny_model.config, 2)
    g, reports = PassManager([shard_pass(spec, 1), *get_target("cpu").pipeline()]).run(trace_model(tiny_model),
                                                                                  str(tmp_path))
    counts = g.op_counts()
    assert counts["all_reduce"] == 1 + 2 * 2 and counts["all_gather"] == 1
    assert reports[0].name == "shard_tp2_rank1" and "attention" not in counts  # fused into qkv_attention
    dumped = (tmp_path / "00-shard_tp2_rank1.after.ir").read_text()
    assert "all_reduce(" in dumped and "all_gather(" in dumped


def _simulated_vs_unpartitioned(model, world, steps=8, moe_dispatch="all_reduce"):
    g = trace_model(model)
    spec = llama_sharding(model.config, world, moe_dispatch)
    sim = SimulatedRanks([partition(g, spec, r) for r in range(world)])
    want, want_logits = greedy_with(lambda inputs: interpret(g, inputs), model.config, PROMPT, steps)
    got, logits = greedy_with(sim, model.config, PROMPT, steps)
    assert got == want
    assert (logits - want_logits).abs().max().item() <= 1e-5
    for out in sim.last[1:]:  # every rank ends with the same replicated outputs
        assert all(torch.equal(a, b) for a, b in zip(out, sim.last[0]))
    return sim


def test_simulated_tp2_tiny_llama_matches_unpartitioned(tiny_model):
    _simulated_vs_unpartitioned(tiny_model, 2)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_simulated_ep2_tiny_moe_matches_unpartitioned(name, tmp_path):
    from tests.models.test_moe_families import mixtral, qwen3_moe

    torch.manual_seed(0)
    {"qwen3_moe": qwen3_moe, "mixtral": mixtral}[name]().eval().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    sim = _simulated_vs_unpartitioned(model, 2)
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_layers))
    assert sim.graphs[0].op_counts()["moe_experts"] == moe_layers
    assert sim.graphs[1].weights["model.layers.0.mlp.experts.gate_up_proj"].shape[0] == 4  # 8 experts over 2


def test_reshard_slices_a_replicated_value_and_gathers_a_split_one():
    from deepfuse.frontend import Spec, ops, trace

    w2 = torch.randn(6, 8)
    g = trace(lambda x: ops.linear(ops.silu(x), w2), Spec("x", "f32", ("T", 8)), weights={"w2": w2})
    spec = ShardingSpec(2, params={"w2": S(1)}, inputs={"x": R})
    ranks = [partition(g, spec, r) for r in range(2)]
    assert [n.op for n in ranks[0].nodes] == ["silu", "take_shard", "linear", "all_reduce"]
    from deepfuse.ir.spmd import interpret_ranks

    x = torch.randn(3, 8)
    outs = interpret_ranks(ranks, [{"x": x}, {"x": x}])
    torch.testing.assert_close(outs[1][0], interpret(g, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_a_model_whose_heads_do_not_split_is_refused(tiny_model):
    with pytest.raises(DeepfuseError, match="num_kv_heads = 2 cannot be split over 4 ranks"):
        llama_sharding(tiny_model.config, 4)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_simulated_ep2_all_to_all_matches_unpartitioned(name, tmp_path):
    from tests.models.test_moe_families import mixtral, qwen3_moe

    torch.manual_seed(0)
    {"qwen3_moe": qwen3_moe, "mixtral": mixtral}[name]().eval().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    sim = _simulated_vs_unpartitioned(model, 2, moe_dispatch="all_to_all")
    counts = sim.graphs[0].op_counts()
    moe_layers = sum(model.config.is_moe_layer(i) for i in range(model.config.num_layers))
    assert "moe_experts" not in counts and counts["moe_dispatch"] == moe_layers
    assert counts["all_to_all"] == 4 * moe_layers
