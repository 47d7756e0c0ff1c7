"""ascend950 (AscendC): every emitted kernel kind against the IR interpreter in deepfuse's CPU
emulator of the AscendC API (g++), the generated host launch code run the same way, the CANN
project in the artifact, and the emulator's strictness (misaligned copies, unified-buffer and
L0 overflow, DeQue before EnQue, missing pipe synchronisation). An emulator, not the
hardware: see docs/targets.md."""
import dataclasses
import json

import pytest
import torch

import deepfuse
from deepfuse.cli import main
from deepfuse.codegen.ascendc import build_plan
from deepfuse.codegen.ascendc.emit import emit_swiglu
from deepfuse.codegen.ascendc.emit_sample import emit_sample
from deepfuse.codegen.ascendc.emulate import launch
from deepfuse.codegen.ascendc.kernel import pack
from deepfuse.codegen.ascendc.runner import EmulatorRunner
from deepfuse.codegen.targets import get_target
from deepfuse.compiler import trace_model
from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret
from deepfuse.models import load_model
from deepfuse.passes import PassManager
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache
from tests.codegen.test_triton import mixed_step, tiny
from tests.conftest import needs_gxx
from tests.helpers import greedy_with, with_sinks
from tests.models.test_deepseek_moe_routing import make_block, routing, weights

pytestmark = needs_gxx
KINDS = {"embedding", "take_rows", "rms_norm_linear", "add_rms_norm_linear", "qkv_attention", "linear", "swiglu_linear",
         "kernel", "logits", "sample", "spec_verify"}  # kernel: the final add_rms_norm, generated


@pytest.mark.parametrize("i", [1536, 100], ids=["DataCopy", "DataCopyPad"])
def test_swiglu_kernel_matches_the_interpreter(i):
    g = trace(lambda x: ops.swiglu(x), Spec("x", "f32", ("T", 2 * i)))
    kernel = emit_swiglu(g.nodes[0], f"swiglu_{i}")
    x = torch.randn(5, 2 * i)
    got = torch.zeros(5, i)
    launch(kernel, [x, got], pack(kernel.tiling, [(5, 2 * i)]))
    torch.testing.assert_close(got, interpret(g, {"x": x})[0], atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=[{}, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}],
                ids=["gqa2", "gqa3"])
def model(request, tmp_path_factory):
    return tiny(tmp_path_factory, **request.param)


def step_matches(model, via_host: bool = False):
    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(model))
    plan = build_plan(g)
    a, b = mixed_step(model.config), mixed_step(model.config)
    got, want = EmulatorRunner(plan, g.weights, via_host=via_host)(b), interpret(g, a)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[1], want[1])
    for i in range(model.config.num_layers):
        torch.testing.assert_close(b[f"kv_cache.{i}"], a[f"kv_cache.{i}"], atol=1e-5, rtol=1e-5)
    return plan


def test_every_kernel_kind_matches_the_interpreter(model):
    """A mixed step (a 20-token prefill over two cache blocks, a 2-token prefill, a decode at
    position 17 over cached keys) through every kernel: fp32 within 1e-5."""
    plan = step_matches(model)
    assert {p["op"] for p in plan["launches"] if p.get("kernels")} == KINDS
    assert all(p.get("kernels") for p in plan["launches"])
    gemms = [k for p in plan["launches"] for k in p["kernels"] if k["core"] == "aic"]
    assert gemms and all("Matmul<A_TYPE, B_TYPE, C_TYPE, BIAS_TYPE>" in k["source"] for k in gemms)


def test_generated_host_code_launches_the_step(tiny_model):
    """The artifact's host/deepfuse_launch.cpp (tiling from the step's shapes, each kernel's
    <<<>>> launch function) compiled against the emulated aclrt runs the same step."""
    step_matches(tiny_model, via_host=True)


def test_attention_sinks_with_a_sliding_window(tiny_model):
    """gpt-oss-style sink logits start each head's online softmax; window 6 cuts the decode at 17."""
    plan = step_matches(with_sinks(tiny_model, window=6))
    att = next(p for p in plan["launches"] if p["op"] == "qkv_attention")["kernels"][1]
    assert "sinkGm.GetValue" in att["source"] and att["args"][-1] == ["in", 7]


