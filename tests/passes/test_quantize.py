"""Weight-only int4: the format, the pass, the CPU kernels, and SmolLM2 end to end."""
import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu.kernels import PREPACKED_Q4
from deepfuse.compiler import trace_model
from deepfuse.errors import DeepfuseError
from deepfuse.ir import OPS, interpret, verify
from deepfuse.ir.opdefs_quant import dequantize_q4, quantize_q4
from deepfuse.models import Llama
from deepfuse.passes import PassManager, cleanup_passes, fusion_passes, quant_passes
from tests.helpers import greedy_with, tiny_gemma3


def q4_1_weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """What a Q4_1 GGUF tensor dequantizes to: fp16 scale and min per 32, q spanning 0..15."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g)
    q[..., 0], q[..., 1] = 0, 15  # llama.cpp's quantizer maps each group's min to 0 and max to 15
    d = (torch.rand(n, k // 32, 1, generator=g) * 0.02).half().float()
    m = (-torch.rand(n, k // 32, 1, generator=g) * 0.15).half().float()
    return (q * d + m).view(n, k)


def test_q4_1_weights_round_trip_exactly():
    w = q4_1_weights(48, 96)
    packed, scales, mins = quantize_q4(w, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (48, 48) and scales.shape == (48, 3)
    torch.testing.assert_close(dequantize_q4(packed, scales, mins), w, atol=1e-7, rtol=1e-6)


def test_quantization_error_is_at_most_half_a_step():
    w = torch.randn(16, 64)
    packed, scales, mins = quantize_q4(w, 32)
    err = (dequantize_q4(packed, scales, mins) - w).abs().view(16, 2, 32)
    assert bool((err <= scales[..., None] / 2 + 1e-6).all())
    const = torch.full((4, 32), 0.25)  # a constant group has scale 0 and must not divide by it
    torch.testing.assert_close(dequantize_q4(*quantize_q4(const, 32)), const)


def test_linear_q4_type_rule_names_the_problem():
    from deepfuse.ir import TensorType
    f32 = lambda *s: TensorType("f32", s)
    with pytest.raises(ValueError, match="u8"):
        OPS["linear_q4"].infer([f32("T", 64), f32(8, 32), f32(8, 2), f32(8, 2)], {"group_size": 32})
    with pytest.raises(ValueError, match="K mismatch"):
        OPS["linear_q4"].infer([f32("T", 64), TensorType("u8", (8, 16)), f32(8, 2), f32(8, 2)], {"group_size": 32})


def on_grid(model: Llama) -> Llama:
    """The model with every projection weight rounded to the int4 grid, so quantizing it is exact."""
    w = {k: (dequantize_q4(*quantize_q4(v, 32)) if v.dim() == 2 and "embed" not in k and "lm_head" not in k else v)
         for k, v in model.weights.items()}
    return Llama(model.config, w)


def test_quantize_pass_rewrites_every_projection_and_keeps_numerics(tiny_model):
    model = on_grid(tiny_model)
    before, _ = PassManager(cleanup_passes() + fusion_passes()).run(trace_model(model))
    after, reports = PassManager(quant_passes("int4")).run(before.copy())
    counts = after.op_counts()
    assert counts.get("linear", 0) == 0 and counts["linear_q4"] == before.op_counts()["linear"]
    assert reports[0].name == "quantize_int4"
    verify(after)
    again, _ = PassManager(quant_passes("int4")).run(after.copy())
    assert again.op_counts() == counts and set(again.weights) == set(after.weights)  # idempotent
    tokens = {}
    for name, g in (("before", before), ("after", after)):
        step = lambda inputs, g=g: interpret(g, inputs)
        tokens[name], logits = greedy_with(step, model.config, [1, 5, 9, 2], 6)
        tokens[name + "_logits"] = logits
    assert tokens["before"] == tokens["after"]
    torch.testing.assert_close(tokens["after_logits"], tokens["before_logits"], atol=1e-5, rtol=1e-5)


def test_unknown_quantization_is_refused(tiny_model):
    with pytest.raises(DeepfuseError, match="unknown quantization 'int3'"):
        deepfuse.compile(tiny_model, quant="int3")


@pytest.mark.parametrize("n", [48, 40])  # 40: not a multiple of 16, no int4 layout, dense copy only
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_cpu_int4_kernel_matches_reference_in_bf16(rows, n):
    torch.manual_seed(0)
    packed, scales, mins = quantize_q4(torch.randn(n, 64) * 0.1, 32)
    x = torch.randn(rows, 64).bfloat16()
    pre = PREPACKED_Q4["linear_q4"]
    w = pre.pack(torch.bfloat16, packed, scales, mins)
    assert (w.int4 is not None) == (n % 16 == 0)
    got = pre.make({})(x, w)
    want = OPS["linear_q4"].reference(x, packed, scales, mins, group_size=32)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=2e-2)


def test_smollm2_int4_f32_reproduces_q4_1_tokens(smollm2, smollm2_compiled, tmp_path):
    """SmolLM2's projections are Q4_1 in the GGUF: int4 in f32 must give the dense run's tokens,
    also after an artifact round trip."""
    model, tok = smollm2
    art = deepfuse.compile(model, quant="int4", tokenizer=tok)
    q4_projections = [n for n in art.graph.nodes if n.attrs.get("group_size") == 32]
    assert len(q4_projections) == 4 * model.config.num_layers  # qkv, o, gate_up, down: fused or not
    prompt = tok.encode("The three primary colors are")
    dense, dense_logits = greedy_with(smollm2_compiled, model.config, prompt, 12)
    q4, q4_logits = greedy_with(art, model.config, prompt, 12)
    assert q4 == dense
    torch.testing.assert_close(q4_logits, dense_logits, atol=1e-3, rtol=1e-4)
    loaded = deepfuse.load(art.save(str(tmp_path / "q4")))
    assert loaded.quant == "int4"
    assert greedy_with(loaded, model.config, prompt, 12)[0] == dense


def on_grid_all(model):
    """The model with every 2-D weight (the LM head / embedding included) on the int4 grid."""
    w = {k: (dequantize_q4(*quantize_q4(v, 32)) if v.dim() == 2 else v) for k, v in model.weights.items()}
    return type(model)(model.config, w)


def test_int4_head_quantizes_the_lm_head_and_keeps_numerics(tiny_model):
    """int4-head: logits become take_rows -> linear_q4 -> cast; with every weight on the grid the
    tokens and logits are the dense graph's. The head must really be read quantized: the same
    graph with the head's int4 params perturbed changes the logits."""
    model = on_grid_all(tiny_model)
    before, _ = PassManager(cleanup_passes() + fusion_passes()).run(trace_model(model))
    after, _ = PassManager(quant_passes("int4-head")).run(before.copy())
    counts = after.op_counts()
    assert counts.get("logits", 0) == 0 and counts.get("linear", 0) == 0
    assert counts["linear_q4"] == before.op_counts()["linear"] + 1
    assert "lm_head.weight" not in after.weights and "lm_head.weight.q4" in after.weights
    verify(after)
    plain, _ = PassManager(quant_passes("int4")).run(before.copy())
    assert plain.op_counts()["logits"] == 1  # plain int4 keeps the head dense
    got = {}
    for name, g in (("before", before), ("after", after)):
        got[name] = greedy_with(lambda inputs, g=g: interpret(g, inputs), model.config, [1, 5, 9, 2], 6)
    assert got["after"][0] == got["before"][0]
    torch.testing.assert_close(got["after"][1], got["before"][1], atol=1e-5, rtol=1e-5)
    after.weights["lm_head.weight.scales"] = after.weights["lm_head.weight.scales"] * 1.5
    moved = greedy_with(lambda inputs: interpret(after, inputs), model.config, [1, 5, 9, 2], 1)[1]
    assert (moved - got["before"][1]).abs().max().item() > 1e-3


