"""Sampling settings the compiled step does not take, applied on the host to the sampled rows of
the requests that ask for them: vLLM's logit_bias, allowed_token_ids, min_tokens, repetition,
presence and frequency penalties, and min_p; and the grammar of structured outputs.

The compiled step samples every row (argmax for these rows: the engine sends them at
temperature 0); for the requests with these settings, the engine then copies their rows'
logits, adjusts them here, all rows at once, and draws their tokens with the step's own sampler
(the `sample` op: its native kernel, else its reference) under each row's key (request seed,
position). So a request's tokens still do not depend on its batch, and requests without these
settings pay nothing.
In vLLM's order (after structured outputs' mask: what the grammar forbids is -inf):
  1. allowed_token_ids: every other token is masked out;
  2. logit_bias: logit[t] += bias[t];
  3. min_tokens: while fewer tokens were generated, EOS (unless ignore_eos) and stop_token_ids
     cannot be drawn;
  4. repetition: a logit of a token in the prompt or the output is divided by the penalty when
     positive, multiplied by it when negative;
  5. frequency and presence: logit -= frequency * (count in the output) + presence * (1 if any);
  6. min_p (sampled rows): tokens whose probability at the request's temperature is below
     min_p times the most likely token's are masked out;
then the step's sampler: temperature, top-k, top-p, the draw.
Only the ids a request names or has seen are touched (gathers and scatters over them, not
[V]-wide passes per request), except by allowed_token_ids and min_p. Owns the per-request
counts; does not schedule or stop requests.

Speculative decoding: a host-sampled request may verify drafts unless it has penalties that
count its output (repetition, presence, frequency: a draft would change the counts of the rows
after it). Its verified rows are drawn here, in order, each adjusted as the request would be at
that position (the grammar's state after the drafts before it, min_tokens by its count) and
drawn with its position's key; the drafts are kept while the draws equal them, and the first
draw that differs is the request's next token. So its tokens are those decoding without drafts
gives, as for the rows the step verifies itself (spec.py).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..codegen.cpu.row_kernels import native_rows, sample_rows
from .request import SamplingParams


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether a host-sampled request may verify drafts: none of its adjustments counts its output."""
    return params.repetition_penalty == 1.0 and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0


def needs_host_sampling(params: SamplingParams, num_generated: int, stop_ids: set[int]) -> bool:
    """Whether this request's next token must be drawn here rather than by the step."""
    return (params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or (num_generated < params.min_tokens and bool(stop_ids)) or bool(params.logit_bias)
            or params.allowed_token_ids is not None or (params.min_p > 0 and params.temperature > 0)
            or params.structured_outputs is not None)


class TokenCounts:
    """One request's ids: those of its prompt or output, each once (repeated), and its output's,
    each once, with their counts (out_ids, out_counts): numpy arrays grown in place, read as views."""

    def __init__(self, prompt: list[int], generated: list[int]):
        first = np.unique(np.asarray(prompt, dtype=np.int64))
        self.seen = set(first.tolist())
        self._rep = np.empty(len(first) + 64, dtype=np.int64)
        self._rep[:len(first)] = first
        self._ids, self._counts = np.empty(64, dtype=np.int64), np.empty(64, dtype=np.float32)
        self.n_rep, self.n_out = len(first), 0
        self.at: dict[int, int] = {}  # output id -> its index in out_ids
        for tok in generated:
            self.add(tok)

    def add(self, token: int) -> None:
        i = self.at.get(token)
        if i is None:
            if self.n_out == len(self._ids):
                self._ids, self._counts = np.resize(self._ids, 2 * self.n_out), np.resize(self._counts, 2 * self.n_out)
            i = self.at[token] = self.n_out
            self._ids[i], self._counts[i] = token, 0
            self.n_out += 1
        self._counts[i] += 1
        if token not in self.seen:
            self.seen.add(token)
            if self.n_rep == len(self._rep):
                self._rep = np.resize(self._rep, 2 * self.n_rep)
            self._rep[self.n_rep] = token
            self.n_rep += 1

    @property
    def repeated(self) -> np.ndarray:
        return self._rep[:self.n_rep]

    @property
    def out_ids(self) -> np.ndarray:
        return self._ids[:self.n_out]

    @property
    def out_counts(self) -> np.ndarray:
        return self._counts[:self.n_out]


