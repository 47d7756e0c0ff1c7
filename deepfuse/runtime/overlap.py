"""The overlapped engine loop (Engine(overlap=True)), as in SGLang's and TensorRT-LLM's overlap
schedulers: step n+1 is scheduled, filled and launched while step n runs, its input tokens taken
on the device from step n's; then the host reads step n's tokens (one step behind) and gives them
out (stop conditions, text, callbacks) while n+1 runs. Each step() launches one step and takes
one; the outputs, and the call that returns each, are the synchronous loop's, except that a
request added while a step is in flight is admitted a call later.

Step n+1 goes ahead (`ahead_rows`) when every running request is in step n with one row sampled
by the step (a decode, or its prompt's last chunk) and decodes again: no request waiting for
admission, none with logprobs or prompt logprobs, none drawn on the host (host_sampling.py:
penalties, logit_bias, allowed_token_ids, min_tokens, min_p, structured outputs), no drafts, and
every row's block at hand (no preemption). Any other step is synchronous. A request that step n
ends by max_tokens gets no row in n+1.

The feed (TokenFeed): row j of n+1 takes the token row rows[j] of n sampled; rows goes to the
device in one non-blocking copy and an index_select over n's next_tokens writes n+1's `tokens`
input before n+1's kernels, in stream order. Positions, tables and sampling keys are host-known.

A request that step n ends (EOS, stop id or string, abort) has a row in n+1: its token is never
taken (Engine._take skips finished requests), and its blocks, the row's included, go back with
the request's. Ahead steps reserve blocks unnamed (KVCacheManager.reserve) and name them once
read (`name_read`): a dropped row's KV is never named.

Faults leave the engine as if the steps not taken never ran: one launching n+1 undoes n+1 (and n,
if this call launched it); one awaiting n's tokens undoes both; one while n's tokens are given out
keeps what was taken (as synchronously) and undoes n+1. On a GPU an undone step's kernels still
run, before every later step on the stream, so blocks it gave back are rewritten in order.
Owns the step in flight and the feed and token-copy buffers; changes requests and the cache only
through the engine's step methods, Scheduler.rollback and KVCacheManager.reserve/allocate/truncate.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..codegen.triton.staging import Staging
from .batch import SeqChunk
from .host_sampling import needs_host_sampling
from .scheduler import Checkpoint

if TYPE_CHECKING:
    from .engine import Engine, Launched
    from .request import Request


class TokenFeed:
    """Step n+1's input tokens taken on the device from step n's sampled tokens: __call__(last
    [R], rows [k]) -> last[rows] [k], the k row ids sent in one non-blocking copy."""

    def __init__(self, size: int, device: torch.device):
        self.staging = Staging(8 * size, device)
        self.host = self.staging.host_view(0, torch.int64, (size,)).numpy()
        self.dev = self.staging.device_view(0, torch.int64, (size,))

    def __call__(self, last: torch.Tensor, rows: list[int]) -> torch.Tensor:
        k = len(rows)
        self.staging.wait_writable()
        self.host[:k] = rows
        self.staging.upload(8 * k)
        return last.index_select(0, self.dev[:k])


class TokenCopies:
    """A step's sampled tokens copied to the host without waiting, into one of two host buffers
    (pinned on a GPU; two steps at most are unread), an event recorded after the copy."""

    def __init__(self, size: int, device: torch.device):
        cuda = device.type == "cuda"
        self.bufs = [torch.zeros(size, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0

    def start(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        i, self.turn = self.turn, 1 - self.turn
        buf = self.bufs[i][:len(tokens)]
        buf.copy_(tokens, non_blocking=True)
        if self.events[i] is not None:
            self.events[i].record()
        return buf, self.events[i]


@dataclass
class InFlight:
    """A launched step not read yet. checkpoint: taken before the scheduler chose it (undo:
    Scheduler.rollback); before: an ahead step's rows' table sizes before it (undo: truncate);
    copy: its tokens on their way to the host (None: read them from the outputs)."""

    step: Launched
    checkpoint: Checkpoint | None = None
    before: list[list[int]] | None = None
    copy: tuple[torch.Tensor, torch.cuda.Event | None] | None = None

    def tokens(self) -> list[int]:
        """The step's sampled tokens on the host (waits for the step)."""
        if self.copy is None:
            return self.step.outputs[1].tolist()
        buf, event = self.copy
        if event is not None:
            event.synchronize()
        return buf.tolist()

    def live(self) -> bool:
        return any(not req.finish for req, _ in self.step.scheduled)


