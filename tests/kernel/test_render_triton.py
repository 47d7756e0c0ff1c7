"""The Triton renderer of the kernel IR (codegen/triton/generated.py): every case's kernel, run
by TritonRunner in Triton's CPU interpreter, against the graph interpreter (which runs the kernel
IR's torch interpreter); the looped path of wide rows; reductions with ties and one-signed rows;
and ahead-of-time PTX for sm90/sm100."""
from __future__ import annotations

import os
import re
import warnings

import pytest
import torch

from deepfuse.codegen.triton import build_plan
from deepfuse.codegen.triton.aot import compile_all
from deepfuse.codegen.triton.emit import emittable
from deepfuse.codegen.triton.generated import LOOP_TILE, MAX_TILE
from deepfuse.codegen.triton.runner import TritonRunner
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import Graph, Node, TensorType, Value, interpret
from deepfuse.kernel.ir import Buffer, Index, Instr, Kernel, verify
from deepfuse.passes import dce
from deepfuse.passes.decompose import decompose_unsupported
from deepfuse.passes.generate_kernels import generate_kernels
from tests.kernel.cases import CASES, case_inputs, generated

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
WIDE = 20000  # > MAX_TILE: columns in tiles of LOOP_TILE, in passes


def run_both(g: Graph, ins: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
    """(Triton's outputs, the reference's outputs, the kernel's spec) for graph g of one kernel."""
    plan = build_plan(g, "interpret")
    (launch,) = plan["launches"]
    assert launch["op"] == "kernel" and len(launch["kernels"]) == 1, "the kernel was not rendered"
    with warnings.catch_warnings():  # the interpreter computes masked lanes too (log 0, 0/0)
        warnings.simplefilter("ignore", RuntimeWarning)
        got = TritonRunner(plan, g.weights)(ins)
    return got, interpret(g, ins), launch["kernels"][0]


def from_fn(fn, *specs: Spec) -> Graph:
    """A graph of our own through the same passes as cases.generated."""
    g = trace(fn, *specs, name="wide")
    weights = dict(g.weights)
    g = decompose_unsupported(set())(g)
    g.weights.update(weights)
    return dce(generate_kernels()(g))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_case_matches_interpreter(name, dtype, rows):
    ins = case_inputs(name, dtype, rows=rows)
    got, ref, spec = run_both(generated(name, dtype), ins)
    assert spec["constexprs"]["BR"] > 1 and "for c0" not in spec["source"]  # the one-tile path, rows masked
    tol = 1e-5 if dtype == "f32" else 1e-2
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_bf16_rounding_is_exact():
    """Rounding to bf16 on the bits (nearest even) agrees bit for bit with torch's."""
    ins = case_inputs("rms_norm", "bf16", rows=5)
    got, ref, spec = run_both(generated("rms_norm", "bf16"), ins)
    assert "_rne_bf16" in spec["source"] and torch.equal(got[0], ref[0])


@pytest.mark.parametrize("rows", [1, 3])
def test_wide_softmax_takes_the_looped_path(rows):
    g = from_fn(lambda x: ops.softmax(x), Spec("x", "f32", ("T", WIDE)))
    x = 4 * torch.randn(rows, WIDE, generator=torch.Generator().manual_seed(1))
    (got,), (ref,), spec = run_both(g, {"x": x})
    assert spec["constexprs"] == {"BR": 1, "BC": LOOP_TILE} and WIDE > MAX_TILE
    assert spec["source"].count("for c0 in range") == 3  # max, then sum, then the stores
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-8)


