"""fused_moe's routing and sort by expert as two Triton kernels (codegen/triton/moe_align.py), in
Triton's interpreter, f32: the route kernel's expert ids and weights against ir.opdefs_moe.route
(softmax top-k, renormalised or not; sigmoid with a score bias, expert groups, routed scaling
and a shared expert), and the align kernel's rows, pos_of and block_expert exactly equal to a
stable sort by expert written here in torch; then the whole fused_moe launch against the IR
interpreter."""
import os

import pytest
import torch

from deepfuse.codegen.triton import build_plan
from deepfuse.codegen.triton.runner import TritonRunner, bind, grid_of, launched
from deepfuse.codegen.triton.tiles import DECODE_ROWS
from deepfuse.frontend import Spec, trace
from deepfuse.frontend.tracer import apply
from deepfuse.ir import interpret
from deepfuse.ir.opdefs_moe import route, routing_attrs

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
D, INTER = 32, 16
ROUTINGS = {
    "mixtral": dict(experts=8, top_k=2, renormalize=True),
    "qwen": dict(experts=12, top_k=4, renormalize=False),
    "deepseek": dict(experts=16, top_k=4, renormalize=True, scoring="sigmoid", n_group=4, topk_group=2,
                     routed_scaling=2.5, num_shared=1, bias=True),
}


def case(kind: str, tokens: int, seed: int = 0):
    """-> (graph of one fused_moe node, its inputs, its attrs, router logits' inputs)."""
    r = dict(ROUTINGS[kind])
    e, bias = r.pop("experts"), r.pop("bias", False)
    gen = torch.Generator().manual_seed(seed)
    n_all = e + r.get("num_shared", 0)
    router, w13, w2 = torch.randn(e, D, generator=gen), torch.randn(n_all, 2 * INTER, D, generator=gen) / 4, \
        torch.randn(n_all, D, INTER, generator=gen) / 4
    weights = {"router": router, "w13": w13, "w2": w2}
    extra = ()
    if bias:
        weights["bias"] = torch.randn(e, generator=gen) / 10
        extra = (weights["bias"],)
    x = torch.randn(tokens, D, generator=gen)
    g = trace(lambda x: apply("fused_moe", x, router, w13, w2, *extra, **r), Spec("x", "f32", ("T", D)),
              weights=weights, name="moe")
    return g, {"x": x}, r, (x, router, *extra)


