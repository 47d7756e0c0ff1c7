"""Log-probabilities: of the sampled tokens (SamplingParams.logprobs), taken for all of a
step's kept rows at once, and of the prompt tokens (prompt_logprobs), from the rows of prompt
chunks that return every row's logits. Both of the model's own logits, before any sampling
setting. Entries are {token id: Logprob} with each token's rank (1 = the most likely); the
engine names their tokens when it builds an output."""
from __future__ import annotations

import torch

from .batch import SeqChunk
from .outputs import Logprob
from .request import Request


class RowLogprobs:
    """log_softmax of some sample rows of a step's logits [R, V], and their top k, taken at once."""

    def __init__(self, logits: torch.Tensor, rows: list[int], k: int):
        self.at = {r: i for i, r in enumerate(rows)}
        self.lp = torch.log_softmax(logits[torch.tensor(rows, device=logits.device)].float(), -1)
        top = self.lp.topk(k) if k else None
        self.ids, self.values = (top.indices.tolist(), top.values.tolist()) if top is not None else ([], [])

    def entry(self, row: int, tok: int, k: int) -> dict[int, Logprob]:
        """{token id: Logprob} of row's top k and of tok."""
        i = self.at[row]
        out = {t: Logprob(v, r + 1) for r, (t, v) in enumerate(zip(self.ids[i][:k], self.values[i][:k]))}
        if tok not in out:
            v = self.lp[i, tok]
            out[tok] = Logprob(float(v), int((self.lp[i] > v).sum()) + 1)
        return out


def logprob_rows(scheduled: list[tuple[Request, int]], chunks: list[SeqChunk],
                 logits: torch.Tensor) -> RowLogprobs | None:
    """The log-probabilities of the sample rows whose tokens will be kept for requests that
    ask for logprobs (a verify chunk's rows, another chunk's last), all at once."""
    rows, k, row = [], 0, 0
    for (req, _), chunk in zip(scheduled, chunks):
        if req.params.logprobs is not None:
            rows.extend(range(row, row + chunk.samples) if chunk.verify else [row + chunk.samples - 1])
            k = max(k, req.params.logprobs)
        row += chunk.samples
    return RowLogprobs(logits, rows, k) if rows else None


def take_prompt_logprobs(req: Request, start: int, logits: torch.Tensor) -> None:
    """Records the prompt logprobs a prompt chunk's rows give (logits [n, V]: positions start..;
    row i is the distribution of the token at start + i + 1). Rows recorded before (the chunk
    recomputed after a preemption) are skipped."""
    k, got = req.params.prompt_logprobs, req.prompt_logprobs
    if not got:
        got.append(None)  # nothing predicts the first prompt token
    lo, hi = len(got) - 1 - start, min(len(logits), len(req.prompt) - 1 - start)  # rows whose token is next
    if lo < 0 or lo >= hi:
        return
    lp = torch.log_softmax(logits[lo:hi].float(), -1)
    targets = torch.tensor(req.prompt[start + lo + 1:start + hi + 1], device=lp.device)
    picked = lp.gather(1, targets[:, None])
    ranks = ((lp > picked).sum(-1) + 1).tolist()
    top = lp.topk(k, -1) if k else None
    for i, (t, v, rank) in enumerate(zip(targets.tolist(), picked[:, 0].tolist(), ranks)):
        entry = {} if top is None else \
            {u: Logprob(w, r + 1) for r, (u, w) in enumerate(zip(top.indices[i].tolist(), top.values[i].tolist()))}
        if t not in entry:
            entry[t] = Logprob(v, rank)
        got.append(entry)
