"""Expert parallelism by all_to_all (ir/opdefs_ep.py, the moe rule of passes/shard.py): every
rank's graph run together (collectives simulated) against the unpartitioned moe, for 2 and 4
ranks, steps of fewer tokens than ranks, and DeepSeek-style routing; and the dispatch's layout
checked against a token-by-token account of the routing."""
import pytest
import torch

from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import DTYPES, interpret, parse_graph, print_graph, verify
from deepfuse.ir.opdefs_ep import ep_rows, moe_dispatch, with_ep_rows
from deepfuse.ir.opdefs_moe import route
from deepfuse.ir.spmd import interpret_ranks
from deepfuse.passes.shard import R, S, ShardingSpec, partition

D, INTER, E = 16, 8, 8
ROUTINGS = {
    "mixtral": dict(top_k=2, renormalize=True),
    "deepseek": dict(top_k=3, renormalize=True, scoring="sigmoid", routed_scaling=2.5, n_group=4, topk_group=2),
}


def _moe_graph(routing: dict, with_bias: bool, dtype: str = "f32"):
    torch.manual_seed(1)
    w = {"router": torch.randn(E, D), "w13": torch.randn(E, 2 * INTER, D) / 4, "w2": torch.randn(E, D, INTER) / 4}
    w = {k: v.to(DTYPES[dtype]) for k, v in w.items()}
    if with_bias:
        w["bias"] = torch.randn(E) / 10
    bias = [w["bias"]] if with_bias else []
    return trace(lambda x: ops.moe(x, ops.linear(x, w["router"]), w["w13"], w["w2"], *bias, **routing),
                 Spec("x", dtype, ("T", D)), weights=w, name="moe")


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("tokens", [1, 3, 7, 16])
@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_ranks_together_equal_the_unpartitioned_moe(world, tokens, kind):
    g = _moe_graph(ROUTINGS[kind], kind == "deepseek")
    spec = ShardingSpec(world, params={"w13": S(0), "w2": S(0)}, inputs={"x": R}, moe_dispatch="all_to_all")
    ranks = [partition(g, spec, r) for r in range(world)]
    for r in ranks:
        verify(r)
    x = torch.randn(tokens, D)
    outs = interpret_ranks(ranks, [{"x": x, "ep_rows": ep_rows(tokens, world, r)} for r in range(world)])
    want = interpret(g, {"x": x})[0]
    for out in outs:  # every rank ends with all tokens' result
        torch.testing.assert_close(out[0], want, rtol=1e-5, atol=1e-5)


def test_bf16_ranks_together_equal_the_unpartitioned_moe():
    g = _moe_graph(ROUTINGS["mixtral"], False, "bf16")
    spec = ShardingSpec(2, params={"w13": S(0), "w2": S(0)}, moe_dispatch="all_to_all")
    x = torch.randn(11, D).bfloat16()
    outs = interpret_ranks([partition(g, spec, r) for r in range(2)],
                           [{"x": x, "ep_rows": ep_rows(11, 2, r)} for r in range(2)])
    want = interpret(g, {"x": x})[0]
    assert outs[0][0].dtype == torch.bfloat16
    torch.testing.assert_close(outs[0][0], want, rtol=2e-2, atol=2e-2)


def test_a_step_without_tokens_is_refused_by_name():
    with pytest.raises(DeepfuseError, match="'tokens' input, which is missing"):
        with_ep_rows({"positions": torch.zeros(3)}, 2, 0)


def test_golden_rank_graph():
    g = _moe_graph(ROUTINGS["mixtral"], False)
    spec = ShardingSpec(2, params={"w13": S(0), "w2": S(0)}, moe_dispatch="all_to_all")
    text = print_graph(partition(g, spec, 1))
    for line in ("%ep_rows: i64[Tr]", "param %w13: f32[4,16,16]",
                 "%1: f32[Tr,16] = gather_rows(%x, %ep_rows)",
                 "%3: f32[2,Tr,16], %4: f32[2,Tr,2], %5: i64[2,Tr,2], %6: i64[2,Tr] = moe_dispatch(%1, %2, %ep_rows) "
                 "{renormalize=true, top_k=2, world=2}",
                 "%7: f32[2,Tr,16] = all_to_all(%3) {world=2}",
                 "%10: f32[2,Tr,16] = moe_local_experts(%7, %8, %9, %w13, %w2)",
                 "%12: f32[1,Tr,16] = moe_combine(%11, %6)",
                 "%13: f32[2,Tr,16] = all_gather(%12) {dim=0, world=2}",
                 "%14: f32[T,16] = rows_to_tokens(%13, %x)"):
        assert line in text, (line, text)
    assert print_graph(parse_graph(text)) == text