def ahead_rows(eng: Engine, step: Launched) -> list[tuple[Request, int]] | None:
    """The (request, row of `step` that samples its next input) pairs of the step that may be
    launched before `step` is read, in the scheduler's order; None where the next step must be
    scheduled from step's tokens (the module docstring)."""
    if eng.drafter is not None or eng.keep_hidden or eng.scheduler.waiting:
        return None
    out, row, live = [], 0, 0
    for (req, _), chunk, host in zip(step.scheduled, step.chunks, step.host):
        row += chunk.samples
        if req.finish:  # aborted, or finished before an ahead step was read
            continue
        live += 1
        p = req.params
        if (host or chunk.samples != 1 or chunk.start + len(chunk.tokens) != len(req.tokens)
                or p.logprobs is not None or req.needs_prompt_rows):
            return None
        if len(req.generated) + 1 >= p.max_tokens:
            continue  # this step's token is its last
        if needs_host_sampling(p, len(req.generated) + 1, eng._stop_ids(p)):
            return None
        out.append((req, row - 1))
    if live != len(eng.scheduler.running) or not out or len(out) > eng.scheduler.config.max_num_tokens:
        return None
    return out


class OverlapLoop:
    """Engine.step() with overlap on (the module docstring). inflight: the step launched and not read."""

    def __init__(self, engine: Engine):
        self.eng = engine
        device = torch.device(engine.model.device)
        size = max(engine.scheduler.config.max_num_tokens, engine.scheduler.config.max_num_seqs)
        self.feed, self.copies = TokenFeed(size, device), TokenCopies(size, device)
        self.inflight: InFlight | None = None

    def step(self, on_token) -> list:
        eng, prev, fresh = self.eng, self.inflight, False
        self.inflight = None
        if prev is not None and not prev.live():
            prev = None  # every request it ran has left: nothing to read
        if prev is None:
            prev, fresh = self._schedule(), True
            if prev is None:
                return []
        try:
            ahead = self._launch_ahead(prev)
        except BaseException:
            if fresh:
                undo(eng, prev)
            else:
                self.inflight = prev
            raise
        try:
            ran = eng._read(prev.step, prev.tokens())
        except BaseException:  # e.g. Ctrl-C while waiting for the device: neither step ran
            undo(eng, ahead)
            undo(eng, prev)
            raise
        self.inflight = ahead
        try:
            if prev.before is not None:
                name_read(eng, prev.step)
                eng.stats.ahead_steps += 1
            return eng._take(ran, on_token)
        except BaseException:  # what was taken stands (as synchronously); the step ahead never ran
            self.inflight = None
            undo(eng, ahead)
            raise

    def _schedule(self) -> InFlight | None:
        """A step the scheduler chooses, launched (rolled back if that raises)."""
        checkpoint = self.eng.scheduler.checkpoint()
        try:
            step = self.eng._launch()
        except BaseException:
            self.eng.scheduler.rollback(checkpoint)
            raise
        return None if step is None else InFlight(step, checkpoint)

    def _launch_ahead(self, prev: InFlight) -> InFlight | None:
        """Launches the step after prev, fed from prev's tokens on the device (None where it
        cannot go ahead). A fault gives back what it reserved."""
        from .engine import Launched

        eng = self.eng
        rows = ahead_rows(eng, prev.step)
        if rows is None:
            return None
        scheduled, chunks, before = [], [], []
        try:
            for req, _ in rows:
                pos = len(req.tokens)  # the position of the token prev samples
                if not eng.kv.can_allocate(req.kv, pos + 1):
                    give_back(eng, scheduled, before)
                    return None
                before.append([len(t) for t in req.kv.tables])
                scheduled.append((req, 1))
                eng.kv.reserve(req.kv, pos + 1)
                p = req.params
                chunks.append(SeqChunk.of(req.kv, [0], pos, temperature=float(p.temperature), top_k=p.top_k,
                                          top_p=p.top_p, seed=req.seed))
            if prev.copy is None:  # before the next step may overwrite prev's outputs
                prev.copy = self.copies.start(prev.step.outputs[1])
            tokens = self.feed(prev.step.outputs[1], [row for _, row in rows])
            inputs, outputs = eng.forward(chunks, tokens)
            copy = self.copies.start(outputs[1])
        except BaseException:
            give_back(eng, scheduled, before)
            raise
        return InFlight(Launched(scheduled, chunks, [False] * len(chunks), inputs, outputs), before=before, copy=copy)


def give_back(eng: Engine, scheduled: list[tuple[Request, int]], before: list[list[int]]) -> None:
    """Ahead rows give back the blocks reserved for them (a request that has left gave back all its own)."""
    for (req, _), sizes in zip(scheduled, before):
        if not req.finish:
            eng.kv.truncate(req.kv, sizes, len(req.kv.names))


def undo(eng: Engine, flight: InFlight | None) -> None:
    """As if `flight` never ran: an ahead step gives back its blocks; a scheduled one is rolled back."""
    if flight is None:
        return
    if flight.before is None:
        eng.scheduler.rollback(flight.checkpoint)
    else:
        give_back(eng, flight.step.scheduled, flight.before)


def name_read(eng: Engine, step: Launched) -> None:
    """Names the blocks an ahead step, now read, filled (it reserved them unnamed)."""
    for req, n in step.scheduled:
        if not req.finish:
            eng.kv.allocate(req.kv, req.tokens, req.computed + n)
