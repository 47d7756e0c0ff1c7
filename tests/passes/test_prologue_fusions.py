"""Norm -> GEMM and SwiGLU -> GEMM prologues, and QKV + RoPE + cache write: graph changes,
numerics under the interpreter, and the CPU kernels (f32 and prepacked bf16) against it."""
import pytest
import torch

import deepfuse
from deepfuse.compiler import trace_model
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret, print_graph
from deepfuse.passes import (
    PassManager,
    cleanup_passes,
    fuse_norm_linear,
    fuse_qkv_attention,
    fuse_swiglu_linear,
    fusion_passes,
    prologue_passes,
    quant_passes,
)
from deepfuse.passes.check import check_numerics
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache


def step_inputs(config, dtype=torch.float32):
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, dtype,
                    CacheConfig(block_size=4, num_blocks=32))
    return build_step([SeqChunk([5, 17, 99, 3, 42, 7], 0, []), SeqChunk([9, 2], 0, [])], cache)


def test_each_prologue_fusion_keeps_numerics_and_is_idempotent(tiny_model):
    g, _ = PassManager(cleanup_passes() + fusion_passes()).run(trace_model(tiny_model))
    inputs = step_inputs(tiny_model.config)
    layers = tiny_model.config.num_layers
    for p in prologue_passes():
        g = check_numerics(p, g, inputs)
    counts = g.op_counts()
    assert counts["qkv_attention"] == layers and "rope" not in counts and "split" not in counts
    assert "qkv_rope_cache" not in counts and "attention" not in counts
    assert counts["add_rms_norm_linear"] == 2 * layers - 1 and counts["rms_norm_linear"] == 1
    assert counts["swiglu_linear"] == layers and counts["linear"] == layers  # o_proj stays
    before = g.op_counts()
    for p in prologue_passes():
        g = p(g)
    assert g.op_counts() == before


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("bf16", 6e-2)])
def test_cpu_kernels_of_fused_ops_match_the_interpreter(tiny_model, dtype, tol):
    art = deepfuse.compile(tiny_model, dtype=dtype)
    assert "qkv_attention" in art.graph.op_counts()
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = step_inputs(tiny_model.config, torch_dtype), step_inputs(tiny_model.config, torch_dtype)
    want = interpret(art.graph, a)[0]
    got = art(b)[0]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for i in range(tiny_model.config.num_layers):
        torch.testing.assert_close(b[f"kv_cache.{i}"].float(), a[f"kv_cache.{i}"].float(), atol=tol, rtol=tol)


def attention_block(qkv, pos, cache, slots, tables, lens, qlens):
    q, k, v = ops.qkv_rope_cache(qkv, pos, cache, slots, sizes=[8, 4, 4], head_dim=4, theta=10000.0)
    return ops.attention(q, k, v, cache, slots, tables, lens, qlens, num_heads=2, num_kv_heads=1, head_dim=4,
                         scale=0.5, write_kv=False)


def attention_graph():
    return trace(attention_block, Spec("qkv", "f32", ("T", 16)), Spec("pos", "i64", ("T",)),
                 Spec("cache", "f32", (2, 8, 4, 1, 4)), Spec("slots", "i64", ("T",)),
                 Spec("tables", "i32", ("S", 8)), Spec("lens", "i32", ("S",)), Spec("qlens", "i32", ("S",)))


QKV_ATTENTION_AFTER = """\
graph attention_block(%qkv: f32[T,16], %pos: i64[T], %cache: f32[2,8,4,1,4], %slots: i64[T], %tables: i32[S,8], \
%lens: i32[S], %qlens: i32[S]) {
  %0: f32[T,8] = qkv_attention(%qkv, %pos, %cache, %slots, %tables, %lens, %qlens) {head_dim=4, num_heads=2, \
num_kv_heads=1, scale=0.5, sizes=[8, 4, 4], theta=10000.0, window=0}
  return %0
}
"""


def test_qkv_attention_golden_ir_numerics_and_idempotence():
    g = attention_graph()
    assert [n.op for n in g.nodes] == ["qkv_rope_cache", "attention"]
    cache = torch.zeros(2, 8, 4, 1, 4)
    inputs = {"qkv": torch.randn(7, 16), "pos": torch.tensor([0, 1, 2, 3, 4, 0, 1]), "cache": cache,
              "slots": torch.tensor([0, 1, 2, 3, 4, 8, 9]), "tables": torch.tensor([[0, 1] + [0] * 6, [2] + [0] * 7],
                                                                                  dtype=torch.int32),
              "lens": torch.tensor([5, 2], dtype=torch.int32), "qlens": torch.tensor([5, 2], dtype=torch.int32)}
    after = check_numerics(fuse_qkv_attention, g, inputs)
    assert print_graph(after) == QKV_ATTENTION_AFTER
    assert fuse_qkv_attention.fn.fired == {"qkv_attention": 1, "qkv_attention_qk_norm": 0, "qkv_attention_sinks": 0,
                                           "qkv_attention_qk_norm_sinks": 0}
    assert print_graph(fuse_qkv_attention(after.copy())) == QKV_ATTENTION_AFTER


