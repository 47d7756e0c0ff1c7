"""The AscendC renderer of the kernel IR (codegen/ascendc/emit_generated.py): every case's
generated kernel, built with build_plan and run in deepfuse's CPU emulator of the AscendC API,
against the graph interpreter of the same graph (which runs the kernel IR's interpreter); the
host launch code; the accuracy of the tanh / erf expansions; the emulator's checks of the
Compare / Select rules; rows too long for UB in column tiles."""
from __future__ import annotations

import pytest
import torch

from deepfuse.codegen.ascendc import build_plan, emittable
from deepfuse.codegen.ascendc.emit_generated import emit_generated
from deepfuse.codegen.ascendc.runner import EmulatorRunner
from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import DTYPES, interpret
from deepfuse.passes import dce
from deepfuse.passes.decompose import decompose_unsupported
from deepfuse.passes.generate_kernels import generate_kernels
from tests.conftest import needs_gxx
from tests.kernel.cases import CASES, case_inputs, generated

pytestmark = needs_gxx


def run(g, ins, via_host=False):
    plan = build_plan(g)
    assert [bool(p.get("kernels")) for p in plan["launches"]] == [True], "the kernel node was not rendered"
    return EmulatorRunner(plan, g.weights, via_host=via_host)(ins), interpret(g, ins)


@pytest.mark.parametrize("rows", [1, 70])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rendered_kernel_matches_the_interpreter(name, dtype, rows):
    """f32 within 1e-5 (relative, and absolute near zero: tanh's 1 - 2/(exp(2x)+1) and the
    reference's own 1 + tanh cancel at the level of an ulp of 1); bf16 within 1e-2."""
    ins = case_inputs(name, dtype, rows=rows, seed=rows)
    got, ref = run(generated(name, dtype), ins)
    tol = 1e-5 if dtype == "f32" else 1e-2
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_host_launch_code_runs_a_generated_kernel():
    """Through host/deepfuse_launch.cpp: its tiling (rows = T * groups) and argument order."""
    ins = case_inputs("head_rms_norm", "bf16", rows=70)
    got, ref = run(generated("head_rms_norm", "bf16"), ins, via_host=True)
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=1e-2, atol=1e-2)


def gen(fn, d: int = 96):
    g = trace(fn, Spec("x", "f32", ("T", d)))
    return dce(generate_kernels()(decompose_unsupported(set())(g)))


@pytest.mark.parametrize("op,bound", [("erf", 1e-6), ("tanh", 1e-6)])
def test_expansions_are_accurate(op, bound):
    """erf (Abramowitz-Stegun 7.1.26, 1.5e-7 in exact arithmetic) and tanh (1 - 2/(exp(2x)+1))
    over [-6, 6] and tiny values, against float64 torch: within `bound` absolute."""
    x = torch.cat([torch.linspace(-6, 6, 96 * 60), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7] * 16)])
    g = gen(getattr(ops, op))
    got = run(g, {"x": x.view(-1, 96)})[0][0].reshape(-1).double()
    want = getattr(torch, op)(x.double())
    assert (got - want).abs().max().item() < bound


def where_kernel():
    g = generated("where_clamp", "f32")
    plan = build_plan(g)
    return g, plan, plan["launches"][0]["kernels"][0]


def broken_plan(plan, k, old: str, new: str, name: str):
    assert old in k["source"], k["source"]
    bad = dict(k, name=name, source=k["source"].replace(old, new, 1).replace(k["name"], name))
    return dict(plan, launches=[dict(plan["launches"][0], kernels=[bad])])


def test_emulator_rejects_a_compare_count_of_partial_repeats():
    """Compare's count must cover whole 256-byte repeats (96 floats do not: 128 is rendered)."""
    g, plan, k = where_kernel()
    bad = broken_plan(plan, k, "CMPMODE::GT, 128);", "CMPMODE::GT, 96);", "where_cmp96")
    with pytest.raises(DeepfuseError, match="Compare of 96 elements.*whole 256-byte repeats"):
        EmulatorRunner(bad, g.weights)(case_inputs("where_clamp", rows=2))