def test_sliding_window_attention(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(1)
    MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                                     max_position_embeddings=256, head_dim=16)).save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    plan = step_matches(model)
    att = next(p for p in plan["launches"] if p["op"] == "qkv_attention")["kernels"][1]
    assert "pos - 6 + 1" in att["source"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request, tmp_path_factory):
    from tests.models import test_moe_families

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(request.param)
    getattr(test_moe_families, request.param)().eval().save_pretrained(path)
    return str(path)


def test_greedy_decoding_gives_the_cpu_targets_tokens(tiny_model):
    """Greedy decoding with an ascend950 artifact (its kernels in the emulator): the CPU
    target's tokens, through a prompt step and decode steps over 16-token cache blocks."""
    prompt = [5, 17, 99, 3, 42, 7, 64, 1, 9, 11, 23, 31, 40, 2, 8, 77, 101, 6]
    want = greedy_with(deepfuse.compile(tiny_model), tiny_model.config, prompt, 6, block_size=16)
    got = greedy_with(deepfuse.compile(tiny_model, target="ascend950"), tiny_model.config, prompt, 6, block_size=16)
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


def test_fused_moe_kernels_match_the_interpreter(moe_dir):
    """Qwen3-MoE (q/k head norms in the RoPE kernel) and Mixtral: fused_moe as router GEMM,
    routing, sort by expert, gather, grouped GEMMs, SwiGLU and combine."""
    model, _ = load_model(moe_dir, with_tokenizer=False)
    plan = step_matches(model)
    moe = [p for p in plan["launches"] if p["op"] == "fused_moe"]
    assert moe and all(len(p["kernels"]) == 8 for p in moe)
    assert all(p.get("kernels") for p in plan["launches"])


def test_deepseek_v3_moe_block_matches_transformers():
    """DeepSeek-V3 routing in the kernels: sigmoid scores, score-correction bias, group-limited
    top-k (4 groups, best 2), routed scaling, a shared expert folded in as an always-on expert;
    against transformers' DeepseekV3MoE with the same weights."""
    cfg, m = make_block()
    w = weights(m)

    def fn(x):
        routed = ops.moe(x, ops.linear(x, w["router"]), w["w13"], w["w2"], w["bias"], **routing(cfg))
        return ops.add(routed, ops.linear(ops.swiglu(ops.linear(x, w["shared_w13"])), w["shared_w2"]))

    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace(fn, Spec("x", "f32", ("T", 64)), weights=w))
    assert g.op_counts() == {"fused_moe": 1}
    route = build_plan(g)["launches"][0]["kernels"][1]["source"]
    assert "groupScore" in route and "Reciprocal" in route  # group-limited, sigmoid
    x = torch.randn(9, 64)
    with torch.no_grad():
        want = m(x[None])[0]
    torch.testing.assert_close(EmulatorRunner(build_plan(g), g.weights)({"x": x})[0], want, atol=1e-5, rtol=1e-5)


def random_cache_step(config, dtype, chunks: list, num_blocks: int = 8) -> dict:
    """The chunks' step inputs over a random-filled KV cache of 16-token blocks in `dtype`."""
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, dtype,
                    CacheConfig(block_size=16, num_blocks=num_blocks))
    torch.manual_seed(1)
    for i in range(config.num_layers):
        cache.layers[i].normal_()
    return build_step(chunks, cache)


HALF_TOLERANCE = {"bf16": 1.6e-2, "f16": 2e-3}  # of the largest |value|: about two units in the last place


@pytest.mark.parametrize("family,dtype", [("llama", "bf16"), ("llama", "f16"), ("qwen3_moe", "bf16"),
                                          ("mixtral", "f16")])
