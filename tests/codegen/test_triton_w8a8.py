"""W8A8 projections on sm90/sm100: every form is one GEMM-template kernel (activation groups
quantized in the kernel, int8 x int8 -> int32 tl.dot per group); in Triton's interpreter against
ir.interpret, and compiled ahead of time (the int8 tensor-core forms in the PTX)."""
import os
import re

import pytest
import torch

from deepfuse.codegen.triton import build_plan
from deepfuse.codegen.triton.aot import compile_all
from deepfuse.codegen.triton.emit import EMITTERS
from deepfuse.codegen.triton.runner import TritonRunner
from deepfuse.ir import interpret
from tests.codegen.w8a8_cases import FORMS, case

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", [1, 5, 20])  # 20: two row tiles
def test_w8a8_kernels_match_the_interpreter(form, rows):
    """The group dots are exact integers and the f32 sums are the reference's, in its order: the
    results agree to f32 rounding (the norm's rstd is 1 / sqrt, the reference's rsqrt)."""
    g, ins = case(form, rows)
    plan = build_plan(g, "interpret")
    (launch,) = plan["launches"]
    assert launch["kernels"] and launch["kernels"][0]["constexprs"]["BK"] == 64  # a K tile is one group
    got = TritonRunner(plan, g.weights)({k: v.clone() for k, v in ins.items()})
    want = interpret(g, {k: v.clone() for k, v in ins.items()})
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))


@pytest.mark.parametrize("arch,mma", [("sm90", "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8"),
                                      ("sm100", "tcgen05.mma.cta_group::1.kind::i8")])
def test_w8a8_kernels_compile_to_int8_tensor_core_mmas(arch, mma):
    """The PTX multiplies int8 on the tensor cores, divides with div.rn (a true division, as the
    reference's 127 / max|x|) and has no f32 fma (the accumulation rounds product and sum apart)."""
    jobs = []
    for form in ("linear_w8a8", "add_rms_norm_linear"):
        node = case(form)[0].nodes[0]
        jobs += [(spec, form) for spec in EMITTERS[node.op](node, f"w8a8_{form}", arch)]
    files = compile_all(jobs, arch)  # in child processes (this one interprets Triton)
    ptxs = [v.decode() for k, v in files.items() if k.endswith(".ptx")]
    assert len(ptxs) == 2
    for ptx in ptxs:
        assert mma in ptx and "div.rn.f32" in ptx
        assert not re.search(r"\bfma\.rn\.f32", ptx)


def test_groups_the_template_cannot_tile_are_left_to_the_reference():
    """The K tile is one activation group: 96 is no power of two for tl.arange, 512 would not fit
    shared memory as int8 tiles."""
    from deepfuse.codegen.triton.emit import emittable
    from deepfuse.frontend import Spec, trace
    from deepfuse.frontend.tracer import apply
    from deepfuse.ir.opdefs_quant import quantize_w8

    for group, ok in ((96, False), (512, False), (64, True)):
        wq, scale = quantize_w8(torch.randn(8, 1536))
        g = trace(lambda x, wq=wq, scale=scale, group=group: apply("linear_w8a8", x, wq, scale, act_group=group),
                  Spec("x", "f32", ("T", 1536)))
        assert emittable(g.nodes[0]) == ok, group