def test_emulator_rejects_a_select_mask_too_small():
    """Select over 96 floats consumes the bits of two 64-element repeats: 16 bytes of selMask."""
    g, plan, k = where_kernel()
    line = next(x for x in k["source"].splitlines() if "Select(" in x)
    mask = line.split(", ")[1]
    bad = broken_plan(plan, k, line, line.replace(mask, "maskBuf.Get<uint8_t>(8)"), "where_sel8")
    with pytest.raises(DeepfuseError, match="Select of 96 elements needs a selMask of 16 bytes"):
        EmulatorRunner(bad, g.weights)(case_inputs("where_clamp", rows=2))


def wide_softmax(cols: int, dtype: str):
    g = trace(ops.softmax, Spec("x", dtype, ("T", cols)))
    return dce(generate_kernels()(decompose_unsupported(set())(g)))


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("cols", [40000, 49155])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_a_row_too_long_for_the_unified_buffer_goes_in_column_tiles(dtype, cols, rows):
    """Softmax over a vocabulary: the row does not fit UB, so it is rendered in column tiles
    (renderable, so no host step), and matches the interpreter (f32 1e-5: the tile sums are added
    in another order; bf16 1e-2). 49155 leaves a tail tile that is not whole repeats."""
    g = wide_softmax(cols, dtype)
    (node,) = g.nodes
    assert emittable(node)
    (k,) = emit_generated(node, "wide")["kernels"]
    assert 64 <= k.notes["tile_cols"] < cols and k.notes["tile_cols"] % 64 == 0
    assert k.notes["ub_bytes"] <= 248 * 1024
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols + rows)) * 4
    got, ref = run(g, {"x": x.to(DTYPES[dtype])})
    tol = 1e-5 if dtype == "f32" else 1e-2
    torch.testing.assert_close(got[0].float(), ref[0].float(), rtol=tol, atol=tol)


def test_reductions_across_column_tiles_keep_the_first_extreme():
    """A hand-written kernel over 40000 columns (tiled): argmax / max / min with ties in different
    tiles (the first maximum is in an earlier tile than an equal one; a row whose only maximum is
    in the tail tile), sum, and an elem store of level 1 (x - max)."""
    from types import SimpleNamespace

    from deepfuse.codegen.ascendc.emulate import launch
    from deepfuse.codegen.ascendc.kernel import AscendKernel, pack
    from deepfuse.kernel import interpret as kinterp
    from deepfuse.kernel.ir import Buffer, Index, Instr, Kernel

    c = 40000
    e, rw, f = Index(row=c, col=1), Index(row=1), "f32"
    body = [Instr(0, "load", (), f, "elem", {"buf": "x", "index": e}),
            Instr(1, "reduce", (0,), "i32", "row", {"kind": "argmax"}),
            Instr(2, "reduce", (0,), f, "row", {"kind": "max"}), Instr(3, "reduce", (0,), f, "row", {"kind": "min"}),
            Instr(4, "reduce", (0,), f, "row", {"kind": "sum"}), Instr(5, "sub", (0, 2), f, "elem"),
            Instr(-1, "store", (5,), f, "elem", {"buf": "y", "index": e}),
            Instr(-1, "store", (1,), "i32", "elem", {"buf": "a", "index": rw}),
            Instr(-1, "store", (2,), f, "elem", {"buf": "mx", "index": rw}),
            Instr(-1, "store", (3,), f, "elem", {"buf": "mn", "index": rw}),
            Instr(-1, "store", (4,), f, "elem", {"buf": "s", "index": rw})]
    bufs = [Buffer("x", f, ("T", c), "in"), Buffer("y", f, ("T", c), "out"), Buffer("a", "i32", ("T",), "out"),
            Buffer("mx", f, ("T",), "out"), Buffer("mn", f, ("T",), "out"), Buffer("s", f, ("T",), "out")]
    k = Kernel("tiles", bufs, ("T", 1, c), body)
    (ak,) = emit_generated(SimpleNamespace(attrs={"kernel": k.to_json()}), "gen_tiles")["kernels"]
    tc = ak.notes["tile_cols"]
    assert c // tc >= 2, tc
    x = torch.randn(4, c, generator=torch.Generator().manual_seed(5))
    x[0, [tc + 5, 2 * tc + 3]] = 9.0  # tie in tiles 1 and 2: the first is tc + 5
    x[0, [tc - 1, 2 * tc]] = -9.0  # min tie across a tile boundary
    x[1, [3, tc, c - 1]] = 7.5  # tie in tile 0, tile 1 and the tail tile
    x[2, c - 2] = 11.0  # the only maximum, in the tail tile
    x[3] = 0.25  # all equal: argmax 0
    ref = kinterp.run(k, {"x": x})
    assert ref["a"].tolist() == [tc + 5, 3, c - 2, 0]
    outs = {n: torch.zeros_like(t) for n, t in ref.items()}
    launch(AscendKernel(**ak.to_json()), [x] + [outs[b.name] for b in bufs[1:]], pack(ak.tiling, [(4, c)]))
    assert torch.equal(outs["a"], ref["a"])
    for n in ("y", "mx", "mn"):
        assert torch.equal(outs[n], ref[n]), n
    torch.testing.assert_close(outs["s"], ref["s"], rtol=1e-5, atol=1e-4)


