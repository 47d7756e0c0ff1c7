"""Split-KV decode attention (codegen/triton/split_kv.py) in Triton's interpreter, f32, against the IR
interpreter's qkv_attention and against the one-pass paged kernel: GQA groups of 1, 3 and 4,
sliding windows, sinks, contexts shorter than one partition and spanning many, verify chunks."""
import os
from unittest.mock import patch

import pytest
import torch

from deepfuse.codegen.triton import build_plan, runner
from deepfuse.codegen.triton.runner import TritonRunner, launched
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")
BS, BLOCKS = 16, 64


def graph(h: int, hkv: int, hd: int, window: int = 0, sinks: bool = False):
    """One qkv_attention node over a step's inputs (f32)."""
    sink = 2 * torch.randn(h, generator=torch.Generator().manual_seed(5)) if sinks else None
    specs = [Spec("qkv", "f32", ("T", (h + 2 * hkv) * hd)), Spec("pos", "i64", ("T",)),
             Spec("cache", "f32", (2, BLOCKS, BS, hkv, hd)), Spec("slots", "i64", ("T",)),
             Spec("tables", "i64", ("S", "B")), Spec("lens", "i64", ("S",)), Spec("qlens", "i64", ("S",))]

    def fn(qkv, pos, cache, slots, tables, lens, qlens):
        return ops.qkv_attention(qkv, pos, cache, slots, tables, lens, qlens, sizes=[h * hd, hkv * hd, hkv * hd],
                                 head_dim=hd, theta=10000.0, num_heads=h, num_kv_heads=hkv, scale=hd ** -0.5,
                                 window=window, sinks=sink)

    return trace(fn, *specs, weights={"sinks": sink} if sinks else {})


def step(seqs: list[tuple[int, int]], h: int, hkv: int, hd: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """seqs: (new queries, length after them) per sequence; each sequence's blocks are its own, in
    a shuffled order; the cache holds random keys and values (the new ones are written)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for _, n in seqs]
    free = torch.randperm(BLOCKS, generator=gen).tolist()
    tables = torch.full((len(seqs), max(need)), -1, dtype=torch.int64)  # -1 past a sequence's blocks
    pos, slots = [], []
    for s, (n_q, length) in enumerate(seqs):
        tables[s, :need[s]] = torch.tensor([free.pop() for _ in range(need[s])])
        for p in range(length - n_q, length):
            pos.append(p)
            slots.append(int(tables[s, p // BS]) * BS + p % BS)
    t = len(pos)
    return {"qkv": torch.randn(t, (h + 2 * hkv) * hd, generator=gen), "pos": torch.tensor(pos),
            "cache": torch.randn(2, BLOCKS, BS, hkv, hd, generator=gen), "slots": torch.tensor(slots),
            "tables": tables, "lens": torch.tensor([n for _, n in seqs]), "qlens": torch.tensor([q for q, _ in seqs])}


def run(g, ins: dict) -> tuple[torch.Tensor, list[str]]:
    """The Triton plan's output and the kinds of kernel it launched."""
    plan = build_plan(g, "interpret")
    kinds: list[str] = []

    def spy(spec: dict, step: list) -> bool:
        if launched(spec, step):
            kinds.append(kind(spec["name"]))
            return True
        return False

    with patch.object(runner, "launched", spy):
        out = TritonRunner(plan, g.weights)({k: v.clone() for k, v in ins.items()})[0]
    return out, kinds


def kind(name: str) -> str:
    return "reduce" if name.startswith("reduce_") else name.rsplit("_", 1)[1] if name.endswith(("_rope", "_split")) \
        else "one_pass"


def reference(g, ins: dict) -> torch.Tensor:
    return interpret(g, {k: v.clone() for k, v in ins.items()})[0]


# (queries, length): a decode shorter than one partition, a verify chunk of 4, one decode of
# exactly one key tile and one over several partitions of several tiles (interpreter: 64-key
# tiles, 4 partitions with 2 kv heads), a 20-token prefill chunk (the one-pass kernel's)
MIXED = [(1, 5), (4, 100), (1, 64), (1, 300), (20, 20)]


@pytest.mark.parametrize("h,hkv,hd,window,sinks", [(6, 2, 16, 0, False), (8, 2, 32, 40, False), (4, 4, 16, 0, True),
                                                   (6, 2, 16, 8, True)], ids=["gqa3", "gqa4_window40", "mha_sinks",
                                                                              "gqa3_window8_sinks"])
def test_split_kv_matches_the_interpreter(h, hkv, hd, window, sinks):
    g = graph(h, hkv, hd, window, sinks)
    ins = step(MIXED, h, hkv, hd)
    got, order = run(g, ins)
    assert order == ["rope", "one_pass", "split", "reduce"]
    torch.testing.assert_close(got, reference(g, ins), atol=1e-4, rtol=1e-4)


def test_a_decode_step_runs_only_the_split_kernels():
    """Every sequence has one query (T == S): the one-pass kernel is not launched, and the split
    kernels alone produce every row; without them the short rows would be left unwritten."""
    h, hkv, hd = 6, 2, 16
    g = graph(h, hkv, hd)
    ins = step([(1, 3), (1, 77), (1, 410), (1, 16)], h, hkv, hd, seed=1)
    got, order = run(g, ins)
    assert order == ["rope", "split", "reduce"]
    want = reference(g, ins)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    plan = build_plan(g, "interpret")
    split = next(k for k in plan["launches"][0]["kernels"] if k["name"].endswith("_split"))
    assert split["grid"][2] == 4  # fixed partitions: min(16, cdiv(8 SMs, 2 kv heads)); 410 keys fill them all


def test_split_rows_do_not_depend_on_what_shares_the_step():
    """A decode row's output is bit-identical alone and beside other decodes, a verify chunk and a
    prefill: the partitions are fixed per build, never chosen from the batch."""
    h, hkv, hd = 8, 2, 32
    g = graph(h, hkv, hd, window=0)
    alone = step([(1, 300)], h, hkv, hd, seed=2)
    crowd = step([(1, 7), (20, 20), (1, 300), (3, 50)], h, hkv, hd, seed=3)
    # the crowd's third sequence gets the lone sequence's cache rows, table and query
    crowd["cache"][:, crowd["tables"][2]] = alone["cache"][:, alone["tables"][0]]
    row = 1 + 20
    crowd["qkv"][row] = alone["qkv"][0]
    a, _ = run(g, alone)
    b, order = run(g, crowd)
    assert order == ["rope", "one_pass", "split", "reduce"]
    assert torch.equal(a[0], b[row])
    torch.testing.assert_close(b, reference(g, crowd), atol=1e-4, rtol=1e-4)


def test_split_kv_agrees_with_the_one_pass_kernel():
    """The one-pass paged kernel, made to take every sequence (its short-sequence guard set to 0),
    gives the split path's numbers on a decode and verify step."""
    h, hkv, hd = 6, 2, 16
    g = graph(h, hkv, hd, window=8, sinks=True)
    ins = step([(1, 5), (1, 300), (3, 61)], h, hkv, hd, seed=4)
    split, _ = run(g, ins)
    plan = build_plan(g, "interpret")
    rope, one_pass = plan["launches"][0]["kernels"][:2]
    one_pass["source"] = one_pass["source"].replace("(n_q > 4)", "(n_q > 0)")
    assert "(n_q > 0)" in one_pass["source"]
    one_pass.pop("when")
    plan["launches"][0]["kernels"] = [rope, one_pass]
    whole = TritonRunner(plan, g.weights)({k: v.clone() for k, v in ins.items()})[0]
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