def test_prologue_fusions_fire_on_int4_projections(tiny_model):
    passes = cleanup_passes() + fusion_passes() + quant_passes("int4")
    g, _ = PassManager(passes).run(trace_model(tiny_model))
    inputs = step_inputs(tiny_model.config)
    for p in (fuse_norm_linear, fuse_swiglu_linear):
        g = check_numerics(p, g, inputs)
    counts = g.op_counts()
    layers = tiny_model.config.num_layers
    assert fuse_norm_linear.fn.fired["add_rms_norm_linear_q4"] == 2 * layers - 1
    assert fuse_swiglu_linear.fn.fired == {"swiglu_linear": 0, "swiglu_linear_q4": layers, "swiglu_linear_w8a8": 0,
                                           "swiglu_linear_q4a8": 0}
    assert counts["linear_q4"] == layers  # o_proj: nothing before it to fuse
    fused = [n for n in g.nodes if n.op in ("rms_norm_linear", "add_rms_norm_linear", "swiglu_linear")]
    assert fused and all(n.attrs["group_size"] == 32 and n.inputs[-3].type.dtype == "u8" for n in fused)


def test_prologue_fusions_fire_on_w8a8_projections(tiny_model):
    """The norms before W8A8 projections fuse as before dense and int4 ones (the fused op takes
    wq and scale, and act_group); the numerics check runs the references before and after. The
    tiny model's down projection (K = 96) stays dense, so its SwiGLU fuses the dense way."""
    passes = cleanup_passes() + fusion_passes() + quant_passes("w8a8")
    g, _ = PassManager(passes).run(trace_model(tiny_model))
    inputs = step_inputs(tiny_model.config)
    for p in (fuse_norm_linear, fuse_swiglu_linear):
        g = check_numerics(p, g, inputs)
    layers = tiny_model.config.num_layers
    assert fuse_norm_linear.fn.fired["add_rms_norm_linear_w8a8"] == 2 * layers - 1
    assert fuse_norm_linear.fn.fired["rms_norm_linear_w8a8"] == 1
    assert fuse_swiglu_linear.fn.fired == {"swiglu_linear": layers, "swiglu_linear_q4": 0, "swiglu_linear_w8a8": 0,
                                           "swiglu_linear_q4a8": 0}
    fused = [n for n in g.nodes if n.op in ("rms_norm_linear", "add_rms_norm_linear")]
    assert fused and all(n.attrs["act_group"] == 64 and n.inputs[-2].type.dtype == "u8" for n in fused)


def test_prologue_fusions_fire_on_int4_a8_projections(tiny_model):
    """int4-a8: the norms and SwiGLUs fuse into linear_q4a8 projections (the fused op takes packed,
    scales and mins with group_size and act_group both 32); the numerics check runs the references
    before and after."""
    passes = cleanup_passes() + fusion_passes() + quant_passes("int4-a8")
    g, _ = PassManager(passes).run(trace_model(tiny_model))
    inputs = step_inputs(tiny_model.config)
    for p in (fuse_norm_linear, fuse_swiglu_linear):
        g = check_numerics(p, g, inputs)
    layers = tiny_model.config.num_layers
    assert fuse_norm_linear.fn.fired["add_rms_norm_linear_q4a8"] == 2 * layers - 1
    assert fuse_norm_linear.fn.fired["rms_norm_linear_q4a8"] == 1
    assert fuse_swiglu_linear.fn.fired == {"swiglu_linear": 0, "swiglu_linear_q4": 0, "swiglu_linear_w8a8": 0,
                                           "swiglu_linear_q4a8": layers}
    assert g.op_counts()["linear_q4a8"] == layers  # o_proj: nothing before it to fuse
    fused = [n for n in g.nodes if n.op in ("rms_norm_linear", "add_rms_norm_linear", "swiglu_linear")]
    assert fused and all(n.attrs["group_size"] == n.attrs["act_group"] == 32 and n.inputs[-3].type.dtype == "u8"
                         for n in fused)


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("bf16", 6e-2)])
def test_cpu_kernels_of_int4_fused_ops_match_the_interpreter(tiny_model, dtype, tol):
    art = deepfuse.compile(tiny_model, dtype=dtype, quant="int4")
    counts = art.graph.op_counts()
    assert "swiglu_linear" in counts and "add_rms_norm_linear" in counts and "linear" not in counts
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = step_inputs(tiny_model.config, torch_dtype), step_inputs(tiny_model.config, torch_dtype)
    torch.testing.assert_close(art(b)[0], interpret(art.graph, a)[0], atol=tol, rtol=tol)
