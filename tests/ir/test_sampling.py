"""The sample op's draw (ir/sampling.py) against independent computations: the hash in plain
Python integers, top-k/top-p sets by sorting, and the draw's distribution over many seeds."""
import torch

from deepfuse.ir import OPS
from deepfuse.ir.sampling import top_k_mask, top_p_mask, uniforms


def fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2 ** 32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2 ** 32
    return h ^ (h >> 16)


def test_uniforms_are_the_documented_hash():
    seeds = torch.tensor([0, 7, -1, 2 ** 62 + 12345, -(2 ** 40) - 3])
    got = uniforms(seeds, 50)
    for i, s in enumerate(seeds.tolist()):
        s %= 2 ** 64
        key = fmix(fmix(s % 2 ** 32) ^ (s >> 32))
        for v in range(50):
            h = fmix(key ^ (v * 0x9E3779B1 % 2 ** 32))
            assert got[i, v].item() == (2 * (h >> 9) + 1) / 2 ** 24
    assert 0 < got.min() and got.max() < 1


def test_top_k_keeps_the_k_largest_and_their_ties():
    torch.manual_seed(0)
    z = torch.randint(-5, 5, (40, 30)).float() * 0.37  # many ties
    z[0, 3] = -0.0
    k = torch.randint(-1, 33, (40,))
    got = top_k_mask(z, k)
    for r in range(40):
        kk = int(k[r])
        want = torch.ones(30, dtype=torch.bool) if kk <= 0 or kk >= 30 else z[r] >= z[r].sort(descending=True).values[kk - 1]
        assert torch.equal(got[r], want), r


def test_top_p_keeps_the_smallest_head_with_the_mass():
    """Brute force: walk the distinct probabilities from the largest, in float64; the kept set is
    every token at or above the first value whose head holds top_p of the mass. Rows where the
    float32 sums could decide otherwise (a head's share within 1e-5 of top_p) are skipped."""
    torch.manual_seed(1)
    z = torch.randn(200, 40) * 2
    z[:, :10] = z[:, 10:20]  # ties
    kept = top_k_mask(z, torch.randint(0, 45, (200,)))
    top_p = torch.rand(200) * 1.2
    got = top_p_mask(z, kept, top_p)
    checked = 0
    for r in range(200):
        m = z[r][kept[r]].max()
        p = torch.where(kept[r], torch.exp(z[r] - m), torch.zeros(40)).double()
        if top_p[r] >= 1:
            assert torch.equal(got[r], kept[r])
            continue
        values = sorted(set(p[kept[r]].tolist()), reverse=True)
        shares = [p[p >= v].sum().item() / p.sum().item() for v in values]
        if any(abs(s - top_p[r].item()) < 1e-5 for s in shares):
            continue
        cut = next(v for v, s in zip(values, shares) if s >= top_p[r].item())
        assert torch.equal(got[r], kept[r] & (p >= cut)), r
        checked += 1
    assert checked > 120


def test_top_p_just_under_one_keeps_the_long_tail_in_any_batch():
    """top_p = 1 - 2^-24 over 49,152 tokens: the kept head is thousands of tokens (float64 counts
    the tokens it needs), the same alone or in a batch of other rows. The f32 prefix sums round by
    about as much as the tail top_p leaves out, so the cut may move by a share of that count; what
    must not happen is that no prefix reaches its target and a single token is kept."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(8, 49152, generator=g) * 3 / 0.417
    top_p = torch.full((8,), 0.99999994)
    kept = torch.ones_like(z, dtype=torch.bool)
    batch = top_p_mask(z, kept, top_p)
    for r in (0, 5):
        alone = top_p_mask(z[r:r + 1], kept[r:r + 1], top_p[r:r + 1])[0]
        assert torch.equal(alone, batch[r])
        p = torch.exp(z[r].double() - z[r].max().double()).sort(descending=True).values
        need = int(torch.searchsorted(p.cumsum(0), 0.99999994 * p.sum()).item()) + 1
        assert need > 5000 and alone.sum() > need // 2, (int(alone.sum()), need)


def test_the_draw_follows_softmax_over_the_kept_tokens():
    """20000 seeds of one row: counts against softmax(z / T) restricted to the kept tokens, within a
    chi-square bound (p ~ 1e-4 for 5 degrees of freedom at 26), and nothing outside them drawn."""
    n, ref = 20000, OPS["sample"].reference
    logits = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5]]).expand(n, 6).contiguous()
    t = torch.full((n,), 0.8)
    seeds = torch.arange(n) * 7919 + 5
    for k, p, allowed in ((0, 1.0, [0, 1, 2, 3, 4, 5]), (3, 1.0, [0, 2, 5]), (0, 0.6, [2, 5])):
        tokens = ref(logits, t, torch.full((n,), k), torch.full((n,), p), seeds)
        counts = torch.bincount(tokens, minlength=6).double()
        mask = torch.zeros(6, dtype=torch.bool)
        mask[allowed] = True
        assert counts[~mask].sum() == 0, (k, p, counts)
        probs = torch.where(mask, logits[0] / 0.8, torch.tensor(float("-inf"))).softmax(-1).double()
        chi2 = ((counts[mask] - n * probs[mask]) ** 2 / (n * probs[mask])).sum().item()
        assert chi2 < 26, (k, p, chi2, counts)


def test_greedy_rows_are_the_first_maximum_and_rows_are_independent():
    torch.manual_seed(2)
    logits = torch.randn(6, 64)
    logits[0, 10] = logits[0, 20] = 9.0
    t = torch.tensor([0.0, 0.7, 0.0, 1.3, 0.5, 1.0])
    k, p, seeds = torch.tensor([0, 5, 3, 0, 1, 64]), torch.tensor([1.0, 0.9, 0.5, 0.3, 1.0, 0.99]), torch.arange(6) + 100
    out = OPS["sample"].reference(logits, t, k, p, seeds)
    assert out[0] == 10 and out[2] == logits[2].argmax()
    assert out[4] == logits[4].argmax()  # top_k 1
    for r in range(6):
        assert OPS["sample"].reference(logits[r:r + 1], t[r:r + 1], k[r:r + 1], p[r:r + 1], seeds[r:r + 1])[0] == out[r]


def test_a_nan_logit_is_never_chosen():
    from deepfuse.ir import OPS

    logits = torch.randn(4, 37)
    logits[:, 5] = float("nan")
    logits[:, 9] = 50.0
    temp = torch.tensor([0.0, 1.0, 0.5, 1.0])
    out = OPS["sample"].reference(logits, temp, torch.zeros(4, dtype=torch.int64), torch.ones(4),
                                  torch.arange(4, dtype=torch.int64))
    assert out.tolist() == [9, 9, 9, 9]