def test_row_values_reductions_and_row_stores():
    """A hand-written kernel over what the cases do not reach: reduce.min / argmax, row math
    (erf, tanh, compare, where on the scalar unit), a row load, row stores (f32 and i32), an elem
    compare against a row value, scalar-first sub / div."""
    from types import SimpleNamespace

    from deepfuse.codegen.ascendc.emulate import launch
    from deepfuse.codegen.ascendc.kernel import AscendKernel, pack
    from deepfuse.kernel import interpret as kinterp
    from deepfuse.kernel.ir import Buffer, Index, Instr, Kernel

    e, rw = Index(row=96, col=1), Index(row=1)
    f, row = "f32", "row"
    body = [Instr(0, "load", (), f, "elem", {"buf": "x", "index": e}),
            Instr(1, "reduce", (0,), f, row, {"kind": "min"}), Instr(2, "reduce", (0,), "i32", row, {"kind": "argmax"}),
            Instr(3, "reduce", (0,), f, row, {"kind": "max"}), Instr(4, "const", (), f, row, {"value": 0.5}),
            Instr(5, "sub", (3, 1), f, row), Instr(6, "erf", (5,), f, row), Instr(7, "tanh", (1,), f, row),
            Instr(8, "lt", (1, 4), "bool", row), Instr(9, "where", (8, 6, 7), f, row),
            Instr(10, "ge", (0, 9), "bool", "elem"), Instr(11, "sub", (4, 0), f, "elem"),
            Instr(12, "div", (0, 3), f, "elem"), Instr(13, "where", (10, 11, 12), f, "elem"),
            Instr(14, "abs", (0,), f, "elem"), Instr(15, "rsqrt", (14,), f, "elem"), Instr(16, "add", (13, 15), f, "elem"),
            Instr(17, "load", (), f, row, {"buf": "s", "index": rw}), Instr(18, "div", (17, 0), f, "elem"),
            Instr(19, "add", (16, 18), f, "elem"),
            Instr(-1, "store", (19,), f, "elem", {"buf": "y", "index": e}),
            Instr(-1, "store", (9,), f, "elem", {"buf": "m", "index": rw}),
            Instr(-1, "store", (2,), "i32", "elem", {"buf": "a", "index": rw})]
    bufs = [Buffer("x", f, ("T", 96), "in"), Buffer("s", f, ("T",), "in"), Buffer("y", f, ("T", 96), "out"),
            Buffer("m", f, ("T",), "out"), Buffer("a", "i32", ("T",), "out")]
    k = Kernel("rowk", bufs, ("T", 1, 96), body)
    (ak,) = emit_generated(SimpleNamespace(attrs={"kernel": k.to_json()}), "gen_rowk")["kernels"]
    gen = torch.Generator().manual_seed(3)
    ins = {"x": torch.randn(70, 96, generator=gen), "s": torch.randn(70, generator=gen)}
    ref = kinterp.run(k, ins)
    outs = {n: torch.zeros_like(t) for n, t in ref.items()}
    tensors = [ins["x"], ins["s"], outs["y"], outs["m"], outs["a"]]
    launch(AscendKernel(**ak.to_json()), tensors, pack(ak.tiling, [(70, 96), (70,)]))
    assert torch.equal(outs["a"], ref["a"])
    for n in ("y", "m"):
        torch.testing.assert_close(outs[n], ref[n], rtol=1e-5, atol=1e-5)