def test_int4_head_of_a_tied_gemma_on_the_cpu():
    """A tied head (tiny Gemma 3): the embedding still gathers rows of the dense table, the head
    runs int4, and the CPU build in bf16 matches the interpreter on its own final graph."""
    model = on_grid_all(tiny_gemma3())
    cfg = model.config
    art = deepfuse.compile(model, dtype="bf16", quant="int4-head")
    assert "model.embed_tokens.weight" in art.graph.weights and "model.embed_tokens.weight.q4" in art.graph.weights
    assert art.graph.op_counts().get("logits", 0) == 0
    prompt = [3, 17, 42, 8, 91, 5, 60]
    want, want_logits = greedy_with(lambda inputs: interpret(art.graph, inputs), cfg, prompt, 8, dtype=torch.bfloat16)
    got, logits = greedy_with(art, cfg, prompt, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(logits, want_logits, atol=0.1, rtol=0.05)
    assert got[:4] == want[:4]


def test_int4_head8_keeps_int4_projections_and_an_int8_head(tiny_model):
    """int4-head8: the projections int4 as in "int4", the head logits_w8a8 on int8 weights; the CPU
    build's logits match the interpreter on its own graph and stay near the dense head's."""
    model = on_grid_all(tiny_model)
    art = deepfuse.compile(model, quant="int4-head8")
    plain = deepfuse.compile(model, quant="int4")
    counts = art.graph.op_counts()
    assert counts.get("logits", 0) == 0 and counts["logits_w8a8"] == 1 and "lm_head.weight.w8" in art.graph.weights
    assert {k: v for k, v in counts.items() if k != "logits_w8a8"} == \
        {k: v for k, v in plain.graph.op_counts().items() if k != "logits"}
    prompt = [1, 5, 9, 2, 7]
    want, want_logits = greedy_with(lambda inputs: interpret(art.graph, inputs), model.config, prompt, 6)
    got, logits = greedy_with(art, model.config, prompt, 6)
    assert got == want
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
    dense = greedy_with(plain, model.config, prompt, 1)[1]
    scale = dense.abs().max().item()
    assert 0 < (logits[0] - dense[0]).abs().max().item() < 0.05 * scale  # int8 rounding, not another head