def test_half_precision_kernels(family, dtype, tiny_model, tmp_path):
    """bf16 / f16 graphs: the kernels read and write the model's dtype and compute in fp32 in UB
    (the cube accumulates in fp32); logits and KV cache within HALF_TOLERANCE of the
    interpreter's largest value. The reference rounds after every bf16 op (logits included),
    so greedy tokens must agree only where the reference's top logits are not within tolerance."""
    if family == "llama":
        model = tiny_model
    else:
        from tests.models import test_moe_families

        torch.manual_seed(0)
        getattr(test_moe_families, family)().eval().save_pretrained(tmp_path)
        model, _ = load_model(str(tmp_path), with_tokenizer=False)
    torch_dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(model, dtype))
    plan = build_plan(g)
    assert all(p.get("kernels") for p in plan["launches"])

    def step():
        return random_cache_step(model.config, torch_dtype, [SeqChunk(list(range(5, 25)), 0, [0, 1]),
                                                            SeqChunk([9, 2], 0, [3]), SeqChunk([7], 17, [4, 5])])

    a, b = step(), step()
    got, want = EmulatorRunner(plan, g.weights)(b), interpret(g, a)
    tol = HALF_TOLERANCE[dtype]
    assert (got[0] - want[0]).abs().max() <= tol * want[0].abs().max()
    for i in range(model.config.num_layers):
        ka, kb = a[f"kv_cache.{i}"].float(), b[f"kv_cache.{i}"].float()
        assert (kb - ka).abs().max() <= tol * ka.abs().max()
    chosen = want[0].gather(1, got[1][:, None])[:, 0]
    assert bool((chosen >= want[0].max(-1).values - tol * want[0].abs().max()).all())


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_int4_projection_kernels(dtype, tmp_path_factory):
    """--quant int4: linear_q4 and the int4 prologue forms as vector-core kernels that unpack the
    Q4_1 nibbles in UB (And / ShiftRight planes, GatherMask'd x); fp32 within 1e-5 of the
    largest logit, bf16 within HALF_TOLERANCE."""
    model = tiny(tmp_path_factory, hidden_size=128, intermediate_size=256)  # K in whole 64-element repeats
    g, _ = PassManager(get_target("ascend950").pipeline(quant="int4")).run(trace_model(model, dtype))
    plan = build_plan(g)
    q4 = [p for p in plan["launches"] if "group_size" in p["attrs"]]
    assert {p["op"] for p in q4} == {"add_rms_norm_linear", "rms_norm_linear", "linear_q4", "swiglu_linear"}
    assert all(p.get("kernels") for p in plan["launches"])
    torch_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]

    def step():
        return random_cache_step(model.config, torch_dtype, [SeqChunk(list(range(5, 25)), 0, [0, 1]),
                                                            SeqChunk([7], 17, [4, 5])])

    got, want = EmulatorRunner(plan, g.weights)(step()), interpret(g, step())
    tol = 1e-5 if dtype == "f32" else HALF_TOLERANCE[dtype]
    assert (got[0] - want[0]).abs().max() <= tol * want[0].abs().max()
    assert torch.equal(got[1], want[1])


def test_compile_ascend950_artifact_cli(moe_dir, smollm2, tmp_path):
    smollm2[1].backend.save(f"{moe_dir}/tokenizer.json")  # a tokenizer for the random checkpoint
    out = tmp_path / "moe-ascend"
    assert main(["compile", "--model", moe_dir, "--target", "ascend950", "-o", str(out)]) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    names = {k["name"] for p in plan["launches"] for k in p.get("kernels", [])}
    assert manifest["target"] == "ascend950"
    assert {f"kernels/{n}.cpp" for n in names} | {"CMakeLists.txt", "cmake/deepfuse_soc.cmake", "host/deepfuse_launch.cpp",
                                                  "host/deepfuse_launch.h"} <= set(manifest["files"])
    cmake = (out / "CMakeLists.txt").read_text()
    assert "find_package(ASC REQUIRED)" in cmake and all(f"kernels/{n}.cpp" in cmake for n in names)
    host = (out / "host/deepfuse_launch.cpp").read_text()
    assert all(f"deepfuse_launch_{n}(" in host for n in names)
    art = deepfuse.load(str(out))
    assert art.target == "ascend950"


