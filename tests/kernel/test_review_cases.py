"""Cases a review found: each once broke the generated-kernel path (a hang, a wrong constant, a
compile error, memory corruption); each now compiles and matches the interpreter, or is refused
with a clear error."""
from __future__ import annotations

import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret


def S(name, shape, dtype="f32"):
    return Spec(name, dtype, shape)


def check(g, **ins):
    f = deepfuse.compile(g, target="cpu")
    got = f(**ins)
    got = got if isinstance(got, list) else [got]
    for a, b in zip(got, interpret(g, ins)):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-5)
    return f


def test_groups_that_feed_each_other_are_not_merged_into_a_cycle():
    def f(x, y):
        a1, b1 = ops.exp(x), ops.exp(y)
        r, s = ops.reduce_sum(b1), ops.reduce_sum(a1)
        return ops.mul(a1, r), ops.mul(b1, s)

    check(trace(f, S("x", ("T", 8)), S("y", ("T", 4))), x=torch.randn(3, 8), y=torch.randn(3, 4))


def test_a_decomposition_constant_never_takes_a_dropped_constants_name():
    def f(x):
        ops.mul(x, 3.0)  # a constant dce drops
        return ops.softcap(ops.add(x, 5.0), cap=7.0)

    check(trace(f, S("x", ("T", 8))), x=torch.randn(3, 8))


@pytest.mark.parametrize("fn", [
    lambda x, y: ops.cast(ops.gt(x, 0.0), dtype="f32"),
    lambda x, y: ops.cast(x, dtype="bool"),
    lambda x, y: ops.ne(ops.gt(x, 0.0), ops.gt(y, 0.0)),
    lambda x, y: ops.reduce_sum(ops.pow(x, 0.0)),
], ids=["bool_to_f32", "f32_to_bool", "compare_bools", "pow_0"])
def test_bool_casts_compares_and_pow_0_compile(fn):
    g = trace(fn, S("x", ("T", 8)), S("y", ("T", 8)))
    f = deepfuse.compile(g, target="cpu")
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(f(x, y).float(), interpret(g, {"x": x, "y": y})[0].float())


def test_a_reshaped_member_read_by_another_kernel_is_stored():
    gw = torch.randn(4, 8)
    g = trace(lambda x: ops.mul(ops.reshape(ops.exp(x), shape=["T", 4, 8]), gw), S("x", ("T", 32)))
    check(g, x=torch.randn(3, 32))


def test_wrong_input_shapes_are_refused_not_read_out_of_bounds():
    f = deepfuse.compile(trace(lambda x, y: ops.add(ops.exp(x), y), S("x", ("T", 8)), S("y", ("T", 8))))
    with pytest.raises(DeepfuseError, match="wants f32\\[T,8\\]"):
        f(x=torch.randn(5, 4), y=torch.randn(5, 4))
    with pytest.raises(DeepfuseError, match="wants f32\\[T,8\\]"):
        f(x=torch.randn(5, 8), y=torch.randn(3, 8))


def test_the_native_kernel_checks_shapes_itself():
    from deepfuse.codegen.cpu.generated_build import NativeKernel
    from deepfuse.kernel.ir import Kernel

    f = deepfuse.compile(trace(lambda x, y: ops.add(ops.exp(x), y), S("x", ("T", 8)), S("y", ("T", 8))))
    k = NativeKernel(Kernel.from_json(f.graph.nodes[0].attrs["kernel"]))
    with pytest.raises(DeepfuseError, match="wants shape"):
        k(torch.randn(5, 8), torch.randn(3, 8))


def test_a_0d_graph_and_an_odd_reshape_compile():
    check(trace(lambda s: ops.exp(s), S("s", ())), s=torch.tensor(0.5))
    check(trace(lambda x: ops.reshape(ops.exp(x), shape=[4, "T", 8]), S("x", ("T", 32))), x=torch.randn(3, 32))


def test_softcap_in_bf16_rounds_as_its_reference():
    g = trace(lambda x: ops.softcap(x, cap=0.3), S("x", ("T", 96), "bf16"))
    x = torch.randn(5, 96).bfloat16()
    f = deepfuse.compile(g, target="cpu")
    assert torch.equal(f(x), interpret(g, {"x": x})[0])
