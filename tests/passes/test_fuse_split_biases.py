"""fuse_split_biases: per-part biases after a split become one concatenated bias before it."""
import torch

from deepfuse.frontend import Spec, ops, trace
from deepfuse.passes import fuse_split_biases
from deepfuse.passes.check import check_numerics

BQ, BK = torch.randn(6), torch.randn(4)


def qk(x):
    q, k = ops.split(x, sizes=[6, 4], axis=-1)
    return ops.add_bias(q, BQ), ops.add_bias(k, BK)


def test_every_part_biased_becomes_one_bias_before_the_split():
    g = trace(qk, Spec("x", "f32", ("T", 10)), weights={"bq": BQ, "bk": BK})
    after = check_numerics(fuse_split_biases, g, {"x": torch.randn(3, 10)})
    assert [n.op for n in after.nodes] == ["concat", "add_bias", "split"]


def test_a_part_without_its_bias_or_read_elsewhere_keeps_the_graph():
    def partly(x):
        q, k = ops.split(x, sizes=[6, 4], axis=-1)
        return ops.add_bias(q, BQ), k

    def read_twice(x):
        q, k = ops.split(x, sizes=[6, 4], axis=-1)
        return ops.add_bias(q, BQ), ops.add_bias(k, BK), ops.exp(q)

    for fn in (partly, read_twice):
        g = trace(fn, Spec("x", "f32", ("T", 10)), weights={"bq": BQ, "bk": BK})
        ops_before = [n.op for n in g.nodes]
        assert [n.op for n in fuse_split_biases(g).nodes] == ops_before
