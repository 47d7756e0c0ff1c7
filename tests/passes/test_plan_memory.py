"""Memory planning: golden plan, liveness never overlaps in a buffer, and the CPU executor
writing into the planned buffers gives the interpreter's results."""
import torch

import deepfuse
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret
from deepfuse.passes.plan_memory import describe, lifetimes, plan_memory
from tests.passes.test_prologue_fusions import step_inputs

W1, W2, N = torch.randn(16, 8), torch.randn(8, 8), torch.randn(8)


def mlp(x):
    h = ops.linear(x, W1)              # [T,16]
    a, b = ops.split(h, sizes=[8, 8])  # views of h
    y = ops.add(a, b)                  # [T,8]; the last reader of the views
    z = ops.linear(ops.rms_norm(y, N, eps=1e-6), W2)
    return ops.add(ops.linear(z, W1), h)


GOLDEN = """\
buf0: f32[T,16]
buf1: f32[T,8]
buf2: f32[T,16]
%0 = linear -> buf0
%1 = split -> view
%2 = split -> view
%3 = add -> buf1
%4 = rms_norm -> buf2
%5 = linear -> buf1
%6 = linear -> buf2
%7 = add -> output
"""


def test_golden_plan_reuses_dead_buffers_and_keeps_viewed_ones():
    g = trace(mlp, Spec("x", "f32", ("T", 8)))
    plan = plan_memory(g)
    # %3 is dead once rms_norm read it, so %5 reuses buf1 (not buf2: %5 reads %4 in it); %6 takes
    # buf2, grown from 8 to 16 per row; h's buf0 stays live to the end (the final add reads it)
    assert describe(plan, g) == GOLDEN
    assert plan.nbytes({"T": 4}) == 4 * 4 * (16 + 8 + 16)


def test_no_two_live_values_share_a_buffer(tiny_model):
    art = deepfuse.compile(tiny_model)
    g = art.graph
    plan = plan_memory(g)
    life = lifetimes(g)
    by_buf: dict[int, list] = {}
    for v, b in plan.assign.items():
        by_buf.setdefault(b, []).append(life[v])
    for spans in by_buf.values():
        spans.sort()
        assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))  # one ends before the next is made
    activations = sum(len(n.outputs) for n in g.nodes) - len(g.outputs)
    assert len(plan.assign) == activations and len(plan.buffers) <= 8 < activations


def test_cpu_executor_writes_into_planned_buffers_and_matches_the_interpreter(tiny_model):
    art = deepfuse.compile(tiny_model)  # f32: projections (panels or dense) write in place too
    ex = art.runner
    planned = [p for p in ex.planned if p is not None]
    assert {p["op"] for p in planned} >= {"embedding", "add_rms_norm_linear", "qkv_attention", "swiglu_linear"}
    for _ in range(2):  # a second step of the same size reuses the same views
        a, b = step_inputs(tiny_model.config), step_inputs(tiny_model.config)
        torch.testing.assert_close(art(b)[0], interpret(art.graph, a)[0], atol=1e-4, rtol=1e-4)
    arena = {t.data_ptr() for t in ex.buffers.storage}
    assert all(v[0].untyped_storage().data_ptr() in arena for v in ex.buffers.views if v is not None)
