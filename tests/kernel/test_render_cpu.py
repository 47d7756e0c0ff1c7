"""The CPU renderer of the kernel IR (codegen/cpu/generated*.py): each case's kernel compiled with
g++ against the kernel IR's interpreter (deepfuse.kernel.interpret), alone, as the `kernel` op's
CPU kernels and in the CPU executor. Skipped only without g++ (a failure under CI=true)."""
from __future__ import annotations

import pytest
import torch

from deepfuse.codegen.cpu import CpuExecutor, build_plan
from deepfuse.codegen.cpu.generated import PARALLEL_ELEMS, render_cpp
from deepfuse.codegen.cpu.generated_build import NativeKernel, build
from deepfuse.codegen.cpu.out_kernels import OUT_FACTORIES
from deepfuse.errors import DeepfuseError
from deepfuse.kernel.interpret import run
from deepfuse.kernel.ir import Buffer, Index, Instr, Kernel, verify
from tests.conftest import needs_gxx
from tests.kernel.cases import CASES, case_inputs, generated, kernels_of

pytestmark = needs_gxx


def case_kernel(name: str, dtype: str, rows: int) -> tuple[Kernel, dict[str, torch.Tensor]]:
    """The case's one kernel and its inputs by buffer name."""
    g = generated(name, dtype)
    (node,) = g.nodes
    (k,) = kernels_of(g)
    ins = case_inputs(name, dtype, rows)
    return k, {b.name: ins[v.name] for b, v in zip(k.inputs, node.inputs)}


def assert_matches(got: torch.Tensor, want: torch.Tensor, dtype: str) -> None:
    """f32: 1e-5 relative to the output's scale; bf16: one bf16 ulp (1e-2)."""
    finite = want.float()[torch.isfinite(want.float())]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    tol = 1e-5 if dtype == "f32" else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * max(scale, 1.0), equal_nan=True)


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_native_matches_interpreter(name, dtype, rows):
    k, ins = case_kernel(name, dtype, rows)
    want = run(k, ins)
    got = NativeKernel(k)(*[ins[b.name] for b in k.inputs])
    got = got if isinstance(got, tuple) else (got,)
    for b, t in zip(k.outputs, got):
        assert t.dtype == want[b.name].dtype and t.shape == want[b.name].shape
        assert_matches(t, want[b.name], dtype)
    r, groups, cols = k.space
    assert (rows * groups * cols >= PARALLEL_ELEMS) == (rows == 300)  # 300 rows take the OpenMP path


@pytest.mark.parametrize("rows", [7, 300])  # 300: the bound call runs on OpenMP threads
def test_out_kernel_and_bound_call_write_planned_buffers(rows):
    k, ins = case_kernel("add_rms_norm", "bf16", rows)
    xs = [ins[b.name] for b in k.inputs]
    want = run(k, ins)
    kernel = OUT_FACTORIES["kernel"]({"kernel": k.to_json(), "ops": []})
    outs = [torch.full(want[b.name].shape, 7.0, dtype=torch.bfloat16) for b in k.outputs]
    kernel(*xs, out=outs)
    for b, o in zip(k.outputs, outs):
        assert_matches(o, want[b.name], "bf16")
    for o in outs:
        o.fill_(7.0)
    bound = kernel.bind(*xs, out=outs)
    xs[0].copy_(xs[0] * 2)  # a bound call reads the tensors' new contents
    want = run(k, {b.name: x for b, x in zip(k.inputs, xs)})
    for call in bound.calls:
        call()
    for b, o in zip(k.outputs, outs):
        assert_matches(o, want[b.name], "bf16")


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_executor_runs_kernel_node(dtype):
    g = generated("softmax", dtype)
    ins = case_inputs("softmax", dtype, 9)
    (want,) = [run(k, {"in0": ins["x"]})["out0"] for k in kernels_of(g)]
    (got,) = CpuExecutor(build_plan(g), g.weights)(ins)
    assert_matches(got, want, dtype)