def test_smollm2_ascend950_artifact_runs_in_the_emulator(smollm2):
    """The real model's sizes (D 576, I 1536, V 49152, 9 q / 3 kv heads of 64): every launch a
    kernel, layers sharing kernels, and a step (a 5-token prefill and a decode at position 20)
    in the emulator within 1e-5 of the interpreter's largest logit."""
    model, tok = smollm2
    art = deepfuse.compile(model, target="ascend950", tokenizer=tok)
    assert all(p.get("kernels") for p in art.plan["launches"])
    names = {k["name"] for p in art.plan["launches"] for k in p["kernels"]}
    assert len(names) <= 20 and all(f"kernels/{n}.cpp" in art.files for n in names)  # layers share kernels
    att = next(p for p in art.plan["launches"] if p["op"] == "qkv_attention")
    assert "3 q heads per kv head" in att["kernels"][1]["source"]

    def step():
        return random_cache_step(model.config, torch.float32, [SeqChunk([1, 2, 3, 4, 5], 0, [0]),
                                                               SeqChunk([9], 20, [1, 2])], num_blocks=4)

    got, want = art(step()), interpret(art.graph, step())
    assert (got[0] - want[0]).abs().max() <= 1e-5 * want[0].abs().max()
    assert torch.equal(got[1], want[1])


def test_kernels_refuse_a_step_they_were_not_built_for(tiny_model):
    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(tiny_model))
    runner = EmulatorRunner(build_plan(g), g.weights)
    c = tiny_model.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(block_size=8, num_blocks=4))
    with pytest.raises(DeepfuseError, match="was built for KV-cache block size 16, the step has 8"):
        runner(build_step([SeqChunk([1, 2, 3], 0, [0])], cache))


# ---- the emulator's strictness ----------------------------------------------------------------

def broken(kernel, old: str, new: str, name: str):
    assert old in kernel.source
    return dataclasses.replace(kernel, name=name, source=kernel.source.replace(old, new, 1).replace(kernel.name, name))


def swiglu_kernel(i: int, name: str):
    """The MoE's SwiGLU vector kernel over x[T, 2i] (a hand-written kernel the emulator's strictness is checked on)."""
    g = trace(lambda x: ops.swiglu(x), Spec("x", "f32", ("T", 2 * i)))
    return g, emit_swiglu(g.nodes[0], name)


def run_swiglu(g, kernel, rows: int = 3, ub_bytes: int = 248 * 1024) -> torch.Tensor:
    x = torch.randn(rows, g.inputs[0].type.shape[1])
    y = torch.zeros(rows, g.outputs[0].type.shape[1])
    launch(kernel, [x, y], pack(kernel.tiling, [tuple(x.shape)]), ub_bytes)
    return y


def test_emulator_reports_a_copy_that_is_not_whole_32_byte_blocks():
    g, k = swiglu_kernel(100, "swiglu_misaligned")
    k = broken(k, "DataCopyPad(gateLocal, xGm[(uint64_t)row * 200], DataCopyExtParams{1, 400, 0, 0, 0}, "
               "DataCopyPadExtParams<float>{false, 0, 0, 0});", "DataCopy(gateLocal, xGm[(uint64_t)row * 200], 100);",
               "swiglu_misaligned")
    with pytest.raises(DeepfuseError, match="not whole 32-byte blocks.*DataCopyPad"):
        run_swiglu(g, k)


def test_emulator_reports_unified_buffer_overflow():
    g, k = swiglu_kernel(1536, "swiglu_overflow")
    with pytest.raises(DeepfuseError, match="unified buffer overflow"):
        run_swiglu(g, k, ub_bytes=8 * 1024)


def test_emulator_reports_dequeue_before_enqueue():
    g, k = swiglu_kernel(1536, "swiglu_no_enque")
    k = broken(k, "        inQueueGate.EnQue(gateLocal);\n", "", "swiglu_no_enque2")
    with pytest.raises(DeepfuseError, match="DeQue before EnQue"):
        run_swiglu(g, k)


def generated_norm(name: str):
    """The generated rms_norm kernel over x[T, 576], w[576] (args x, w, y)."""
    from deepfuse.codegen.ascendc.emit_generated import emit_generated
    from deepfuse.ir import TensorType
    from deepfuse.kernel.build import kernel_of

    _, reads, g = kernel_of(lambda x, w: ops.rms_norm(x, w, eps=1e-5), [TensorType("f32", ("T", 576)),
                                                                          TensorType("f32", (576,))])
    assert reads == [0, 1]
    return emit_generated(g.nodes[0], name)["kernels"][0]


