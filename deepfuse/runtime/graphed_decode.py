"""Graphed decode: decode steps run in fixed batch buckets over static inputs, as CUDA graphs on a GPU.

A step qualifies when every sequence has one new token and one sampled row (plain decode; a
one-token prompt chunk is the same computation) and the batch fits the largest bucket. Mixed
prefill/decode steps, steps that verify drafts, prompt-logprob chunks of more than one token and
larger batches run eagerly (Engine._run_step).

Buckets: 1, 2, 4, 8, then multiples of 8 up to max_num_seqs (and max_num_seqs itself). A step of
n sequences runs in the smallest bucket b >= n; rows n..b-1 are padding with a defined meaning:
token 0 at position 0, one query over one key, whose k/v go to slot 0 of the cache's scratch
block in every cache group (KVCache(scratch=True): past the pools' ids, never a real block),
greedy, no draft; their outputs are dropped.

Inputs: one codegen.triton.staging.Staging laid out for the largest bucket (the 1-D inputs
[bmax], then the block tables at full width [bmax, max_blocks]). StepBuffers.fill writes the
real rows into its host views, the pad rows follow, and one non-blocking copy moves the bytes
the bucket uses; bucket b's static inputs are the device views' first b rows.

capture=True (a CUDA device): each bucket runs once (warm-up: Triton builds its kernels) and is
captured, largest first, all graphs sharing one memory pool; a step replays its bucket's graph
and gets views of its static outputs (valid until the next step). capture=False runs the same
padded buckets eagerly over the same static buffers (what the CPU tests check, in Triton's
interpreter). Owns the staging buffers and the graphs; writes the cache only through the step.
"""
from __future__ import annotations

import numpy as np
import torch

from ..codegen.artifact import CompiledModel
from ..codegen.triton.staging import Staging, layout
from ..ir import DTYPES
from .batch import SeqChunk, StepBuffers
from .kv_cache import KVCache


def decode_buckets(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, 8, 16, 24, ...] up to max_num_seqs, which is always the last."""
    out = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return out + [max_num_seqs]


def plain_decode(chunks: list[SeqChunk]) -> bool:
    """Whether every chunk is one new token with one sampled row (its k/v written, not replayed)."""
    return bool(chunks) and all(len(c.tokens) == 1 and c.samples == 1 and c.start >= c.replay_end for c in chunks)


class GraphedDecode:
    """model: a CompiledModel (its graph names the step inputs); cache: made with scratch=True on
    model.device; max_blocks: the engine's table width (blocks per sequence)."""

    def __init__(self, model: CompiledModel, cache: KVCache, max_num_seqs: int, max_blocks: int,
                 capture: bool | None = None):
        if cache.scratch_blocks is None or None in cache.scratch_blocks:
            raise ValueError("graphed decode needs a cache with a scratch block in every group (KVCache(scratch=True))")
        self.model, self.cache, self.buckets = model, cache, decode_buckets(max_num_seqs)
        bmax = self.buckets[-1]
        fields = []
        for v in model.graph.inputs:
            if not v.name.startswith("kv_cache."):  # T, S, R: rows; B: blocks per sequence
                shape = tuple(max_blocks if d == "B" else bmax if isinstance(d, str) else d for d in v.type.shape)
                fields.append((v.name, DTYPES[v.type.dtype], shape))
        places, nbytes = layout(sorted(fields, key=lambda f: len(f[2])))  # the tables last
        self.staging = Staging(nbytes, model.device)
        self.host = {k: self.staging.host_view(*p).numpy() for k, p in places.items()}
        self.buffers = StepBuffers(bmax, bmax, max_blocks, arrays=self.host)
        layers = {f"kv_cache.{i}": t for i, t in enumerate(cache.layers)}
        self.static = {b: {**{k: self.staging.device_view(*p)[:b] for k, p in places.items()}, **layers}
                       for b in self.buckets}
        # the bytes bucket b reads: up to its last row of the last field
        self.ends = {b: max(off + b * dt.itemsize * int(np.prod(shape[1:], dtype=np.int64))
                            for off, dt, shape in places.values()) for b in self.buckets}
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]] = {}
        if capture if capture is not None else model.device.type == "cuda":
            self.capture()

    def fits(self, chunks: list[SeqChunk]) -> bool:
        return len(chunks) <= self.buckets[-1] and plain_decode(chunks)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def __call__(self, chunks: list[SeqChunk], tokens: torch.Tensor | None = None
                 ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Runs a plain decode step (fits() first) -> (the step's host inputs, StepBuffers.fill's
        views of its n real rows; outputs [logits [n, V], next_tokens [n], hidden [n, D]]).
        tokens [n] on the device: the rows' token ids, copied over the uploaded ones before the
        step (fed from the last step's outputs: overlap.py)."""
        n = len(chunks)
        b = self.bucket(n)
        self.staging.wait_writable()
        for k in ("block_tables", "block_tables.sliding"):
            if k in self.host:
                self.host[k][:n] = 0  # past each table's width too: the static tables are full width
        inputs = self.buffers.fill(chunks, self.cache)
        self._pad(n, b)
        self.staging.upload(self.ends[b])
        if tokens is not None:
            self.static[b]["tokens"][:n].copy_(tokens)
        if b in self.graphs:
            graph, outs = self.graphs[b]
            graph.replay()
        else:
            outs = self.model(self.static[b])
        return inputs, [o[:n] for o in outs]

    def _pad(self, n: int, b: int) -> None:
        """Rows n..b-1 as padding (the module docstring)."""
        h, bs, rows = self.host, self.cache.block_size, slice(n, b)
        values = {"tokens": 0, "positions": 0, "seq_lens": 1, "query_lens": 1, "sample_rows": np.arange(n, b),
                  "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seeds": 0, "draft_tokens": -1}
        for g, scratch in zip(self.cache.groups, self.cache.scratch_blocks):
            values.update({"slot_mapping" + g.suffix: scratch * bs, "block_tables" + g.suffix: scratch,
                           "seq_lens" + g.suffix: 1})
        for k, v in values.items():
            if k in h:
                h[k][rows] = v

    def capture(self) -> None:
        """Warms up and captures every bucket, largest first, into one memory pool (CUDA only).
        Padding rows only: the warm-up writes nothing but the scratch blocks."""
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for b in reversed(self.buckets):
                self.staging.wait_writable()
                self._pad(0, b)
                self.staging.upload(self.ends[b])
                self.model(self.static[b])  # Triton builds (and loads) its kernels outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    outs = self.model(self.static[b])
                self.graphs[b] = (graph, outs)
        torch.cuda.synchronize()