def test_dispatch_sends_each_token_once_to_each_rank_of_its_experts():
    torch.manual_seed(3)
    world, tr, k = 4, 6, 3
    x, logits = torch.randn(tr, D), torch.randn(tr, E)
    rows = torch.tensor([10, 11, 12, 13, -1, -1])  # the last two rows are padding
    send, weights, ids, slots = moe_dispatch(x, logits, rows, world=world, top_k=k, renormalize=False)
    want_w, want_ids = route(logits, k, False)
    per = E // world
    for j in range(world):
        mine = [i for i in range(4) if any(int(e) // per == j for e in want_ids[i])]
        assert slots[j].tolist() == mine + [-1] * (tr - len(mine))
        assert torch.equal(send[j, :len(mine)], x[mine]) and not send[j, len(mine):].any()
        for n, i in enumerate(mine):
            for c in range(k):
                on_j = int(want_ids[i, c]) // per == j
                assert int(ids[j, n, c]) == (int(want_ids[i, c]) - j * per if on_j else -1)
                assert float(weights[j, n, c]) == (float(want_w[i, c]) if on_j else 0.0)
        assert (ids[j, len(mine):] == -1).all()


def test_ep_rows_split_the_step_into_contiguous_rows():
    assert [ep_rows(5, 2, r).tolist() for r in range(2)] == [[0, 1, 2], [3, 4, -1]]
    assert [ep_rows(1, 4, r).tolist() for r in range(4)] == [[0], [-1], [-1], [-1]]


def test_an_unknown_dispatch_is_refused():
    with pytest.raises(DeepfuseError, match="moe_dispatch must be one of all_reduce, all_to_all"):
        ShardingSpec(2, moe_dispatch="alltoall")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernel_of_the_local_experts_matches_the_reference(dtype):
    """The CPU target's grouped-GEMM moe_local_experts against the op's reference (one expert at
    a time), with padding rows and choices on other ranks (-1) among the received rows."""
    from deepfuse.codegen.cpu.kernels import PREPACKED
    from deepfuse.ir.opdefs_ep import moe_local_experts

    torch.manual_seed(5)
    world, tr, k, el = 2, 5, 3, 4
    x = torch.randn(world, tr, D).to(dtype)
    ids = torch.randint(-1, el, (world, tr, k))
    ids[1, 3:] = -1  # padding rows
    weights = torch.rand(world, tr, k)  # nonzero where ids are -1 too: those must be skipped
    w13, w2 = (torch.randn(el, 2 * INTER, D) / 4).to(dtype), (torch.randn(el, D, INTER) / 4).to(dtype)
    pre = PREPACKED["moe_local_experts"]
    got = pre.make({})(x, weights, ids, pre.pack(dtype, w13, w2))
    want = moe_local_experts(x, weights, ids, w13, w2)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert not got[1, 3:].any()


@pytest.mark.parametrize("kind", ["mixtral", "deepseek"])
def test_cpu_kernel_of_a_ranks_experts_matches_the_reference(kind):
    """moe_experts (the all_reduce form) on the CPU target: grouped GEMMs over the rank's
    experts against the op's reference, for the second rank's half of the experts."""
    from deepfuse.codegen.cpu.kernels import PREPACKED
    from deepfuse.ir.opdefs_shard import moe_experts

    torch.manual_seed(6)
    routing = dict(ROUTINGS[kind])
    x, logits = torch.randn(9, D), torch.randn(9, E)
    bias = [torch.randn(E) / 10] if kind == "deepseek" else []
    w13, w2 = torch.randn(E // 2, 2 * INTER, D) / 4, torch.randn(E // 2, D, INTER) / 4
    attrs = {**routing, "first_expert": E // 2}
    pre = PREPACKED["moe_experts"]
    got = pre.make(attrs)(x, logits, pre.pack(torch.float32, w13, w2), *bias)
    want = moe_experts(x, logits, w13, w2, *bias, **attrs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert want.abs().sum() > 0
