"""The `sample` kernels (greedy and seeded sampled rows) against the op's reference: sm90's in
Triton's interpreter (and AOT-compiled for sm90/sm100), ascend950's in the emulator, and seeded
sampled decoding of a tiny Llama through both targets against the CPU target's tokens."""
import os

import pytest
import torch

import deepfuse
from deepfuse.codegen.ascendc.emit_sample import emit_sample as ascend_sample
from deepfuse.codegen.ascendc.emulate import launch
from deepfuse.codegen.ascendc.kernel import pack
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import OPS
from tests.helpers import sampled_with

interpreting = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")


def sample_node(v: int):
    g = trace(lambda x, t, k, p, s: ops.sample(x, t, k, p, s), Spec("x", "f32", ("R", v)), Spec("t", "f32", ("R",)),
              Spec("k", "i64", ("R",)), Spec("p", "f32", ("R",)), Spec("s", "i64", ("R",)))
    return g.nodes[0]


def rows(r: int, v: int, seed: int) -> list[torch.Tensor]:
    """Random logits with a mix of greedy rows, top-k (1, small, > V), top-p (0 .. 1) and 64-bit seeds."""
    torch.manual_seed(seed)
    x = torch.randn(r, v) * 3
    t = torch.tensor([0.0, 0.7, 1.0, 1.5] * r)[:r]
    k = torch.tensor([0, 5, 50, 0, 1, v + 100] * r)[:r]
    p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.95, 1.0, 0.0, 0.999] * r)[:r]
    return [x, t, k, p, torch.randint(-2 ** 62, 2 ** 62, (r,))]


@interpreting
@pytest.mark.parametrize("v", [300, 2500])
def test_triton_sample_kernel_gives_the_reference_tokens(v):
    """Every row equal: float rounding (exp, log, the top-p sums) could flip a choice only where two
    scores or a head's mass and its target lie within a few ulps, which these rows do not."""
    from deepfuse.codegen.triton.emit import emit_sample as triton_sample
    from deepfuse.codegen.triton.runner import load_kernel

    spec = triton_sample(sample_node(v), "sample_k", "sm90")[0]
    ins = rows(24, v, v)
    y = torch.empty(24, dtype=torch.int64)
    load_kernel(spec)[(24, 1, 1)](*ins, y, **spec["constexprs"])
    want = OPS["sample"].reference(*ins)
    assert torch.equal(y, want), (y, want)
    assert (want != ins[0].argmax(-1)).sum() >= 6  # the sampled rows do not all take the maximum


def test_triton_sample_kernel_compiles_for_sm90_and_sm100():
    from deepfuse.codegen.triton.aot import compile_all
    from deepfuse.codegen.triton.emit import emit_sample as triton_sample

    for arch in ("sm90", "sm100"):
        files = compile_all([(triton_sample(sample_node(49152), "sample_aot", arch)[0], "sample")], arch)
        assert files["sample_aot.cubin"] and "div.rn.f32" in files["sample_aot.ptx"].decode()


@pytest.mark.parametrize("v,r", [(300, 24), (49155, 4)])
def test_ascend_sample_kernel_gives_the_reference_tokens(v, r):
    """V = 49155 tiles the row through UB in chunks of 4096 tokens (the last one partial)."""
    k = ascend_sample(sample_node(v), f"sample_{v}")
    ins = rows(r, v, v)
    y = torch.zeros(r, dtype=torch.int64)
    launch(k, [*ins, y], pack(k.tiling, [(r, v)]))
    assert torch.equal(y, OPS["sample"].reference(*ins))


PARAMS = [dict(temperature=0.8, seed=11), dict(temperature=1.0, top_k=20, seed=12),
          dict(temperature=0.0), dict(temperature=0.9, top_p=0.8, seed=-5),
          dict(temperature=1.2, top_k=40, top_p=0.9, seed=2 ** 40)]
PROMPTS = [[5, 17, 99, 3, 42], [7, 64, 1], [9, 11, 23, 31, 40, 2], [8, 77], [101, 6, 6, 6]]


@pytest.fixture(scope="module")
def cpu_tokens(tiny_model):
    return sampled_with(deepfuse.compile(tiny_model), tiny_model.config, PROMPTS, 5, PARAMS)


@interpreting
def test_seeded_sampled_decoding_on_sm90_gives_the_cpu_targets_tokens(tiny_model, cpu_tokens):
    got = sampled_with(deepfuse.compile(tiny_model, target="sm90"), tiny_model.config, PROMPTS, 5, PARAMS)
    assert got == cpu_tokens


@pytest.mark.parametrize("via_host", [False, True])
def test_seeded_sampled_decoding_on_ascend950_gives_the_cpu_targets_tokens(tiny_model, cpu_tokens, via_host):
    from deepfuse.codegen.ascendc import build_plan
    from deepfuse.codegen.ascendc.runner import EmulatorRunner
    from deepfuse.codegen.targets import get_target
    from deepfuse.compiler import trace_model
    from deepfuse.passes import PassManager

    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(tiny_model))
    run = EmulatorRunner(build_plan(g), g.weights, via_host=via_host)
    step = lambda inputs: run(inputs)  # noqa: E731
    assert sampled_with(step, tiny_model.config, PROMPTS, 5, PARAMS) == cpu_tokens