def reference_layout(ids: torch.Tensor, n_experts: int, block: int, total: int):
    """rows, pos_of, block_expert of the pairs sorted by expert (stably), each expert's rows
    padded to a multiple of `block`, the rest of the `total` rows the sentinel."""
    flat = ids.flatten().long()
    n = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=n_experts)
    padded = (counts + block - 1) // block * block
    start_padded, start = torch.cumsum(padded, 0) - padded, torch.cumsum(counts, 0) - counts
    dest = start_padded[flat[order]] + torch.arange(n) - start[flat[order]]
    rows = torch.full((total,), n, dtype=torch.int32)
    rows[dest] = order.to(torch.int32)
    pos_of = torch.empty(n, dtype=torch.int32)
    pos_of[order] = dest.to(torch.int32)
    through = torch.cumsum(padded // block, 0)
    block_expert = torch.searchsorted(through, torch.arange(total // block), right=True).clamp(max=n_experts - 1)
    return rows, pos_of, block_expert.to(torch.int32)


def run_route_align(g, ins: dict):
    """Runs only the first two kernels (route, align) of the set the step launches -> that set's
    seven scratch tensors, the route's constexprs and the GEMMs' BM."""
    r = TritonRunner(build_plan(g, "interpret"), g.weights)
    (p, kernels, _), = r.launches
    assert len(kernels) == 10  # two sets of five: up to DECODE_ROWS tokens, and more
    env = list(r.base)
    for name, s in r.plan["inputs"].items():
        env[s] = ins[name]
    step = [env[i] for i in p["in"]]
    kernels = [(spec, fn) for spec, fn in kernels if launched(spec, step)]
    names = [spec["name"] for spec, _ in kernels]
    small = ins["x"].shape[0] <= DECODE_ROWS
    assert len(names) == 5 and all(n.endswith("_small") == small for n in names), names
    assert names[0].removesuffix("_small").endswith("_route") and names[1].removesuffix("_small").endswith("_align")
    tmps = r._scratch(p, kernels[:2], step)
    for spec, fn in kernels[:2]:
        r._launch(spec, fn, grid_of(spec, step, [], tmps), [bind(f, step, [], tmps) for f in spec["args"]])
    first = 0 if small else 7  # each set's scratch of its own
    assert all(t is None for t in tmps[7 - first:14 - first])
    return tmps[first:first + 7], kernels[0][0]["constexprs"], kernels[2][0]["constexprs"]["BM"]


@pytest.mark.parametrize("tokens", [1, 5, 37, 64, 65, 130])  # DECODE_ROWS = 64: the last of one set, the first of the other
@pytest.mark.parametrize("kind", list(ROUTINGS))
def test_route_and_align_kernels_match_the_reference(kind, tokens):
    g, ins, attrs, (x, router, *bias) = case(kind, tokens)
    tmps, _, block = run_route_align(g, ins)
    rows, block_expert, pos_of, weights, _, _, ids = tmps
    want_w, want_ids = route(x @ router.T, attrs["top_k"], attrs["renormalize"], bias[0] if bias else None,
                             **routing_attrs(attrs))
    kt = want_ids.shape[1]
    assert torch.equal(ids.view(tokens, kt).long(), want_ids)
    torch.testing.assert_close(weights.view(tokens, kt), want_w.float(), rtol=1e-5, atol=1e-6)
    n_experts = g.nodes[0].inputs[2].type.shape[0]
    want_rows, want_pos, want_block_expert = reference_layout(ids, n_experts, block, rows.shape[0])
    assert torch.equal(rows, want_rows) and torch.equal(pos_of, want_pos)
    assert torch.equal(block_expert, want_block_expert)
    # the bound the scratch is sized by, from shapes alone: each expert that gets pairs pads < block rows
    assert rows.shape[0] >= tokens * kt and rows.shape[0] % block == 0


@pytest.mark.parametrize("tokens", [37, 64, 65, 130])  # the decode set (16-row blocks) up to 64, the other
@pytest.mark.parametrize("kind", list(ROUTINGS))
def test_fused_moe_launch_matches_the_interpreter(kind, tokens):
    g, ins, _, _ = case(kind, tokens, seed=1)
    got = TritonRunner(build_plan(g, "interpret"), g.weights)({"x": ins["x"].clone()})
    want = interpret(g, {"x": ins["x"].clone()})
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_the_decode_set_takes_its_own_tiles_and_invariant_builds_one_set(arch):
    g, _, _, _ = case("mixtral", 8)
    (p,) = build_plan(g, arch)["launches"]
    base = p["kernels"][-1]["name"]  # the other set's combine: the launch's name
    by_name = {k["name"].removeprefix(base).lstrip("_") or "combine": k for k in p["kernels"]}
    assert list(by_name) == ["route_small", "align_small", "up_small", "down_small", "small",
                             "route", "align", "up", "down", "combine"]
    for suffix, block in (("_small", 16), ("", {"sm90": 64, "sm100": 128}[arch])):  # the sort pads to the GEMMs' BM
        assert by_name["up" + suffix]["constexprs"]["BM"] == by_name["down" + suffix]["constexprs"]["BM"] == \
            by_name["align" + suffix]["constexprs"]["BLOCK"] == block
    assert by_name["up_small"]["when"] == ["le", ["shape", 0, 0], DECODE_ROWS]
    assert by_name["up"]["when"] == ["gt", ["shape", 0, 0], DECODE_ROWS]
    assert ["tmp", 7] in by_name["up"]["args"] and ["tmp", 0] in by_name["up_small"]["args"]
    assert len(p["tmps"]) == 14
    (inv,) = build_plan(g, arch, batch_invariant=True)["launches"]  # one form at every token count
    assert len(inv["kernels"]) == 5 and not any("when" in k or k["name"].endswith("_small") for k in inv["kernels"])
    assert len(inv["tmps"]) == 7
