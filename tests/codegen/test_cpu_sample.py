"""The CPU target's native sampler (sample.cpp) against the `sample` and `spec_verify` ops'
references (ir/opdefs_llm.py, ir/sampling.py, which tests/ir/test_sampling.py checks against
brute force and the draw's distribution): every token equal, greedy and sampled rows, the
special values included, and inside a step program."""
import math

import pytest
import torch

from deepfuse.ir import OPS

sample_ref, verify_ref = OPS["sample"].reference, OPS["spec_verify"].reference


def rows(r: int, v: int, seed: int, spread: float = 3.0) -> list[torch.Tensor]:
    """Random logits; greedy rows, top-k (1, small, over V, negative), top-p (0 .. 1) and 64-bit seeds."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, v, generator=g) * spread
    t = torch.tensor([0.0, 0.7, 1.0, 1.5, 0.3] * r)[:r]
    k = torch.tensor([0, 5, 50, 0, 1, v + 100, -3, v - 1] * r)[:r]
    p = torch.tensor([1.0, 0.9, 0.5, 0.3, 0.95, 1.0, 0.0, 0.999, 0.7] * r)[:r]
    return [x, t, k, p, torch.randint(-2 ** 62, 2 ** 62, (r,), generator=g)]


@pytest.mark.parametrize("v", [1, 7, 300, 2500, 49152])
def test_sampled_and_greedy_rows_give_the_references_tokens(native, v):
    """Scores spread over tens (random) and over a language model's range (a few tokens far above
    the rest); the draws differ from the argmax in many rows, so the draw itself is compared."""
    differ = 0
    for seed in range(4):
        ins = rows(45, v, seed)
        if seed % 2:
            ins[0][:, : min(v, 6)] += 12.0  # a few likely tokens over a long tail, as a model's logits
        got, want = native.sample(*ins), sample_ref(*ins)
        assert torch.equal(got, want), (seed, (got != want).nonzero().flatten().tolist())
        differ += int((want != ins[0].argmax(-1)).sum())
    assert v < 300 or differ >= 30


def test_special_values_give_the_references_tokens(native):
    """NaN logits (never chosen), one or several +inf (the first wins), rows of -inf or NaN only,
    a temperature so small that z overflows, ties across the top-k threshold, a NaN temperature
    (greedy) and a NaN top_p (no filter)."""
    v, inf, nan = 64, math.inf, math.nan
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, v, generator=g)
    x[0, [3, 9]] = nan
    x[1, 20] = inf
    x[2, [5, 40]] = inf
    x[3] = -inf
    x[4] = nan
    x[5, 7] = -inf
    x[6] = torch.arange(v).float() % 4  # 16-way ties
    x[7, :5] = 2.0
    t = torch.tensor([0.8, 0.8, 1.0, 1.0, 1.0, 1e-39, 1.0, 0.5, nan, 1.0, 0.8, 2.0])
    k = torch.tensor([0, 3, 0, 5, 0, 0, 20, 3, 0, 0, 1, 64])
    p = torch.tensor([0.9, 0.5, 0.2, 0.9, 0.5, 1.0, 0.3, 0.0, 1.0, nan, 0.0, 0.999])
    seeds = torch.arange(12) * 1_000_003 - 5
    got, want = native.sample(x, t, k, p, seeds), sample_ref(x, t, k, p, seeds)
    assert torch.equal(got, want), (got, want)
    assert got[1] == 20 and got[2] == 5 and got[3] == 0 and got[0] not in (3, 9)


def test_top_p_just_under_one_gives_the_references_tokens(native):
    """top_p = 1 - 2^-24: the kept head is thousands of tokens, its cut within rounding of the
    total; the draws (likely tokens) are the reference's."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 49152, generator=g) * 3
    t, k, p = torch.full((6,), 0.417), torch.zeros(6, dtype=torch.int64), torch.full((6,), 0.99999994)
    seeds = torch.arange(6) * 7 + 1
    assert torch.equal(native.sample(x, t, k, p, seeds), sample_ref(x, t, k, p, seeds))


