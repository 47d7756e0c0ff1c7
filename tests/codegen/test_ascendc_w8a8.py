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


def test_a_vocabulary_wide_w8a8_head_runs_in_column_chunks():
    """logits_w8a8 over N = 9000 + a tail: the combine kernel walks N in chunks that fit the UB
    (whole rows of N would not), and matches the reference."""
    import deepfuse
    from deepfuse.frontend import Spec, trace
    from deepfuse.frontend.tracer import apply
    from deepfuse.ir import interpret
    from deepfuse.ir.opdefs_quant import quantize_w8

    gen = torch.Generator().manual_seed(3)
    wq, scale = quantize_w8(torch.randn(9000 + 37, 64, generator=gen))
    g = trace(lambda x, rows: apply("logits_w8a8", x, wq, scale, rows, act_group=64),
              Spec("x", "f32", ("T", 64)), Spec("rows", "i64", ("R",)))
    f = deepfuse.compile(g, target="ascend950", fuse=False)
    assert f.host_steps == []
    ins = {"x": torch.randn(5, 64, generator=gen), "rows": torch.tensor([1, 4])}
    torch.testing.assert_close(f(**ins), interpret(g, ins)[0], rtol=1e-6, atol=1e-6)


def test_an_activation_row_too_wide_for_the_quantize_kernel_is_a_host_step():
    from deepfuse.codegen.ascendc import emittable
    from deepfuse.frontend import Spec, trace
    from deepfuse.frontend.tracer import apply
    from deepfuse.ir.opdefs_quant import quantize_w8

    wq, scale = quantize_w8(torch.randn(8, 14336))
    g = trace(lambda x: apply("linear_w8a8", x, wq, scale, act_group=64), Spec("x", "f32", ("T", 14336)))
    assert not emittable(g.nodes[0])
