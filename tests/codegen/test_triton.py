"""Triton targets: every emitted kernel kind against the IR interpreter (Triton's CPU
interpreter, f32), ahead-of-time cubins and PTX for sm90/sm100, artifacts, and errors."""
import json
import os
import re

import pytest
import torch

import deepfuse
from deepfuse.codegen.targets import get_target
from deepfuse.codegen.triton import build_plan
from deepfuse.codegen.triton.aot import compile_all
from deepfuse.codegen.triton.runner import TritonRunner, grid_of, load_binary
from deepfuse.compiler import trace_model
from deepfuse.errors import DeepfuseError
from deepfuse.ir import interpret
from deepfuse.models import load_model
from deepfuse.passes import PassManager
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache
from tests.conftest import tiny_hf_config
from tests.helpers import greedy_with, with_sinks

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
KINDS = {"embedding", "take_rows", "rms_norm_linear", "add_rms_norm_linear", "qkv_attention", "linear", "swiglu_linear",
         "kernel", "logits", "sample", "spec_verify"}  # kernel: the final add_rms_norm, generated


def tiny(tmp_path_factory, **over):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    LlamaForCausalLM(tiny_hf_config(**over)).save_pretrained(path)
    return load_model(str(path), with_tokenizer=False)[0]


@pytest.fixture(scope="module", params=[{}, {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2},
                                        "sinks"], ids=["gqa2", "gqa3", "sinks_window8"])
def model(request, tmp_path_factory):
    if request.param == "sinks":  # learned attention sinks with a sliding window: the decode at 17 sees 10..17
        return with_sinks(tiny(tmp_path_factory), window=8)
    return tiny(tmp_path_factory, **request.param)


def mixed_step(config, cache_blocks=8):
    """A prefill of 20 tokens over two blocks (one partial) whose last 3 tokens are drafts the step
    verifies, a 2-token prefill, and a decode at position 17 of a sequence whose earlier keys
    are already cached."""
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32,
                    CacheConfig(block_size=16, num_blocks=cache_blocks))
    torch.manual_seed(1)
    for i in range(config.num_layers):
        cache.layers[i].normal_()
    return build_step([SeqChunk(list(range(5, 25)), 0, [0, 1], samples=4), SeqChunk([9, 2], 0, [3]),
                       SeqChunk([7], 17, [4, 5])], cache)


def test_every_kernel_kind_matches_the_interpreter(model):
    g, _ = PassManager(get_target("sm90").pipeline()).run(trace_model(model))
    plan = build_plan(g, "interpret")
    emitted = {p["op"] for p in plan["launches"] if p.get("kernels")}
    assert emitted == KINDS and all(p.get("kernels") for p in plan["launches"])
    a, b = mixed_step(model.config), mixed_step(model.config)
    got, want = TritonRunner(plan, g.weights)(b), interpret(g, a)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[1], want[1])
    for i in range(model.config.num_layers):
        torch.testing.assert_close(b[f"kv_cache.{i}"], a[f"kv_cache.{i}"], atol=1e-5, rtol=1e-5)


def launches_of_one_step(plan, weights, config, chunks) -> tuple[list, list[str]]:
    """The step's outputs through a TritonRunner, and the ops it ran as Triton kernels."""
    runner, launched = TritonRunner(plan, weights), []
    run_kernels = runner._run

    def spy(p, kernels, ins):
        launched.append(p["op"])
        return run_kernels(p, kernels, ins)

    runner._run = spy
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32, CacheConfig(16, 8))
    return runner(build_step(chunks, cache)), launched


def test_the_sampling_kernel_runs_for_greedy_and_sampled_steps(tiny_model):
    """One kernel samples greedy and seeded rows alike (no reference fallback): the tokens are
    the interpreter's."""
    g, _ = PassManager(get_target("sm90").pipeline()).run(trace_model(tiny_model))
    plan, c = build_plan(g, "interpret"), tiny_model.config
    for temperature in (0.0, 0.9):
        chunks = [SeqChunk([3, 4, 5], 0, [0], temperature=temperature, seed=7), SeqChunk([9], 0, [1])]
        got, launched = launches_of_one_step(plan, g.weights, c, chunks)
        cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(16, 8))
        want = interpret(g, build_step(chunks, cache))
        assert torch.equal(got[1], want[1]), (temperature, got[1], want[1])
        assert "sample" in launched, launched


