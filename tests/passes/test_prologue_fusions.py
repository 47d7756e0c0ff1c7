"""Norm -> GEMM and SwiGLU -> GEMM prologues, and QKV + RoPE + cache write: graph changes,
numerics under the interpreter, and the CPU kernels (f32 and prepacked bf16) against it."""
import pytest
import torch

import deepfuse
from deepfuse.compiler import trace_model
from deepfuse.ir import interpret
from deepfuse.passes import PassManager, cleanup_passes, fusion_passes, prologue_passes
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
    assert counts["qkv_rope_cache"] == layers and "rope" not in counts and "split" not in counts
    assert counts["add_rms_norm_linear"] == 2 * layers - 1 and counts["rms_norm_linear"] == 1
    assert counts["swiglu_linear"] == layers and counts["linear"] == layers  # o_proj stays
    assert all(n.attrs["write_kv"] is False for n in g.nodes if n.op == "attention")
    before = g.op_counts()
    for p in prologue_passes():
        g = p(g)
    assert g.op_counts() == before


@pytest.mark.parametrize("dtype,tol", [("f32", 1e-4), ("bf16", 6e-2)])
def test_cpu_kernels_of_fused_ops_match_the_interpreter(tiny_model, dtype, tol):
    art = deepfuse.compile(tiny_model, dtype=dtype)
    assert "qkv_rope_cache" in art.graph.op_counts()
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    a, b = step_inputs(tiny_model.config, torch_dtype), step_inputs(tiny_model.config, torch_dtype)
    want = interpret(art.graph, a)[0]
    got = art(b)[0]
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    for i in range(tiny_model.config.num_layers):
        torch.testing.assert_close(b[f"kv_cache.{i}"].float(), a[f"kv_cache.{i}"].float(), atol=tol, rtol=tol)
