"""The pattern language and the rule-based fusion passes: golden IR, numerics, guards."""
import pytest
import torch

from deepfuse.compiler import trace_model
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret, print_graph
from deepfuse.passes import PassManager, cleanup_passes, fuse_add_rms_norm, fuse_sibling_linears, fuse_swiglu
from deepfuse.passes.check import NumericsError, check_numerics
from deepfuse.passes.manager import Pass
from deepfuse.passes.pattern import Op, Rule, Var, rewrite, rule_pass
from tests.helpers import greedy_with

W = torch.randn(8)


def residual_block(x, r):
    h = ops.add(x, r)
    return ops.rms_norm(h, W, eps=1e-6), ops.silu(h)


def block_graph():
    return trace(residual_block, Spec("x", "f32", ("T", 8)), Spec("r", "f32", ("T", 8)), weights={"w": W})


GOLDEN_BEFORE = """\
graph residual_block(%x: f32[T,8], %r: f32[T,8]) {
  param %w: f32[8]
  %0: f32[T,8] = add(%x, %r)
  %1: f32[T,8] = rms_norm(%0, %w) {eps=1e-06}
  %2: f32[T,8] = silu(%0)
  return %1, %2
}
"""
GOLDEN_AFTER = """\
graph residual_block(%x: f32[T,8], %r: f32[T,8]) {
  param %w: f32[8]
  %0: f32[T,8], %1: f32[T,8] = add_rms_norm(%x, %r, %w) {eps=1e-06}
  %2: f32[T,8] = silu(%0)
  return %1, %2
}
"""


def test_add_rms_norm_golden_ir_and_numerics():
    g = block_graph()
    assert print_graph(g) == GOLDEN_BEFORE
    inputs = {"x": torch.randn(5, 8), "r": torch.randn(5, 8)}
    after = check_numerics(fuse_add_rms_norm, g, inputs)
    assert print_graph(after) == GOLDEN_AFTER
    assert fuse_add_rms_norm.fn.fired == {"add_rms_norm": 1}
    again = fuse_add_rms_norm(after.copy())
    assert print_graph(again) == GOLDEN_AFTER and fuse_add_rms_norm.fn.fired == {"add_rms_norm": 0}


def test_swiglu_golden_ir():
    w = torch.randn(12, 8)

    def mlp(x):
        gate, up = ops.split(ops.linear(x, w), sizes=[6, 6])
        return ops.mul(up, ops.silu(gate))  # operands swapped: add/mul match either order

    g = trace(mlp, Spec("x", "f32", ("T", 8)), weights={"w": w})
    after = check_numerics(fuse_swiglu, g, {"x": torch.randn(3, 8)})
    assert print_graph(after).splitlines()[2:4] == ['  %0: f32[T,12] = linear(%x, %w)',
                                                    '  %1: f32[T,6] = swiglu(%0)']


def test_commutative_wildcards_same_name_and_guards():
    a, b = Var("a"), Var("b")
    double = Rule("x_plus_x", Op("add", a, a), lambda m: ops.mul(m["a"], m["a"]))
    g = trace(lambda x, y: (ops.add(x, x), ops.add(x, y)), Spec("x", "f32", (4,)), Spec("y", "f32", (4,)))
    assert rewrite(g, [double]) == {"x_plus_x": 1}  # add(x, y) does not bind a twice
    assert g.op_counts() == {"mul": 1, "add": 1}
    guarded = Rule("silu_of_y", Op("silu", b), lambda m: m["b"], when=lambda m: m["b"].name == "y")
    g = trace(lambda x, y: (ops.silu(x), ops.silu(y)), Spec("x", "f32", (4,)), Spec("y", "f32", (4,)))
    assert rewrite(g, [guarded]) == {"silu_of_y": 1} and g.op_counts() == {"silu": 1}
    gated = Rule("drop_gate", Op("mul", Op("silu", Var()), Var("u")), lambda m: m["u"])  # Var(): any, uncaptured
    g = trace(lambda x, y: ops.mul(ops.silu(ops.add(x, y)), y), Spec("x", "f32", (4,)), Spec("y", "f32", (4,)))
    assert rewrite(g, [gated]) == {"drop_gate": 1} and g.outputs[0].name == "y"
    assert [n.op for n in g.nodes] == ["add"]  # outside the match: dead now, left to dce


def test_shared_inner_value_blocks_the_rewrite_unless_replaced():
    x, r, w = Var("x"), Var("r"), Var("w")
    root_only = Rule("root_only", Op("rms_norm", Op("add", x, r), w, name="norm"),
                     lambda m: ops.rms_norm(ops.add(m["x"], m["r"]), m["w"], eps=1e-3))
    g = block_graph()  # the add is also read by silu
    assert rewrite(g, [root_only]) == {"root_only": 0}


def test_fusion_pipeline_reports_rule_counts_and_keeps_outputs(tiny_model):
    g0 = trace_model(tiny_model)
    g, reports = PassManager(cleanup_passes() + [Pass("fuse_sibling_linears", fuse_sibling_linears),
                                                 fuse_swiglu, fuse_add_rms_norm]).run(trace_model(tiny_model))
    fired = {r.name: r.fired for r in reports}
    layers = tiny_model.config.num_layers
    assert fired["fuse_swiglu"] == {"swiglu": layers}
    assert fired["fuse_add_rms_norm"] == {"add_rms_norm": 2 * layers}  # after attention and after the MLP
    assert g.op_counts()["rms_norm"] == 1  # only the first layer's input norm has no residual add before it
    prompt = [3, 1, 4, 1, 5, 9]
    want, lw = greedy_with(lambda i: interpret(g0, i), tiny_model.config, prompt, 6)
    got, lg = greedy_with(lambda i: interpret(g, i), tiny_model.config, prompt, 6)
    assert got == want
    torch.testing.assert_close(lg, lw, atol=1e-5, rtol=1e-5)


def test_a_wrong_rewrite_is_caught_and_named():
    x, r, w = Var("x"), Var("r"), Var("w")
    wrong = Rule("forgets_residual", Op("rms_norm", Op("add", x, r, name="sum"), w, name="norm"),
                 lambda m: ops.add_rms_norm(m["x"], ops.mul(m["r"], m["r"]), m["w"], eps=m.attrs("norm")["eps"]),
                 replaces=("sum", "norm"))
    bad = rule_pass("bad_fusion", [wrong])
    inputs = {"x": torch.randn(5, 8), "r": torch.randn(5, 8)}
    with pytest.raises(NumericsError, match=r"after pass bad_fusion: %\w+ = silu\(\.\.\.\) differs"):
        check_numerics(bad, block_graph(), inputs)