def test_grid_and_arguments_are_bound_from_the_step(model):
    g, _ = PassManager(get_target("sm100").pipeline()).run(trace_model(model))
    plan = build_plan(g, "sm100")
    att = next(p for p in plan["launches"] if p["op"] == "qkv_attention")
    rope, attend, split, reduce = att["kernels"]  # split + reduce: split_kv.py's, for short sequences
    ins = [torch.empty(22, 1), None, torch.empty(2, 8, 16, 2, 16), None, torch.empty(3, 4, dtype=torch.int64),
           None, torch.empty(3)]
    assert grid_of(rope, ins, [], []) == (22, 1, 1)
    bq = attend["constexprs"]["BQ"]
    assert bq * attend["constexprs"]["GP"] == 128 and grid_of(attend, ins, [], []) == (3, 2, -(-22 // bq))
    assert att["tmps"][0]["shape"][0] == "T"
    assert grid_of(split, ins, [], []) == (3, 2, 16) and grid_of(reduce, ins, [], []) == (3, 2, 1)


MMA_KERNELS = ("linear_", "logits_", "swiglu_linear_", "rms_norm_linear_", "add_rms_norm_linear_", "qkv_attention_")


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    m = tiny(tmp_path_factory)
    out = {}
    for arch in ("sm90", "sm100"):
        art = deepfuse.compile(m, target=arch, dtype="bf16")
        out[arch] = (art, art.save(str(tmp_path_factory.mktemp(arch))))
    return m, out


def test_aot_cubins_and_ptx_use_the_tensor_core_of_each_arch(artifacts):
    _, arts = artifacts
    for arch, mma in (("sm90", "wgmma"), ("sm100", "tcgen05")):
        art, path = arts[arch]
        names = {spec["name"] for p in art.plan["launches"] for spec in p.get("kernels", [])}
        assert len(names) < sum(len(p.get("kernels", [])) for p in art.plan["launches"])  # layers share kernels
        for name in names:
            assert art.files[f"kernels/{name}.cubin"][:4] == b"\x7fELF"
            meta = json.loads(art.files[f"kernels/{name}.json"])
            assert meta["arch"] == arch
        for name in names:
            ptx = art.files[f"kernels/{name}.ptx"].decode()
            assert f".target sm_{arch[2:]}a" in ptx
            if name.startswith(MMA_KERNELS) and not name.endswith("_rope"):
                assert mma in ptx, f"{name} on {arch} has no {mma}"
                # compiled with its pointers 16-byte aligned: tiles arrive in 16-byte loads or async
                # copies (without the hints every element was its own load, 3-10x slower on an H200)
                assert re.search(r"ld\.global(\.\w+)*\.v4|cp\.async", ptx), f"{name} on {arch} loads element by element"
        manifest = json.load(open(os.path.join(path, "manifest.json")))
        assert all(f"kernels/{n}.cubin" in manifest["files"] for n in names)


def test_artifact_cubins_load_as_triton_compiled_kernels(artifacts, tmp_path):
    """What a GPU run of a loaded artifact launches: each kernel's cubin as a Triton
    CompiledKernel (metadata, signature order and binary checked; launching needs the GPU)."""
    for arch in ("sm90", "sm100"):
        loaded = deepfuse.load(artifacts[1][arch][1])
        assert loaded.runner.kernel_source == "interpret"  # no GPU here: the same kernels, interpreted
        specs = {spec["name"]: spec for p in loaded.plan["launches"] for spec in p.get("kernels", [])}
        for name, spec in specs.items():
            cubin = load_binary(spec, loaded.files, str(tmp_path))
            k = cubin.kernel
            params = [p for p, t in spec["signature"].items() if t != "constexpr"]
            assert [params[i] for i in cubin.aligned] == [p for p in params if spec["signature"][p].startswith("*")]
            assert k.name == name and k.metadata.target.arch == int(arch[2:]) and k.metadata.target.backend == "cuda"
            assert k.kernel == loaded.files[f"kernels/{name}.cubin"] and k.metadata.num_warps == spec["num_warps"]
            assert k.src.fn.arg_names == list(spec["signature"])
    files = dict(loaded.files)
    meta = json.loads(files[f"kernels/{name}.json"])
    meta["triton"]["target"]["arch"] = 80
    files[f"kernels/{name}.json"] = json.dumps(meta).encode()
    with pytest.raises(DeepfuseError, match="expected GPUTarget"):
        load_binary(spec, files, str(tmp_path))


def test_sm90_artifact_loads_and_runs_in_the_interpreter_like_the_cpu_build(tmp_path, tiny_model):
    cpu = deepfuse.compile(tiny_model)
    art = deepfuse.compile(tiny_model, target="sm90")
    loaded = deepfuse.load(art.save(str(tmp_path / "sm90")))
    prompt = [3, 17, 42, 5, 9]
    want, want_logits = greedy_with(cpu, tiny_model.config, prompt, 6, block_size=16)
    got, got_logits = greedy_with(loaded, tiny_model.config, prompt, 6, block_size=16)
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)
    with pytest.raises(DeepfuseError, match="KV-cache block size 16"):
        greedy_with(loaded, tiny_model.config, prompt, 1, block_size=4)


def test_a_cubin_launch_with_a_misaligned_pointer_goes_to_the_jit_build(artifacts, tmp_path):
    """The cubins assume 16-byte aligned pointers (aot.aligned_attrs); a launch whose tensors are
    not (a view at an odd offset) must not run them: it gets the source's JIT build."""
    art, path = artifacts[1]["sm90"]
    loaded = deepfuse.load(path)
    spec = next(spec for p in loaded.plan["launches"] if p["op"] == "linear" for spec in p["kernels"])
    cubin = load_binary(spec, loaded.files, str(tmp_path))
    args = [torch.empty(64, dtype=torch.bfloat16) if spec["signature"][k].startswith("*") else 3
            for k, t in spec["signature"].items() if t != "constexpr"]
    assert cubin.aligned and cubin.fits(args)
    args[cubin.aligned[0]] = torch.empty(64, dtype=torch.bfloat16)[1:]  # 2 bytes in
    assert not cubin.fits(args)
    assert cubin.jit().fn.__name__ == spec["name"]  # what the runner launches instead


def test_a_kv_cache_on_another_device_is_refused_not_copied(tiny_model):
    """The step writes the cache in place: a copy moved to the runner's device would drop the
    step's rows (seen on an H200: greedy tokens diverged after the first). The CPU build and the
    interpreter's runner live on the CPU; the engine makes its cache on model.device."""
    art = deepfuse.compile(tiny_model, target="sm90")
    assert art.device == deepfuse.compile(tiny_model).device == torch.device("cpu")
    c = tiny_model.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(16, 4), device="meta")
    assert all(t.device.type == "meta" for t in cache.layers)
    inputs = build_step([SeqChunk([3, 4], 0, [])], KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32,
                                                           CacheConfig(16, 4)))
    inputs["kv_cache.1"] = cache.layers[1]
    with pytest.raises(DeepfuseError, match=r"kv_cache.1 is on meta, this sm90 artifact runs on cpu"):
        art(inputs)


