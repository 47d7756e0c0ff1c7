"""StepBuffers.fill (whole-step numpy) against a plain chunk-by-chunk reference of the same
contract: every input tensor equal, for random ragged steps."""
import random

import numpy as np
import pytest
import torch

from deepfuse.runtime.batch import SeqChunk, StepBuffers
from deepfuse.runtime.kv_cache import CacheConfig, KVCache

BS = 4
MASK = 0xFFFFFFFFFFFFFFFF


def sample_key(seed: int, position: int) -> int:
    """The RNG key of (seed, position) in Python integers: splitmix64, kept to 63 bits."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def reference(chunks: list[SeqChunk], max_blocks: int) -> dict[str, list]:
    """The step inputs written out one chunk and one token at a time."""
    out = {k: [] for k in ("tokens", "positions", "slot_mapping", "seq_lens", "query_lens", "sample_rows",
                           "temperature", "top_k", "top_p", "seeds", "draft_tokens")}
    width = 1  # the longest table's length rounded up to a power of two, at most the buffers' width
    while width < max(len(c.blocks) for c in chunks):
        width *= 2
    width = min(width, max_blocks)
    out["block_tables"] = [[max(b, 0) for b in c.blocks] + [0] * (width - len(c.blocks)) for c in chunks]
    row = 0
    for c in chunks:
        n, k = len(c.tokens), c.samples
        for i, tok in enumerate(c.tokens):
            p = c.start + i
            out["tokens"].append(tok)
            out["positions"].append(p)
            out["slot_mapping"].append(max(c.blocks[p // BS], 0) * BS + p % BS)
        out["seq_lens"].append(c.start + n)
        out["query_lens"].append(n)
        for j in range(k):
            i = n - k + j  # the chunk's token that samples the next position
            out["sample_rows"].append(row + i)
            out["temperature"].append(c.temperature)
            out["top_k"].append(c.top_k)
            out["top_p"].append(c.top_p)
            out["seeds"].append(sample_key(c.seed, c.start + i + 1))
            out["draft_tokens"].append(c.tokens[i + 1] if j < k - 1 else -1)
        row += n
    return out


def random_step(rng: random.Random) -> list[SeqChunk]:
    chunks = []
    for _ in range(rng.randint(1, 6)):
        n = rng.choice([1, 1, 2, rng.randint(1, 9)])
        start = rng.randint(0, 20)
        blocks = [rng.choice([-1, rng.randint(0, 40)]) for _ in range((start + n - 1) // BS + 1 + rng.randint(0, 2))]
        seed = rng.choice([0, 7, -5, rng.getrandbits(62), 2**64 + 3, 2**70 + rng.getrandbits(40)])
        chunks.append(SeqChunk([rng.randint(0, 100) for _ in range(n)], start, blocks, rng.random(),
                               rng.randint(0, 50), rng.random(), seed, samples=rng.randint(1, n)))
    return chunks


def test_fill_writes_what_the_chunk_by_chunk_reference_writes():
    cache = KVCache(2, 1, 4, torch.float32, CacheConfig(block_size=BS, num_blocks=8))
    buffers = StepBuffers(64, 8, 16)
    rng = random.Random(0)
    for _ in range(300):
        chunks = random_step(rng)
        got = buffers.fill(chunks, cache)
        want = reference(chunks, buffers.max_blocks)
        for name, values in want.items():
            dtype = torch.float32 if name in ("temperature", "top_p") else torch.int64
            assert torch.equal(got[name], torch.tensor(values, dtype=dtype)), name
        assert got["kv_cache.1"] is cache.layers[1]


def test_fill_rejects_bad_chunks_by_name():
    cache = KVCache(1, 1, 4, torch.float32, CacheConfig(block_size=BS, num_blocks=8))
    buffers = StepBuffers(8, 2, 4)
    with pytest.raises(ValueError, match="cannot sample its last 3"):
        buffers.fill([SeqChunk([1, 2], 0, [0], samples=3)], cache)
    with pytest.raises(ValueError, match="positions 3..5 has a table of 1 blocks"):
        buffers.fill([SeqChunk([1], 0, [0]), SeqChunk([1, 2, 3], 3, [1])], cache)
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buffers.fill([SeqChunk(list(range(9)), 0, [0, 1, 2])], cache)


@pytest.mark.parametrize("row_writes", [0, StepBuffers.ROW_WRITES])
def test_incremental_decode_fills_write_what_the_reference_writes(row_writes):
    """Runs of decode steps through incremental buffers (which write only what moves from one
    decode step to the next) against the reference, with the runs broken by every change that
    must make a whole fill: a new or released block, another sequence set or a dropped sequence,
    any sampling change, a step repeated (rolled back), a chunk of several tokens or samples, and
    a table that does not cover its position (refused, as by a whole fill). row_writes: the
    most sequences written row by row (0: every step by whole-step numpy)."""
    cache = KVCache(2, 1, 4, torch.float32, CacheConfig(block_size=BS, num_blocks=8))
    buffers = StepBuffers(64, 8, 128, incremental=True)
    buffers.ROW_WRITES = row_writes
    rng = random.Random(1)
    seqs, took = [], []
    whole = buffers._next_decode
    buffers._next_decode = lambda chunks, cache: took.append(whole(chunks, cache)) or took[-1]
    for step in range(800):
        if not seqs or rng.random() < 0.04 or max(d["start"] for d in seqs) > 300:  # another sequence set
            seqs = [dict(start=rng.randint(0, 12), blocks=[rng.randint(0, 40) for _ in range(5)], temperature=rng.random(),
                         top_k=rng.randint(0, 5), top_p=rng.random(), seed=rng.getrandbits(64))
                    for _ in range(rng.randint(1, 5))]
        q = rng.choice(seqs)
        change = rng.random()
        if change < 0.02:
            q[rng.choice(["temperature", "top_p"])] = rng.random()
        elif change < 0.04:
            q["top_k"] = rng.randint(0, 5)
        elif change < 0.06:
            q["seed"] = rng.getrandbits(64)
        elif change < 0.08:
            q["blocks"].append(rng.randint(0, 40))  # the table grows (in place, as the cache manager does)
        elif change < 0.10:
            q["blocks"][0] = -1  # released by a window (in place)
        elif change < 0.12 and len(seqs) > 1:
            seqs.remove(q)
        for d in seqs:
            while (d["start"] + 2) // BS >= len(d["blocks"]):
                d["blocks"].append(rng.randint(0, 40))
        several = rng.random() < 0.04
        chunks = [SeqChunk([rng.randint(0, 100) for _ in range(3 if several and i == 0 else 1)], d["start"], d["blocks"],
                           d["temperature"], d["top_k"], d["top_p"], d["seed"],
                           samples=rng.randint(1, 3) if several and i == 0 else 1) for i, d in enumerate(seqs)]
        if rng.random() < 0.03:  # chunks refused on either path: a table short of the position, 2 samples of 1 token
            d = seqs[0]
            params = (d["temperature"], d["top_k"], d["top_p"], d["seed"])
            refused = [(SeqChunk([1], d["start"], d["blocks"], *params, samples=2), "cannot sample"),
                       (SeqChunk([1], len(d["blocks"]) * BS, d["blocks"], *params), "has a table of")]
            for bad, why in refused[::rng.choice([1, -1])]:  # a refused fill ends the run: only the first meets it
                with pytest.raises(ValueError, match=why):
                    buffers.fill([bad] + chunks[1:], cache)
        got = buffers.fill(chunks, cache)
        want = reference(chunks, buffers.max_blocks)
        for name, values in want.items():
            dtype = torch.float32 if name in ("temperature", "top_p") else torch.int64
            assert torch.equal(got[name], torch.tensor(values, dtype=dtype)), (step, name)
        if rng.random() < 0.03:
            continue  # the step is rolled back: the next fill repeats it
        for d, c in zip(seqs, chunks):
            d["start"] += len(c.tokens)
    assert sum(took) > 300  # the incremental path ran


def test_incremental_buffers_refuse_arrays_of_another_owner():
    with pytest.raises(ValueError, match="incremental buffers must be the fill's own"):
        StepBuffers(4, 2, 2, arrays={"tokens": np.zeros(4, dtype=np.int64)}, incremental=True)


@pytest.mark.parametrize("sequences", [3, StepBuffers.ROW_WRITES + 4])
def test_advance_decode_writes_the_next_decode_step_and_refuses_what_needs_a_whole_fill(sequences):
    """advance_decode (a decode burst's later steps) against the reference fill of the same
    sequences one position on, fed the given tokens, in the memory of the views the last fill
    returned; up to and past a block's end (a table one block short is refused, nothing
    written); after a step that is no plain decode step it refuses. Row-by-row stores and
    whole-step numpy (more sequences than ROW_WRITES)."""
    cache = KVCache(2, 1, 4, torch.float32, CacheConfig(block_size=BS, num_blocks=8))
    buffers = StepBuffers(64, 16, 128, incremental=True)
    rng = random.Random(sequences)
    seqs = [dict(start=rng.randint(0, 12), temperature=rng.random(), top_k=rng.randint(0, 5), top_p=rng.random(),
                 seed=rng.getrandbits(64)) for _ in range(sequences)]
    for d in seqs:
        d["blocks"] = [rng.randint(0, 40) for _ in range(d["start"] // BS + 2)]  # its end within 2 * BS steps
    params = lambda d: (d["temperature"], d["top_k"], d["top_p"], d["seed"])  # noqa: E731
    views = buffers.fill([SeqChunk([1], d["start"], d["blocks"], *params(d)) for d in seqs], cache)
    for _ in range(3 * BS):
        tokens = [rng.randint(0, 100) for _ in seqs]
        fits = all((d["start"] + 1) // BS < len(d["blocks"]) for d in seqs)
        before = {k: v.clone() for k, v in views.items() if isinstance(v, torch.Tensor) and k in buffers.torch}
        assert buffers.advance_decode(tokens) == fits
        if not fits:  # nothing written, and the next fill is a whole one
            assert all(torch.equal(views[k], v) for k, v in before.items())
            break
        for d in seqs:
            d["start"] += 1
        want = reference([SeqChunk([t], d["start"], d["blocks"], *params(d)) for d, t in zip(seqs, tokens)],
                         buffers.max_blocks)
        for name, values in want.items():
            dtype = torch.float32 if name in ("temperature", "top_p") else torch.int64
            assert torch.equal(views[name], torch.tensor(values, dtype=dtype)), name
    else:
        raise AssertionError("no sequence reached the end of its table")
    buffers.fill([SeqChunk([1, 2], 0, [5, 6], *params(seqs[0]))], cache)  # a prompt chunk
    assert not buffers.advance_decode([7])


def test_refill_rewrites_the_last_decode_steps_inputs_and_refuses_any_other_step():
    """refill (the one-step engine's rerun) against the reference fill of the same sequences one
    position on: the same dict and tensors as the last fill, their contents the reference's;
    None (nothing written) after a prompt chunk, for other sampling or another table; then
    fresh_views gives new tensors over the same memory."""
    cache = KVCache(2, 1, 4, torch.float32, CacheConfig(block_size=BS, num_blocks=8))
    buffers = StepBuffers(64, 16, 128, incremental=True)
    chunk = lambda start, token=1, seed=9, blocks=(4, 7, 2): SeqChunk([token], start, list(blocks), 0.7, 3, 0.9, seed)  # noqa: E731
    views = buffers.fill([chunk(5), chunk(2, seed=3)], cache)
    again = buffers.refill([chunk(6, 11), chunk(3, 12, seed=3)], cache)
    assert again is views
    want = reference([chunk(6, 11), chunk(3, 12, seed=3)], buffers.max_blocks)
    for name, values in want.items():
        dtype = torch.float32 if name in ("temperature", "top_p") else torch.int64
        assert torch.equal(again[name], torch.tensor(values, dtype=dtype)), name
    fresh = buffers.fresh_views()
    assert fresh is not views and all(fresh[k] is not views[k] and torch.equal(fresh[k], views[k]) for k in want)
    assert fresh["tokens"].data_ptr() == views["tokens"].data_ptr()
    before = {k: v.clone() for k, v in fresh.items() if k in want}
    for other in ([chunk(7, 11), chunk(4, 12, seed=4)],  # another seed
                  [chunk(7, 11), chunk(4, 12, seed=3, blocks=(4, 7, 5))],  # another table
                  [chunk(7, 11)]):  # fewer sequences
        assert buffers.refill(other, cache) is None
        assert all(torch.equal(fresh[k], v) for k, v in before.items())
    buffers.fill([SeqChunk([1, 2], 0, [5, 6], 0.7, 3, 0.9, 9)], cache)  # a prompt chunk
    assert buffers.refill([chunk(2)], cache) is None