def _reducer(kind: str) -> Kernel:
    """out0[r] = reduce.<kind>(x[r, :]) over 8 columns, by hand."""
    body = [Instr(0, "load", (), "f32", "elem", {"buf": "x", "index": Index(8, 0, 1, 0)}),
            Instr(1, "reduce", (0,), "i32" if kind == "argmax" else "f32", "row", {"kind": kind}),
            Instr(-1, "store", (1,), "i32" if kind == "argmax" else "f32", "row", {"buf": "y", "index": Index(1, 0, 0, 0)})]
    k = Kernel(f"reduce_{kind}", [Buffer("x", "f32", ("T", 8), "in"),
                                  Buffer("y", "i32" if kind == "argmax" else "f32", ("T",), "out")], ("T", 1, 8), body)
    verify(k)
    return k


def test_argmax_and_max_take_the_first_maximum_and_nan():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 0.0, -1.0, 3.0],
                      [-5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0, -5.0],
                      [0.0, 9.0, float("nan"), 9.0, float("nan"), 1.0, 2.0, 3.0],
                      [float("-inf")] * 8])
    got = NativeKernel(_reducer("argmax"))(x)
    assert got.tolist() == [1, 0, 2, 0] == run(_reducer("argmax"), {"x": x})["y"].tolist()
    for kind in ("max", "min"):
        got = NativeKernel(_reducer(kind))(x)
        torch.testing.assert_close(got, run(_reducer(kind), {"x": x})["y"], equal_nan=True)
    assert torch.isnan(NativeKernel(_reducer("max"))(x)[2])


def test_broken_source_names_the_compiler_error():
    k, _ = case_kernel("softmax", "f32", 1)
    source = render_cpp(k).replace("df_exp(v", "df_exp_missing(v")
    with pytest.raises(DeepfuseError, match="df_exp_missing.*not declared"):
        build(source)


def test_bf16_cast_of_a_rounded_value_keeps_nan_and_inf():
    """The cast of a round-to-bf16 value takes its high 16 bits (generated.expr): NaN stays a NaN."""
    body = [Instr(0, "load", (), "f32", "elem", {"buf": "x", "index": Index(4, 0, 1, 0)}),
            Instr(1, "round", (0,), "f32", "elem", {"to": "bf16"}),
            Instr(2, "cast", (1,), "bf16", "elem", {"to": "bf16"}),
            Instr(-1, "store", (2,), "bf16", "elem", {"buf": "y", "index": Index(4, 0, 1, 0)})]
    k = Kernel("round_cast", [Buffer("x", "f32", ("T", 4), "in"), Buffer("y", "bf16", ("T", 4), "out")], ("T", 1, 4), body)
    verify(k)
    assert "df_bits(v1) >> 16" in render_cpp(k)
    x = torch.tensor([[float("nan"), float("inf"), -1.00390625, 3.0e38]])
    got = NativeKernel(k)(x)
    want = run(k, {"x": x})["y"]
    assert got.view(torch.int16)[0, 0].item() == 0x7FC0  # a NaN, as the full cast writes it
    assert got.view(torch.int16)[0, 1:].tolist() == want.view(torch.int16)[0, 1:].tolist()  # bit for bit
    assert torch.isnan(want[0, 0].float())


def test_tanh_is_within_a_few_ulp_over_its_whole_range():
    """df_tanh (a Taylor polynomial below 0.4, 1 - 2/(exp(2x)+1) above) against float64 torch:
    within 3e-7 relative from tiny values through saturation, sign of zero and NaN kept."""
    from deepfuse.frontend import Spec, ops, trace
    from deepfuse.passes import dce
    from deepfuse.passes.decompose import decompose_unsupported
    from deepfuse.passes.generate_kernels import generate_kernels

    g = dce(generate_kernels()(decompose_unsupported(set())(trace(ops.tanh, Spec("x", "f32", ("T", 96))))))
    (k,) = kernels_of(g)
    x = torch.cat([torch.linspace(-25, 25, 96 * 500), torch.linspace(-0.45, 0.45, 96 * 100),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 0.4, -0.4, 30.0, -30.0, float("nan"), 5.0] * 8)])
    got = NativeKernel(k)(x.view(-1, 96)).reshape(-1)
    want = torch.tanh(x.double())
    finite = ~torch.isnan(want)
    rel = (got.double() - want)[finite].abs() / want[finite].abs().clamp_min(1e-38)
    assert rel.max().item() < 3e-7
    assert torch.isnan(got[~finite]).all() and torch.equal(torch.signbit(got[finite]), torch.signbit(want[finite]))