def test_a_kernel_that_fails_to_compile_names_the_kernel_and_node():
    bad = {"name": "broken_kernel", "source": "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"
           "def broken_kernel(x_ptr):\n    tl.store(x_ptr, undefined_name)\n",
           "signature": {"x_ptr": "*fp32"}, "constexprs": {}, "num_warps": 4, "num_stages": 1}
    with pytest.raises(DeepfuseError, match=r"broken_kernel for %7 \(rms_norm\) failed to compile for sm90"):
        compile_all([(bad, "%7 (rms_norm)")], "sm90")


def test_runner_without_gpu_or_interpreter_says_what_to_do(tiny_model, monkeypatch):
    art = deepfuse.compile(tiny_model, target="sm100")
    monkeypatch.delenv("TRITON_INTERPRET")
    runner = TritonRunner(art.plan, art.graph.weights)
    with pytest.raises(DeepfuseError, match="NVIDIA GPU"):
        runner({})


@pytest.fixture(scope="module")
def mixtral_model(tmp_path_factory):
    from tests.models.test_moe_families import mixtral

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mixtral")
    mixtral().eval().save_pretrained(path)
    return load_model(str(path), with_tokenizer=False)[0]


def test_fused_moe_kernels_match_the_interpreter(mixtral_model):
    """Mixtral: every op of the step is a Triton kernel, fused_moe included (routing, the sort by
    expert, grouped gate/up + SwiGLU, grouped down, combine)."""
    g, _ = PassManager(get_target("sm90").pipeline()).run(trace_model(mixtral_model))
    plan = build_plan(g, "interpret")
    moe = [p for p in plan["launches"] if p["op"] == "fused_moe"]
    assert moe and all([k["name"].rsplit("_", 2)[-2] for k in p["kernels"]][:2] == ["route", "align"] and
                       [k["name"].rsplit("_", 1)[-1] for k in p["kernels"]][5:7] == ["route", "align"] and
                       len(p["kernels"]) == 10 for p in moe)  # a set for decode-sized steps, one for the rest
    assert all(p.get("kernels") for p in plan["launches"])
    a, b = mixed_step(mixtral_model.config), mixed_step(mixtral_model.config)
    got, want = TritonRunner(plan, g.weights)(b), interpret(g, a)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[1], want[1])


