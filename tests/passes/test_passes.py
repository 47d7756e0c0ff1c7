import torch

from deepfuse.compiler import trace_model
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import Node, interpret, print_graph, verify
from deepfuse.passes import PassManager, cleanup_passes, cse, dce, fold_constants, fusion_passes
from deepfuse.passes.decompose import decompose_unsupported
from tests.helpers import greedy_with


def test_dce_cse_fold():
    w1, w2 = torch.randn(4, 4), torch.randn(4, 4)

    def fn(x):
        ops.silu(x)  # dead
        return ops.add(ops.linear(x, w1), ops.linear(x, w1))  # the second linear is CSE'd

    g = trace(fn, Spec("x", "f32", ("T", 4)), weights={"w1": w1})
    # make the weight a constant expression: linear(x, add(w1, w2)), which fold_constants evaluates
    p2 = g.add_param("w2", w2)
    summed = g.fresh(g.params[0].type)
    g.nodes.insert(0, Node("add", [g.params[0], p2], [summed]))
    for n in g.nodes[1:]:
        if n.op == "linear":
            n.inputs[1] = summed
    verify(g)
    x = torch.randn(3, 4)
    want = interpret(g, {"x": x})[0]
    g = fold_constants(cse(dce(g)))
    verify(g)
    assert g.op_counts() == {"linear": 1, "add": 1}
    assert [p.name for p in g.params] == ["w1.add"]
    torch.testing.assert_close(interpret(g, {"x": x})[0], want)
    torch.testing.assert_close(want, 2 * x @ (w1 + w2).T)


def test_fusion_changes_graph_not_outputs(tiny_model):
    g = trace_model(tiny_model)
    before = g.op_counts()
    fused, reports = PassManager(cleanup_passes() + fusion_passes()).run(trace_model(tiny_model))
    after = fused.op_counts()
    layers = tiny_model.config.num_layers
    assert before["linear"] == 7 * layers and after["linear"] == 4 * layers
    assert after["swiglu"] == layers and "silu" not in after and "mul" not in after
    assert any(p.name.endswith("q_proj_k_proj_v_proj.weight") for p in fused.params)
    assert all(r.id and r.seconds >= 0 for r in reports)
    prompt = [5, 17, 99, 3, 42, 7]
    a, la = greedy_with(lambda i: interpret(g, i), tiny_model.config, prompt, 8)
    b, lb = greedy_with(lambda i: interpret(fused, i), tiny_model.config, prompt, 8)
    assert a == b
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)


def test_passes_are_idempotent(tiny_model):
    g, _ = PassManager(cleanup_passes() + fusion_passes()).run(trace_model(tiny_model))
    text = print_graph(g)
    g2, _ = PassManager(cleanup_passes() + fusion_passes()).run(g)
    assert print_graph(g2) == text


def test_decompose_expands_unsupported_ops(tiny_model):
    g, _ = PassManager(fusion_passes()).run(trace_model(tiny_model))
    ref = g.copy()
    from deepfuse.ir import OPS

    g = decompose_unsupported(set(OPS) - {"swiglu", "logits"})(g)
    verify(g)
    counts = g.op_counts()
    assert "swiglu" not in counts and "logits" not in counts and counts["take_rows"] == 2  # logits + hidden
    prompt = [1, 2, 3, 4]
    assert greedy_with(lambda i: interpret(g, i), tiny_model.config, prompt, 6)[0] == \
        greedy_with(lambda i: interpret(ref, i), tiny_model.config, prompt, 6)[0]


def test_dump_dir_and_pass_ids(tiny_model, tmp_path):
    pm = PassManager(cleanup_passes() + fusion_passes())
    pm.run(trace_model(tiny_model), dump_dir=str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert "00-dce.before.ir" in files and "04-fuse_sibling_linears.after.ir" in files
    assert len(files) == 2 * len(pm.passes)
    assert len(set(pm.ids().values())) == len(set(p.fn for p in pm.passes))
