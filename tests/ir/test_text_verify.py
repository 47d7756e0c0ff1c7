import pytest
import torch

from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import Node, TensorType, Value, VerifyError, interpret, parse_graph, print_graph, verify


def small_graph():
    w = torch.randn(8, 4)
    norm = torch.ones(4)

    def fn(x):
        h = ops.rms_norm(x, norm, eps=1e-6)
        a, b = ops.split(ops.linear(h, w), sizes=[3, 5])
        return ops.add(ops.silu(a), ops.split(b, sizes=[3, 2])[0])

    return trace(fn, Spec("x", "f32", ("T", 4)), weights={"w": w, "norm": norm}, name="small")


def test_round_trip_small():
    g = small_graph()
    text = print_graph(g)
    assert "split" in text and "{eps=1e-06}" in text
    g2 = parse_graph(text)
    assert print_graph(g2) == text
    verify(g2)


def test_parsed_graph_runs_like_original():
    g = small_graph()
    g2 = parse_graph(print_graph(g))
    g2.weights = g.weights
    x = torch.randn(5, 4)
    torch.testing.assert_close(interpret(g2, {"x": x})[0], interpret(g, {"x": x})[0])


def test_round_trip_smollm2(smollm2):
    from deepfuse.compiler import trace_model

    g = trace_model(smollm2[0])
    text = print_graph(g)
    assert print_graph(parse_graph(text)) == text
    assert text.count(" = attention(") == 30


def test_verifier_names_bad_node_type():
    g = small_graph()
    bad = g.nodes[1]  # the linear
    bad.outputs[0].type = TensorType("f32", ("T", 9))
    with pytest.raises(VerifyError, match=r"node 1 .*linear"):
        verify(g)


def test_verifier_rejects_use_before_def_and_unknown_op():
    g = small_graph()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    with pytest.raises(VerifyError, match="before it is defined"):
        verify(g)
    g = small_graph()
    g.nodes.append(Node("frobnicate", [g.inputs[0]], [Value("z", g.inputs[0].type)]))
    with pytest.raises(VerifyError, match="unknown op 'frobnicate'"):
        verify(g)


def test_parser_errors_name_the_line():
    text = print_graph(small_graph()).replace("rms_norm(%x", "rms_norm(%nope")
    with pytest.raises(ValueError, match=r"line \d+: use of undefined value %nope"):
        parse_graph(text)


def test_interpret_checks_inputs():
    g = small_graph()
    with pytest.raises(ValueError, match="missing graph input %x"):
        interpret(g, {})
    with pytest.raises(ValueError, match="wants f32"):
        interpret(g, {"x": torch.randn(3, 5)})