def test_top_k_edges_give_the_references_tokens(native):
    """Top-k where fewer than k tokens are finite (a grammar or min_p masked the rest), over
    logits a million times larger than usual, followed by top_p just under 1, and over a maximum
    of -0.0 tied with +0.0 (top-k keeps only +0.0, the larger key)."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(5, 4096, generator=g) * 3
    x[0, 20:] = -math.inf  # 20 finite, k = 40
    x[1] *= 1e6
    x[3] = -1.0
    x[3, [7, 30, 31]] = torch.tensor([-0.0, 0.0, 0.0])
    x[4, 100:] = -math.inf
    t = torch.tensor([0.8, 0.8, 0.6, 1.0, 1.0])
    k = torch.tensor([40, 5, 50, 2, 100])
    p = torch.tensor([1.0, 0.9, 0.99999994, 1.0, 0.95])
    seeds = torch.arange(5) * 31 + 2
    got, want = native.sample(x, t, k, p, seeds), sample_ref(x, t, k, p, seeds)
    assert torch.equal(got, want), (got, want)
    assert got[0] < 20 and got[3] in (30, 31) and got[4] < 100


def test_sampled_rows_run_in_parallel_and_each_keeps_its_own_draw(native):
    """A batch of rows gives each row's single-row token (rows are independent of their batch)."""
    ins = rows(64, 3000, 7)
    whole = native.sample(*ins)
    for r in range(0, 64, 9):
        assert native.sample(*[a[r:r + 1] for a in ins])[0] == whole[r]
    out = torch.full((64,), -7, dtype=torch.int64)
    assert native.sample(*ins, out=out) is not None and torch.equal(out, whole)


def test_bad_operands_are_refused_with_the_kernels_message(native):
    x, t, k, p, s = rows(3, 10, 0)
    with pytest.raises(RuntimeError, match="sample: logits must be f32"):
        native.sample(x.double(), t, k, p, s)
    with pytest.raises(RuntimeError, match="top_k and seeds contiguous int64"):
        native.sample(x, t, k.int(), p, s)
    with pytest.raises(RuntimeError, match="contiguous f32"):
        native.sample(x, t[:2], k, p, s)
    with pytest.raises(RuntimeError, match="spec_verify: tokens and drafts"):
        native.spec_verify(torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))


def test_spec_verify_gives_the_references_rows(native):
    g = torch.Generator().manual_seed(0)
    for r in range(0, 40):
        drafts = torch.where(torch.rand(r, generator=g) < 0.3, -1, torch.randint(0, 3, (r,), generator=g))
        if r:
            drafts[-1] = -1
        tokens = torch.where(torch.rand(r, generator=g) < 0.6, drafts.clamp(min=0), torch.randint(0, 3, (r,), generator=g))
        assert torch.equal(native.spec_verify(tokens, drafts), verify_ref(tokens, drafts)), r


def test_the_program_ops_sample_and_verify_into_the_runs_outputs(native):
    x, t, k, p, s = rows(6, 500, 5)
    drafts = torch.tensor([4, -1, 7, 9, -1, -1])
    prog = native.StepProgram()
    logits, tokens, kept = (prog.output([6, 500], torch.float32), prog.output([6], torch.int64),
                            prog.output([6], torch.int64))
    prog.index_select_to(x, torch.arange(6), logits)
    prog.sample_to(logits, t, k, p, s, tokens)
    prog.spec_verify_to(tokens, drafts, kept)
    status, (_, first, verified) = prog.run_step()
    want = sample_ref(x, t, k, p, s)
    assert status == 0 and torch.equal(first, want) and torch.equal(verified, verify_ref(want, drafts))
    s.add_(1)  # a new draw per seed, read at run time
    _, (_, second, _) = prog.run_step()
    assert torch.equal(second, sample_ref(x, t, k, p, s)) and second.data_ptr() != first.data_ptr()