def stats_graph(c: int) -> Graph:
    """A hand-written kernel with every reduction: row max, min, argmax (i32) and log-softmax,
    and where(x == max, col, -1) (col, compare, where, cast)."""
    f32 = lambda out, op, *args, kind="elem", **at: Instr(out, op, args, "f32", kind, at)  # pointwise or load
    store = lambda buf, v, ix: Instr(-1, "store", (v,), "f32" if buf != "am" else "i32", "elem", {"buf": buf, "index": ix})
    row = Index(row=1)
    body = [f32(0, "load", buf="x", index=Index(row=c, col=1)),
            Instr(1, "reduce", (0,), "f32", "row", {"kind": "max"}),
            Instr(2, "reduce", (0,), "f32", "row", {"kind": "min"}),
            Instr(3, "reduce", (0,), "i32", "row", {"kind": "argmax"}),
            f32(4, "sub", 0, 1), f32(5, "exp", 4),
            Instr(6, "reduce", (5,), "f32", "row", {"kind": "sum"}),
            f32(7, "log", 6, kind="row"), f32(8, "sub", 4, 7),
            Instr(9, "col", (), "i32", "elem"), Instr(10, "cast", (9,), "f32", "elem", {"to": "f32"}),
            Instr(11, "eq", (0, 1), "bool", "elem"), Instr(12, "const", (), "f32", "row", {"value": -1.0}),
            Instr(13, "where", (11, 10, 12), "f32", "elem"),
            store("lsm", 8, Index(row=c, col=1)), store("mx", 1, row), store("mn", 2, row), store("am", 3, row),
            store("tag", 13, Index(row=c, col=1))]
    bufs = [Buffer("x", "f32", ("T", c), "in"), Buffer("lsm", "f32", ("T", c), "out"), Buffer("mx", "f32", ("T", 1), "out"),
            Buffer("mn", "f32", ("T", 1), "out"), Buffer("am", "i32", ("T", 1), "out"), Buffer("tag", "f32", ("T", c), "out")]
    k = Kernel("stats", bufs, ("T", 1, c), body)
    verify(k)
    x = Value("x", TensorType("f32", ("T", c)))
    outs = [Value(b.name, TensorType(b.dtype, b.shape)) for b in k.outputs]
    return Graph("stats", [x], [], [Node("kernel", [x], outs, {"kernel": k.to_json()})], outs)


@pytest.mark.parametrize("c", [96, WIDE])
def test_reductions_ties_and_one_signed_rows(c):
    """Small integers tie everywhere (argmax: the first maximum); rows all negative or all
    positive catch masked lanes that would enter max/min as 0. The wide row puts its maximum
    first in tile 1, again in tile 2 at the same lane and at an earlier lane."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(-1, 2, (6, c), generator=gen).float()
    x[0::2] -= 10  # rows 0, 2, 4: all negative
    x[1::2] += 10  # rows 1, 3, 5: all positive
    if c > 2 * LOOP_TILE:
        x[1, LOOP_TILE + 11] = x[1, 2 * LOOP_TILE + 11] = x[1, 2 * LOOP_TILE + 3] = 50.0
    got, ref, spec = run_both(stats_graph(c), {"x": x})
    assert ("for c0" in spec["source"]) == (c > MAX_TILE)
    lsm, mx, mn, am, tag = got
    assert torch.equal(mx, ref[1]) and torch.equal(mn, ref[2]) and torch.equal(am, ref[3]) and torch.equal(tag, ref[4])
    assert (mx < 0).any() and (mn > 0).any()
    if c > 2 * LOOP_TILE:
        assert am[1, 0].item() == LOOP_TILE + 11
    torch.testing.assert_close(lsm, ref[0], rtol=1e-5, atol=1e-5)


def test_unbound_row_count_goes_to_the_reference():
    """A row symbol no input names cannot size the grid: the node is not emittable."""
    (node,) = stats_graph(96).nodes
    k = Kernel.from_json(node.attrs["kernel"])
    k.space = ("S", 1, 96)
    assert emittable(node) and not emittable(Node("kernel", node.inputs, node.outputs, {"kernel": k.to_json()}))


AOT = {"rms_norm": lambda: generated("rms_norm"), "gelu_tanh_glu": lambda: generated("gelu_tanh_glu"),
       "softmax_wide": lambda: from_fn(lambda x: ops.softmax(x), Spec("x", "f32", ("T", WIDE))),
       "rms_norm_bf16": lambda: generated("rms_norm", "bf16")}


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_aot_ptx(arch):
    """PTX of generated kernels: the entry, 128-bit vector loads and stores of the rows (16-byte
    aligned pointers, rows of 96 f32 or bf16, contiguous columns), no local-memory spills."""
    jobs = {n: build_plan(make(), arch)["launches"][0]["kernels"][0] for n, make in AOT.items()}
    files = compile_all([(s, n) for n, s in jobs.items()], arch)
    for n, spec in jobs.items():
        ptx = files[spec["name"] + ".ptx"].decode()
        assert f".entry {spec['name']}(" in ptx, n
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, n
        assert ".local" not in ptx, n
        assert files[spec["name"] + ".cubin"][:4] == b"\x7fELF", n
    assert re.search(r"for c0 in range", jobs["softmax_wide"]["source"])
