"""W8A8 projections on ascend950 in the emulator: every form (linear_w8a8, logits_w8a8, the
norm / SwiGLU prologue forms) as kernels -- activation groups quantized to int8 on the vector
cores, the weight re-offset to int8, int8 x int8 -> int32 group dots on the cube (Matmul API),
the group sums and weight scale on the vector cores -- against ir.interpret, directly and
through the generated host code."""
import pytest
import torch

from deepfuse.codegen.ascendc import build_plan
from deepfuse.codegen.ascendc.runner import EmulatorRunner
from deepfuse.ir import interpret
from tests.codegen.w8a8_cases import FORMS, case


@pytest.mark.parametrize("via_host", [False, True])
@pytest.mark.parametrize("form", FORMS)
def test_w8a8_kernels_match_the_interpreter(form, via_host):
    g, ins = case(form, rows=7)
    plan = build_plan(g)
    (launch,) = plan["launches"]
    names = [k["name"] for k in launch["kernels"]]
    assert [n.rsplit("_", 1)[-1] for n in names[-4:-1]] == ["quant", "weight", "dots"]
    assert "int8_t, true>" in launch["kernels"][-2]["source"] and launch["kernels"][-2]["core"] == "aic"
    got = EmulatorRunner(plan, g.weights, via_host=via_host)({k: v.clone() for k, v in ins.items()})
    want = interpret(g, {k: v.clone() for k, v in ins.items()})
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))
