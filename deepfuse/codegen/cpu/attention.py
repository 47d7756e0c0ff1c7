"""CPU paged attention: one launch per layer for the whole step.

Prefill chunks run one SDPA each (4-d operands: torch's flash path; a whole prompt in one
chunk attends to its own k/v rows, plainly causal); in bf16 on a CPU with AMX or AVX512-BF16
(head size 64, 128 or 256, no sinks) they all run in one native call that reads the cache
(prefill_attention.cpp). The query
rows of decoding sequences (one new token each) and of short chunks that continue a cached
sequence (speculative verification: the last token and its drafts) all run in one call of a
native kernel that reads their blocks in place, each row causally limited to its own position
(paged_decode.cpp; f32/bf16, no sinks; in bf16 with AMX a chunk's rows run together on the tile
unit, decode_amx.cpp, and lone decode rows on the vector path). Where it cannot run they are grouped by length and
each group runs one SDPA over blocks gathered as rows of the contiguous k and v halves of the
cache, chunks padded to the group's widest with a causal mask. Host-side facts about the step
(StepLayout) are computed once per step and shared by all layers.

An int8 cache (i8 rows of hd values and their f32 scale, ir.opdefs_llm.quantize_kv_rows) goes
through the same native kernels, which apply each row's scale; the SDPA paths gather its blocks
dequantized, and a whole prompt then reads its keys back from the cache like every later step.

With attrs["batch_invariant"] every row, prompt chunks' too, runs in the native paged kernel:
it computes each row alone over its own keys in an order fixed by the row's position, so the
result never depends on the batch or on how a prompt was split into chunks.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import DeepfuseError
from ...ir.opdefs_llm import causal_mask, dequantize_kv_rows, write_kv
from .bound import Bound
from .kernels import Kernel, factory
from .native import kernels as native_kernels
from .program import native_op

NATIVE_DTYPES = (torch.float32, torch.bfloat16)  # paged_decode.cpp's


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of cache[2,N,BS,Hkv,hd] for block ids tables[...] -> (k, v), each [..., BS*Hkv*hd] of
    `dtype` (an int8 cache's rows dequantized). cache[0] and cache[1] are contiguous: a row gather on
    each is ~5x faster than indexing the block dim of the 5-d tensor (F.embedding wants float rows:
    int8 blocks are gathered as index_select)."""
    n = cache.shape[1]
    flat = tables.reshape(-1)
    if cache.dtype == torch.int8:
        k, v = (dequantize_kv_rows(cache[i].view(n, -1).index_select(0, flat).view(-1, cache.shape[4])).to(dtype)
                for i in (0, 1))
    else:
        k = F.embedding(flat, cache[0].view(n, -1))
        v = F.embedding(flat, cache[1].view(n, -1))
    return k.view(*tables.shape, -1), v.view(*tables.shape, -1)


SHORT_CHUNK = 16  # chunks of at most this many tokens that continue a cached sequence are grouped


@dataclass
class DecodeGroup:
    """Sequences of similar length with few new tokens each, attended in one SDPA call padded
    to the longest (and, for chunks of several tokens, to the widest)."""

    seqs: torch.Tensor  # their indices among the step's sequences [G]
    rows: torch.Tensor  # their query rows [G], or [G,W] for W-token chunks (padding repeats a row)
    blocks: int  # table columns to gather
    length: int  # longest length in the group
    mask: torch.Tensor | None  # [G,1,W,length] bool, None when no padding, window or chunk
    valid: torch.Tensor | None = None  # [G,W] bool: which entries of rows are real queries (W > 1)