def test_emulator_reports_a_missing_pipe_synchronisation():
    """A scalar read of ReduceSum's result without waiting for the vector pipe is a race on the
    hardware; so is a vector op on weights copied into a TBuf without waiting for MTE2."""
    k = generated_norm("norm_sync")
    x, w = torch.randn(3, 576), torch.randn(576)
    no_vs = broken(k, "        WaitPipe<HardEvent::V_S>();\n", "", "norm_no_v_s")
    with pytest.raises(DeepfuseError, match="scalar GetValue of a vector op's result without a "
                                            r"WaitFlag<HardEvent::V_S>: a pipe race"):
        launch(no_vs, [x, w, torch.zeros(3, 576)], pack(k.tiling, [(3, 576), (576,)]))
    no_mte2 = broken(k, "        WaitPipe<HardEvent::MTE2_V>();\n", "", "norm_no_mte2_v")
    with pytest.raises(DeepfuseError, match="data copied into a TBuf without a WaitFlag<HardEvent::MTE2_V>"):
        launch(no_mte2, [x, w, torch.zeros(3, 576)], pack(k.tiling, [(3, 576), (576,)]))


def test_emulator_reports_overwriting_a_buffer_still_being_copied_out():
    """sample writes each row's index into one TBuf and copies it out; the next row's SetValue
    must wait for that copy (MTE3_S)."""
    g = trace(lambda x, t, k, p, s: ops.sample(x, t, k, p, s), Spec("x", "f32", ("R", 100)), Spec("t", "f32", ("R",)),
              Spec("k", "i64", ("R",)), Spec("p", "f32", ("R",)), Spec("s", "i64", ("R",)))
    k = emit_sample(g.nodes[0], "argmax_war")
    k.tiling[1][2] = ["shape", 0, 0]  # one core takes every row
    logits = torch.randn(3, 100)
    y = torch.zeros(3, dtype=torch.int64)
    greedy = [torch.zeros(3), torch.zeros(3, dtype=torch.int64), torch.ones(3), torch.zeros(3, dtype=torch.int64)]
    launch(dataclasses.replace(k, block_dim=1), [logits, *greedy, y], pack(k.tiling, [(3, 100)]))
    assert torch.equal(y, logits.argmax(-1))
    racy = broken(k, "        WaitPipe<HardEvent::MTE3_S>();  // the previous row's copy-out of `out` is done\n", "",
                  "argmax_racy")
    with pytest.raises(DeepfuseError, match="SetValue into a TBuf still being copied out without a "
                                            "WaitFlag<HardEvent::MTE3_S>"):
        launch(dataclasses.replace(racy, block_dim=1), [logits, *greedy, y], pack(k.tiling, [(3, 100)]))


def test_emulator_checks_the_matmul_tiling_against_l0(tiny_model):
    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(tiny_model))
    plan = build_plan(g)
    p = next(p for p in plan["launches"] if p["op"] == "linear")
    fields = {f: i for i, (f, _, _) in enumerate(p["kernels"][0]["tiling"])}
    p["kernels"][0]["tiling"][fields["baseK"]][2] = 256  # 128 x 256 fp32, double-buffered: 256 KB > L0A's 64 KB
    with pytest.raises(DeepfuseError, match="the A base tile overflows L0A"):
        EmulatorRunner(plan, g.weights)(mixed_step(tiny_model.config))


def test_a_kernel_that_does_not_compile_is_named():
    k = broken(generated_norm("norm_typo"), "ReduceSum(rw[0], w[0], reduceBuf.Get<float>(), 576);",
               "ReduceSum(rw[0], wrk, 576);", "norm_typo")
    with pytest.raises(DeepfuseError, match="AscendC kernel norm_typo does not compile against the emulator"):
        launch(k, [torch.randn(3, 576), torch.randn(576), torch.zeros(3, 576)], pack(k.tiling, [(3, 576), (576,)]))
