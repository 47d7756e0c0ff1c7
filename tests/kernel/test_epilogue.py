"""A pointwise chain after a projection (a residual add and a scale) becomes the GEMM template's
epilogue: one launch, the interpreter's numbers, no change to the template."""
from __future__ import annotations

import os

import pytest
import torch

import deepfuse
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret
from tests.conftest import needs_gxx

W = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))


def graph(dtype: str = "f32"):
    w = W.to(deepfuse.ir.DTYPES[dtype])
    return trace(lambda x, r: ops.mul(ops.add(ops.linear(x, w), r), 0.5), Spec("x", dtype, ("T", 64)),
                 Spec("r", dtype, ("T", 48)), weights={"w": w}, name="residual_scale")


def inputs(dtype: str = "f32", rows: int = 5):
    gen = torch.Generator().manual_seed(0)
    dt = deepfuse.ir.DTYPES[dtype]
    return {"x": torch.randn(rows, 64, generator=gen).to(dt), "r": torch.randn(rows, 48, generator=gen).to(dt)}


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_cpu_epilogue_is_one_launch(dtype):
    g = graph(dtype)
    f = deepfuse.compile(g, target="cpu")
    assert f.launches == [{"op": "with_epilogue", "kind": "template+generated", "ops": ["linear", "add", "mul"]}]
    ins = inputs(dtype)
    want = interpret(g, ins)[0]
    tol = 1e-5 if dtype == "f32" else 1e-2
    torch.testing.assert_close(f(**ins).float(), want.float(), rtol=tol, atol=tol)


def test_epilogue_needs_the_gemm_result_alone():
    """The projection's result is also a graph output: no epilogue (it must be written anyway)."""
    g = trace(lambda x, r: (ops.linear(x, W), ops.mul(ops.add(ops.linear(x, W), r), 0.5)),
              Spec("x", "f32", ("T", 64)), Spec("r", "f32", ("T", 48)))
    kinds = [p["kind"] for p in deepfuse.compile(g, target="cpu").launches]
    assert "template+generated" not in kinds and "generated" in kinds


@needs_gxx
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_ascend950_epilogue_is_one_launch(dtype):
    """The cube GEMM writes its result to scratch and the generated vector kernel finishes it,
    in one launch of the plan (and through the generated host code)."""
    from deepfuse.codegen.ascendc.runner import EmulatorRunner

    g = graph(dtype)
    f = deepfuse.compile(g, target="ascend950")
    assert f.launches == [{"op": "with_epilogue", "kind": "template+generated", "ops": ["linear", "add", "mul"]}]
    ins = inputs(dtype, rows=70)
    want = interpret(g, ins)[0]
    tol = 1e-5 if dtype == "f32" else 1e-2
    torch.testing.assert_close(f(**ins).float(), want.float(), rtol=tol, atol=tol)
    host = EmulatorRunner(f.plan, f.graph.weights, via_host=True)
    torch.testing.assert_close(host(ins)[0].float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
@pytest.mark.parametrize("dtype", ["f32"])  # bf16: the interpreter's bf16 tl.dot is wrong (a plain linear too)
def test_triton_epilogue_replaces_the_gemm_store(dtype):
    """sm90: the epilogue is rendered where the GEMM template stores its tile (one kernel, whose
    result never goes to memory); run in Triton's interpreter, and compiled to PTX for sm90 and sm100."""
    from deepfuse.codegen.triton import build_plan
    from deepfuse.codegen.triton.aot import compile_all

    g = graph(dtype)
    f = deepfuse.compile(g, target="sm90")
    assert f.launches == [{"op": "with_epilogue", "kind": "template+generated", "ops": ["linear", "add", "mul"]}]
    spec, *decode = f.plan["launches"][0]["kernels"]  # decode: splitk.py's GEMM and reduce, up to 64 rows
    assert "tl.dot" in spec["source"] and "tl.store(y_ptr" not in spec["source"]
    assert [k["name"].startswith("reduce_") for k in decode] == [False, True]
    assert "tl.store(y_ptr" not in decode[1]["source"] and "tl.store(part_ptr" in decode[0]["source"]
    ins = inputs(dtype, rows=37)
    want = interpret(g, ins)[0]
    tol = 1e-4 if dtype == "f32" else 2e-2  # the GEMM's own f32 sum order
    torch.testing.assert_close(f(**ins).float(), want.float(), rtol=tol, atol=tol)
    files = compile_all([(spec, "with_epilogue")], "sm100")
    assert any(name.endswith(".cubin") for name in files)
    assert build_plan(f.graph, "sm90")["launches"][0]["kernels"][0]["name"] == spec["name"]