class RowBuffer:
    """A grow-only host buffer for the rows this module adjusts: no [P, V] allocation a step."""

    def __init__(self):
        self.buf = torch.empty(0, 0)

    def take(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A copy of logits[rows] [P, V] as f32 on the host (a view of the buffer)."""
        if self.buf.shape[0] < len(rows) or self.buf.shape[1] != logits.shape[1]:
            self.buf = torch.empty(max(len(rows), 2 * self.buf.shape[0]), logits.shape[1])
        out, index = self.buf[:len(rows)], torch.tensor(rows, device=logits.device)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            torch.index_select(logits, 0, index, out=out)
        else:
            out.copy_(logits.index_select(0, index))
        return out


def _flat(per_row: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index of each entry, the entries) of per-row id arrays."""
    rows = np.repeat(np.arange(len(per_row)), [len(a) for a in per_row])
    ids = np.concatenate(per_row) if per_row else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(rows), torch.from_numpy(ids)


def adjust(logits: torch.Tensor, params: list[SamplingParams], counts: list[TokenCounts],
           banned: list[list[int]]) -> None:
    """Adjusts logits [P, V] f32 in place: row i by params[i] over counts[i], banned[i] at -inf
    (steps 1-6 of the module docstring)."""
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            ids = torch.tensor(p.allowed_token_ids, dtype=torch.long)
            keep = logits[i, ids]
            logits[i] = float("-inf")
            logits[i, ids] = keep
    bias = [i for i, p in enumerate(params) if p.logit_bias]
    if bias:
        rows, ids = _flat([np.fromiter(params[i].logit_bias, dtype=np.int64) for i in bias])
        values = torch.tensor([v for i in bias for v in params[i].logit_bias.values()], dtype=torch.float32)
        logits.index_put_((torch.tensor(bias, dtype=torch.long)[rows], ids), values, accumulate=True)
    if any(banned):
        rows, ids = _flat([np.asarray(b, dtype=np.int64) for b in banned])
        logits[rows, ids] = float("-inf")
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        rows, ids = _flat([counts[i].repeated for i in rep])
        r = torch.tensor([params[i].repetition_penalty for i in rep], dtype=torch.float32)[rows]
        rows = torch.tensor(rep, dtype=torch.long)[rows]
        v = logits[rows, ids]
        logits[rows, ids] = torch.where(v > 0, v / r, v * r)
    out = [i for i, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if out:
        rows, ids = _flat([counts[i].out_ids for i in out])
        n = torch.from_numpy(np.concatenate([counts[i].out_counts for i in out]))
        freq = torch.tensor([params[i].frequency_penalty for i in out], dtype=torch.float32)[rows]
        pres = torch.tensor([params[i].presence_penalty for i in out], dtype=torch.float32)[rows]
        rows = torch.tensor(out, dtype=torch.long)[rows]
        logits[rows, ids] -= freq * n + pres
    min_p = [i for i, p in enumerate(params) if p.min_p > 0 and p.temperature > 0]
    if min_p:
        # p(t) < min_p * p(max) at temperature T  <=>  logit[t] < max logit + T * ln(min_p)
        shift = torch.tensor([[params[i].temperature * math.log(params[i].min_p)] for i in min_p])
        if len(min_p) == len(params):  # every row: in place over the whole tensor
            logits.masked_fill_(logits < logits.amax(-1, keepdim=True) + shift, float("-inf"))
        else:
            for i, d in zip(min_p, shift[:, 0].tolist()):
                logits[i].masked_fill_(logits[i] < logits[i].max() + d, float("-inf"))


def draw(logits: torch.Tensor, params: list[SamplingParams], keys: list[int]) -> list[int]:
    """The step's sampler over adjusted rows [P, V] f32, row i with params[i] and RNG key keys[i]
    (greedy rows alone: the native argmax where it is built, as the CPU step's sampler does)."""
    if all(p.temperature == 0 for p in params) and native_rows() is not None:
        return native_rows().argmax(logits).tolist()
    col = lambda attr, dtype: torch.tensor([getattr(p, attr) for p in params], dtype=dtype)
    return sample_rows(logits.contiguous(), col("temperature", torch.float32), col("top_k", torch.long),
                       col("top_p", torch.float32), torch.tensor(keys, dtype=torch.long)).tolist()


def draw_on_host(scheduled: list, chunks: list, host: list[bool], logits: torch.Tensor, keys: torch.Tensor,
                 buffer: RowBuffer, stop_ids) -> dict[int, int]:
    """The tokens drawn here for a step's host-sampled requests that finish their chunk or verify
    drafts. scheduled: the step's (Request, tokens) pairs; chunks: their SeqChunks; host: whether
    each is host-sampled; logits [R, V], keys [R]: the step's sampled rows; stop_ids(params): the
    request's stop ids (for min_tokens). Returns sample row -> token; a verifying request's rows
    from its first up to the first draw that differs from its draft (verify_on_host)."""
    picks, verifies, row = [], [], 0
    for (req, n), chunk, on_host in zip(scheduled, chunks, host):
        first, row = row, row + chunk.samples
        if on_host and chunk.verify:
            verifies.append((first, chunk, req))
        elif on_host and req.remaining == n:  # not a mid-prompt chunk
            picks.append((row - 1, req))  # its last row
    for _, req in picks + [(None, req) for _, _, req in verifies]:
        if req.counts is None:
            req.counts = TokenCounts(req.prompt, req.generated)
    drawn: dict[int, int] = {}
    if picks:
        rows = [r for r, _ in picks]
        params = [req.params for _, req in picks]
        adjusted = buffer.take(logits, rows)  # a copy: logprobs stay raw
        for i, (_, req) in enumerate(picks):
            if req.matcher is not None:  # structured outputs: what the grammar forbids, first
                req.matcher.mask(adjusted[i])
        adjust(adjusted, params, [req.counts for _, req in picks],
               [sorted(stop_ids(p)) if len(req.generated) < p.min_tokens else [] for p, (_, req) in zip(params, picks)])
        drawn.update(zip(rows, draw(adjusted, params, [int(keys[r]) for r in rows])))
    for first, chunk, req in verifies:
        drawn.update(verify_on_host(req, chunk.tokens[1:], first, logits, keys, buffer, stop_ids))
    return drawn


def verify_on_host(req, drafts: list[int], first: int, logits: torch.Tensor, keys: torch.Tensor, buffer: RowBuffer,
                   stop_ids) -> dict[int, int]:
    """Draws req's verified rows first, first + 1, ... in order, row i adjusted as at the position
    after drafts[:i], until a draw differs from its draft or the drafts end. Returns row -> token;
    the matcher, if any, is left as it was."""
    p, drawn, accepted = req.params, {}, 0
    rows = buffer.take(logits, list(range(first, first + len(drafts) + 1)))
    try:
        for i in range(len(drafts) + 1):
            row = rows[i:i + 1]
            if req.matcher is not None:
                req.matcher.mask(row[0])
            banned = sorted(stop_ids(p)) if len(req.generated) + i < p.min_tokens else []
            adjust(row, [p], [req.counts], [banned])
            tok = draw(row, [p], [int(keys[first + i])])[0]
            drawn[first + i] = tok
            if i == len(drafts) or tok != drafts[i]:
                break
            if req.matcher is not None:  # the state the next row is drawn in
                if not req.matcher.accept(tok):
                    break
                accepted += 1
                if req.matcher.done:  # the draft completed the grammar: the request ends with it
                    break
    finally:
        if req.matcher is not None:
            req.matcher.rollback(accepted)  # the engine accepts the kept tokens as it appends them
    return drawn