def test_moe_model_sm100_artifact_has_a_cubin_for_every_launch(mixtral_model):
    art = deepfuse.compile(mixtral_model, target="sm100", dtype="bf16")
    assert all(p.get("kernels") for p in art.plan["launches"])
    names = {spec["name"] for p in art.plan["launches"] for spec in p["kernels"]}
    assert all(f"kernels/{n}.cubin" in art.files for n in names)
    moe_gemms = [n for n in names if n.startswith("fused_moe_") and n.endswith(("_up", "_down"))]
    assert len(moe_gemms) == 2 and all("tcgen05" in art.files[f"kernels/{n}.ptx"].decode() for n in moe_gemms)


def test_int4_projection_kernels_match_the_interpreter(tiny_model):
    """--quant int4: the GEMMs dequantize Q4_1 nibbles in their B-tile loads, prologues included."""
    g, _ = PassManager(get_target("sm90").pipeline(quant="int4")).run(trace_model(tiny_model))
    plan = build_plan(g, "interpret")
    q4 = [p for p in plan["launches"] if "group_size" in p["attrs"]]
    assert {p["op"] for p in q4} == {"add_rms_norm_linear", "rms_norm_linear", "linear_q4", "swiglu_linear"}
    assert all(p.get("kernels") for p in plan["launches"])
    a, b = mixed_step(tiny_model.config), mixed_step(tiny_model.config)
    got, want = TritonRunner(plan, g.weights)(b), interpret(g, a)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)


def test_qwen3_moe_head_norms_fuse_into_the_attention_prologue(tmp_path_factory):
    """Qwen3-MoE: q/k head RMSNorms join RoPE and the cache write in qkv_attention, so every
    op of its step is a Triton kernel; it matches the interpreter."""
    from tests.models.test_moe_families import qwen3_moe

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3moe")
    qwen3_moe().eval().save_pretrained(path)
    model = load_model(str(path), with_tokenizer=False)[0]
    g, _ = PassManager(get_target("sm90").pipeline()).run(trace_model(model))
    counts = g.op_counts()
    assert counts["qkv_attention"] == model.config.num_layers and "head_rms_norm" not in counts and "rope" not in counts
    plan = build_plan(g, "interpret")
    assert all(p.get("kernels") for p in plan["launches"])
    a, b = mixed_step(model.config), mixed_step(model.config)
    got, want = TritonRunner(plan, g.weights)(b), interpret(g, a)
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    assert torch.equal(got[1], want[1])