def decode_groups(seqs: list[int], rows: list[int], lens: list[int], block_size: int, window: int,
                  slack: float = 0.6, max_groups: int = 4, device: torch.device | str = "cpu",
                  widths: list[int] | None = None) -> list[DecodeGroup]:
    """Sorts sequences by length and starts a new group when a length falls below `slack` of
    its group's longest (at most max_groups): padding waste stays bounded at large batches.
    rows: each sequence's first query row; widths: its number of queries (default 1 each)."""
    widths = widths or [1] * len(seqs)
    order = sorted(range(len(seqs)), key=lambda i: -lens[i])
    parts: list[list[int]] = []
    for i in order:
        if parts and (lens[i] >= slack * lens[parts[-1][0]] or len(parts) == max_groups):
            parts[-1].append(i)
        else:
            parts.append([i])
    groups = []
    for part in parts:
        dl = torch.tensor([lens[i] for i in part])
        longest, wide = int(dl[0]), max(widths[i] for i in part)
        seq_ids = torch.tensor([seqs[i] for i in part], device=device)
        blocks = -(-longest // block_size)
        if wide == 1:
            mask = None
            if len(part) > 1 and int(dl[-1]) != longest or window:
                j = torch.arange(longest)[None, :]
                first = (dl - window).clamp_(min=0) if window else torch.zeros_like(dl)
                mask = ((j < dl[:, None]) & (j >= first[:, None]))[:, None, None, :].to(device)
            groups.append(DecodeGroup(seq_ids, torch.tensor([rows[i] for i in part], device=device), blocks,
                                      longest, mask))
            continue
        w = torch.tensor([widths[i] for i in part])
        jq = torch.arange(wide)[None, :]
        valid = jq < w[:, None]  # [G,W]
        qrow = torch.tensor([rows[i] for i in part])[:, None] + torch.minimum(jq, w[:, None] - 1)
        qpos = dl[:, None] - w[:, None] + torch.minimum(jq, w[:, None] - 1)  # a padding query repeats the last
        k = torch.arange(longest)[None, None, :]
        mask = k <= qpos[:, :, None]
        if window:
            mask &= k > qpos[:, :, None] - window
        groups.append(DecodeGroup(seq_ids, qrow.to(device), blocks, longest, mask[:, None].to(device),
                                  valid.to(device)))
    return groups


class StepLayout:
    """Host-side facts about one step's sequences, computed once and shared by every
    attention launch of the step (all layers see the same seq_lens tensor)."""

    def __init__(self, seq_lens: torch.Tensor, query_lens: torch.Tensor, block_size: int, window: int,
                 every_row_near: bool = False):
        self.seq_lens = seq_lens
        lens, qlens = seq_lens.tolist(), query_lens.tolist()
        starts = [0]
        for n in qlens:
            starts.append(starts[-1] + n)
        # every_row_near (batch invariance): prompt chunks too, so that a row's arithmetic never
        # depends on how its prompt was split into chunks
        short = [s for s, n in enumerate(qlens) if 1 < n and (every_row_near or n <= SHORT_CHUNK and n < lens[s])]
        self.prefills = [(s, starts[s], n, lens[s]) for s, n in enumerate(qlens) if n > 1 and s not in short]
        dec = [s for s, n in enumerate(qlens) if n == 1]
        # the native kernel's query rows: every row of the one-token sequences and short chunks,
        # each with its sequence and its causal length (keys 0 .. len-1)
        near = sorted(dec + short)
        rows = [starts[s] + i for s in near for i in range(qlens[s])]
        device = seq_lens.device
        self.near_rows = torch.tensor(rows, dtype=torch.long, device=device)
        self.near_seqs = torch.tensor([s for s in near for _ in range(qlens[s])], dtype=torch.long, device=device)
        self.near_lens = torch.tensor([lens[s] - qlens[s] + 1 + i for s in near for i in range(qlens[s])],
                                      dtype=torch.long, device=device)
        # every row is such a row, in order (no gather or scatter of q); one per sequence (the step's tables)
        self.all_near = len(rows) == starts[-1]
        self.one_per_seq = self.all_near and len(dec) == len(qlens)
        self._args = (dec, short, starts, lens, qlens, block_size, window)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None
        # the prefill chunks for the native kernel: sequence, first row, rows, length
        self.prefill_seqs, self.prefill_rows, self.prefill_qlens, self.prefill_lens = (
            torch.tensor([p[i] for p in self.prefills], dtype=torch.long, device=device) for i in range(4))
        self._prefill_tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def near_tables(self, tables: torch.Tensor) -> torch.Tensor:
        """The block table row of each near row (shared by the step's layers)."""
        if self.one_per_seq:
            return tables
        if self._tables is None or self._tables[0] is not tables:
            self._tables = (tables, tables.index_select(0, self.near_seqs))
        return self._tables[1]

    def prefill_tables(self, tables: torch.Tensor) -> torch.Tensor:
        """The block table row of each prefill chunk (shared by the step's layers)."""
        if self._prefill_tables is None or self._prefill_tables[0] is not tables:
            self._prefill_tables = (tables, tables.index_select(0, self.prefill_seqs))
        return self._prefill_tables[1]

    @functools.cached_property
    def groups(self) -> list[DecodeGroup]:
        """The near rows as length groups for SDPA: only where the native kernel cannot run."""
        dec, short, starts, lens, qlens, bs, window = self._args
        device = self.seq_lens.device
        return decode_groups(dec, [starts[s] for s in dec], [lens[s] for s in dec], bs, window, device=device) + \
            decode_groups(short, [starts[s] for s in short], [lens[s] for s in short], bs, window, device=device,
                          widths=[qlens[s] for s in short])


def sink_sdpa(q, k, v, mask: torch.Tensor | None, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """SDPA with learned sink logits: q[B,H,Lq,hd], k/v[B,Hkv,Lk,hd], mask broadcastable to
    [B,H,Lq,Lk] (True: attend) or None, sinks[H] -> [B,H,Lq,hd]. Each head's softmax has one
    more logit, sinks[h], whose value is zero. Explicit math: torch's SDPA has no sink input."""
    g = q.shape[1] // k.shape[1]
    scores = (q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    column = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
    return (probs @ v.float().repeat_interleave(g, 1)).to(q.dtype)


@factory("attention")
def _attention(attrs: dict) -> Kernel:
    h, hkv, hd = attrs["num_heads"], attrs["num_kv_heads"], attrs["head_dim"]
    scale, window, writes = attrs["scale"], attrs.get("window", 0), attrs.get("write_kv", True)
    invariant = attrs.get("batch_invariant", False)  # every row through the native paged kernel
    # bf16 rows in runs of at least this many rows of one sequence (verify and prompt chunks) go to
    # the kernel's AMX path, lone rows to its vector path; batch invariance sends every row to AMX
    # (the two paths round differently, and a prompt's rows are lone or not depending on the batch)
    amx_rows = 1 if invariant else 2
    if not attrs.get("sinks"):
        native_kernels()  # built (once per machine) at load, not in the middle of the first generation

    def sdpa(q, k, v, mask, causal: bool, sinks) -> torch.Tensor:
        if sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale,
                                                  enable_gqa=h != hkv)
        if causal:
            mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
        return sink_sdpa(q, k, v, mask, scale, sinks)

    def prefill_kernel(q: torch.Tensor):
        """The native module where prefill_attention.cpp runs (bf16 on the CPU, head size 64/128/256,
        AMX or AVX512-BF16), else None."""
        native = native_kernels() if q.is_cpu and q.dtype == torch.bfloat16 and hd in (64, 128, 256) else None
        return native if native is not None and native.paged_prefill_available() else None

    def decode(q, cache, tables, g: DecodeGroup, sinks) -> torch.Tensor:
        """One group in one SDPA call: q[G,H*hd] -> [G,H*hd], or q[G,W,H*hd] -> [G,W,H*hd]."""
        n, width = q.shape[0], q.shape[1] if q.dim() == 3 else 1
        keys, vals = gather_blocks(cache, tables[:, : g.blocks], q.dtype)
        keys = keys.view(n, -1, hkv, hd)[:, : g.length].transpose(1, 2)
        vals = vals.view(n, -1, hkv, hd)[:, : g.length].transpose(1, 2)
        o = sdpa(q.view(n, width, h, hd).transpose(1, 2), keys, vals, g.mask, False, sinks)
        return o.transpose(1, 2).reshape(q.shape)

    def attention(q, k, v, cache, slots, tables, seq_lens, query_lens, *sink, out: torch.Tensor | None = None):
        """out: a planned buffer [T,H*hd] to write into (else one is allocated). sink: the
        sink logits [H] when attrs["sinks"]."""
        sinks = sink[0] if sink else None
        if writes:
            write_kv(cache, k, v, slots)
        lay = _LAYOUTS.get(seq_lens, query_lens, cache.shape[2], window, invariant)
        if out is None:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        native = native_kernels() if q.is_cpu and sinks is None and q.dtype in NATIVE_DTYPES and len(lay.near_rows) \
            else None
        if invariant and native is None and len(lay.near_rows):
            raise DeepfuseError(f"batch-invariant attention needs the native paged kernel ({q.dtype}, "
                                f"sinks {sinks is not None})")
        if native is not None:  # decode and verify rows read their blocks in place
            tabs = lay.near_tables(tables)
            if lay.all_near:
                native.paged_decode(q.contiguous(), cache, tabs, lay.near_lens, h, window, scale, out, amx_rows, invariant)
                return out
            out[lay.near_rows] = native.paged_decode(q[lay.near_rows], cache, tabs, lay.near_lens, h, window, scale,
                                                     torch.empty(len(lay.near_rows), q.shape[1], dtype=q.dtype),
                                                     amx_rows, invariant)
        elif len(lay.near_rows):
            for g in lay.groups:
                o = decode(q[g.rows], cache, tables[g.seqs], g, sinks)
                if g.valid is None:
                    out[g.rows] = o
                else:
                    out[g.rows[g.valid]] = o[g.valid]
        kernel = prefill_kernel(q) if lay.prefills and sinks is None else None
        if kernel is not None:  # every prefill chunk in one call, over the cache
            kernel.paged_prefill(q.contiguous(), cache, lay.prefill_tables(tables), lay.prefill_rows, lay.prefill_qlens,
                              lay.prefill_lens, h, window, scale, out)
            return out
        for s, a, n, length in lay.prefills:
            # a prompt in one chunk: plain causal, upper half skipped (an int8 cache's keys are read
            # back from it, quantized, as every later step reads them)
            whole = n == length and not window and cache.dtype != torch.int8
            if whole:  # its keys are exactly this step's k/v rows: no gather from the cache
                keys, vals = k[a:a + n].view(n, hkv, hd), v[a:a + n].view(n, hkv, hd)
            else:
                nb = -(-length // cache.shape[2])
                keys, vals = (t.view(-1, hkv, hd)[:length] for t in gather_blocks(cache, tables[s, :nb], q.dtype))
            # 4-D operands: torch's CPU flash kernel (3-D ones fall back to a ~5x slower path)
            qs = q[a:a + n].view(1, n, h, hd).transpose(1, 2)
            o = sdpa(qs, keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
                     None if whole else causal_mask(n, length, window).to(q.device), whole, sinks)
            out[a:a + n] = o[0].transpose(0, 1).reshape(n, h * hd)
        return out

    def bind(q, k, v, cache, slots, tables, seq_lens, query_lens, *sink, out: torch.Tensor | None = None):
        """Bound calls (bound.py) for a step of one decode row per sequence (as many q rows as
        sequences: every query length is 1, whatever the contents), which runs the native paged
        kernel over the step's tables and lengths as they are; None for any other step."""
        native = native_kernels() if q.is_cpu and not sink and q.dtype in NATIVE_DTYPES else None
        if native is None or out is None or q.shape[0] != seq_lens.shape[0] or not q.is_contiguous() \
                or seq_lens.dtype != torch.long or tables.dtype != torch.long:
            return None
        calls = [functools.partial(write_kv, cache, k, v, slots)] if writes else []
        return Bound(calls + [native_op(native, "paged_decode", q, cache, tables, seq_lens, h, window, scale, out,
                                        amx_rows, invariant)])

    attention.bind = bind
    return attention


class _LayoutCache:
    """One StepLayout per (step, window): layers with the same window share it. Holding the
    step's seq_lens tensor keeps its identity from being reused by a later step's."""

    def __init__(self):
        self.last: dict[tuple[int, bool], StepLayout] = {}

    def get(self, seq_lens, query_lens, block_size: int, window: int, every_row_near: bool = False) -> StepLayout:
        lay = self.last.get((window, every_row_near))
        if lay is None or lay.seq_lens is not seq_lens:
            lay = self.last[(window, every_row_near)] = StepLayout(seq_lens, query_lens, block_size, window,
                                                                   every_row_near)
        return lay


_LAYOUTS = _LayoutCache()
