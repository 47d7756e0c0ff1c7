"""GEMM tiles by M bucket (codegen/triton/splitk.py): up to 64 rows the swapped, split-K decode GEMM
and its fixed-order reduce, beyond that the prefill template; in Triton's interpreter, f32, against
the IR interpreter for M in {1, 3, 8, 64, 200}, every prologue form, int4 and an epilogue;
W8A8 keeps its one kernel."""
import os
from unittest.mock import patch

import pytest
import torch

from deepfuse.codegen.triton import build_plan, runner
from deepfuse.codegen.triton.runner import TritonRunner, launched
from deepfuse.frontend import Spec, ops, trace
from deepfuse.frontend.tracer import apply
from deepfuse.ir import interpret
from deepfuse.ir.opdefs_quant import quantize_q4, quantize_w8

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
N, K = 48, 96  # interpret tiles BN = BK = 32: 2 column tiles, 3 K tiles -> a split of 3 (8 "SMs")


def case(form: str, rows: int, seed: int = 0):
    """-> (graph, inputs) of one GEMM node of `form`, f32."""
    gen = torch.Generator().manual_seed(seed)
    w, nw = torch.randn(N, K, generator=gen) / 8, torch.randn(K, generator=gen)
    x = torch.randn(rows, 2 * K if form == "swiglu_linear" else K, generator=gen)
    specs, ins, weights = [Spec("x", "f32", ("T", x.shape[1]))], {"x": x}, {"w": w, "nw": nw}
    if form in ("add_rms_norm_linear", "epilogue"):
        specs.append(Spec("r", "f32", ("T", K if form == "add_rms_norm_linear" else N)))
        ins["r"] = torch.randn(rows, specs[-1].shape[1], generator=gen)
    if form == "logits":
        specs.append(Spec("rows", "i64", ("R",)))
        ins["rows"] = torch.randperm(rows, generator=gen)  # M = R: every row, shuffled
    fns = {
        "linear": lambda x: ops.linear(x, w),
        "rms_norm_linear": lambda x: ops.rms_norm_linear(x, nw, w, eps=1e-5),
        "add_rms_norm_linear": lambda x, r: ops.add_rms_norm_linear(x, r, nw, w, eps=1e-5),
        "swiglu_linear": lambda x: ops.swiglu_linear(x, w),
        "logits": lambda x, rows: apply("logits", x, w, rows),
        "epilogue": lambda x, r: ops.mul(ops.add(ops.linear(x, w), r), 0.5),
    }
    if form == "linear_q4":
        packed, scales, mins = quantize_q4(w, 32)
        weights.update(packed=packed, scales=scales, mins=mins)
        fns[form] = lambda x: ops.linear_q4(x, packed, scales, mins, group_size=32)
    if form == "linear_w8a8":  # two activation groups of 64
        wq, scale = quantize_w8(torch.randn(N, 128, generator=gen))
        specs, ins, weights = [Spec("x", "f32", ("T", 128))], {"x": torch.randn(rows, 128, generator=gen) * 3}, {}
        fns[form] = lambda x: ops.linear_w8a8(x, wq, scale, act_group=64)
    return trace(fns[form], *specs, weights=weights, name=form), ins


def run(g, ins: dict) -> tuple[list[torch.Tensor], list[str]]:
    """The Triton plan's outputs and which of its kernels ran: prefill, decode, reduce."""
    kinds: list[str] = []

    def spy(spec: dict, step: list) -> bool:
        if launched(spec, step):
            name = spec["name"]
            kinds.append("reduce" if name.startswith("reduce_") else "decode" if name.endswith("_decode") else "prefill")
            return True
        return False

    with patch.object(runner, "launched", spy):
        out = TritonRunner(build_plan(g, "interpret"), g.weights)({k: v.clone() for k, v in ins.items()})
    return out, kinds


FORMS = ["linear", "rms_norm_linear", "add_rms_norm_linear", "swiglu_linear", "logits", "linear_q4", "epilogue"]


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 200])
@pytest.mark.parametrize("form", FORMS)
def test_gemm_by_m_bucket_matches_the_interpreter(form, rows):
    g, ins = case(form, rows)
    got, kinds = run(g, ins)
    assert kinds == (["prefill"] if rows > 64 else ["decode", "reduce"])
    want = interpret(g, {k: v.clone() for k, v in ins.items()})
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_decode_split_is_fixed_per_gemm_and_fills_the_sms():
    """The split of K comes from N, K and the SM count, never from M: the same grid depth and
    partial layout at every decode bucket (8 SMs in the interpreter's table: 2 column tiles x
    a split of 3 K tiles)."""
    g, _ = case("linear", 1)
    specs = build_plan(g, "interpret")["launches"][0]["kernels"]
    decode = next(k for k in specs if k["name"].endswith("_decode"))
    assert decode["grid"] == [["cdiv", ["shape", 0, 0], 16], ["cdiv", ["const", N], 32], 3]
    assert "tl.atomic" not in decode["source"] and "tl.atomic" not in specs[-1]["source"]


@pytest.mark.parametrize("form", ["linear", "add_rms_norm_linear"])
def test_decode_rows_are_bit_identical_across_buckets(form):
    """A row's result does not depend on how many rows share the decode GEMM (1 .. 64): the
    same tiles, split and order of sums at every bucket."""
    g, big = case(form, 64, seed=3)
    small = {k: v[:5].clone() for k, v in big.items()}
    a, _ = run(g, small)
    b, _ = run(g, big)
    for x, y in zip(a, b):
        assert torch.equal(x, y[:5])


def test_w8a8_keeps_one_kernel_at_every_m():
    """W8A8 keeps its group sums in the reference's order: no decode variant, no split of K."""
    for rows in (3, 200):
        g, ins = case("linear_w8a8", rows)
        got, kinds = run(g, ins)
        assert kinds == ["prefill"]
        want = interpret(g, {k: v.clone() for k, v in ins.items()})[0]
        torch.testing.assert_close(got[0], want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
