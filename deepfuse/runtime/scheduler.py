"""Scheduler: decides, every step, which tokens of which requests run.

Continuous batching under a token budget (max_num_tokens per step), first come first
served:
1. Running requests go first, oldest first. A decoding request takes one token of the
   budget, plus its draft tokens under speculative decoding (as many as fit); a request
   still in its prompt takes what is left, up to its remainder
   (chunked prefill), so a long prompt never holds decoding requests for more than one
   budget-sized step.
2. Waiting requests are then admitted while budget, sequence slots (max_num_seqs) and
   KV blocks allow; each starts after its longest cached prefix.

Preemption by recompute. When a running request needs a block and none is available, the
most recently admitted running request is the victim (LIFO: the oldest requests always
progress, so none starves, and the work thrown away is the least). The victim's blocks are
released — its full blocks stay named in the prefix cache — and it goes back to the front
of the waiting queue; on readmission it recomputes prompt + generated tokens (mostly
from the prefix cache) and continues exactly where it stopped: sampling is keyed by
(seed, position), so its tokens do not change. No admission happens in a step that
preempted.

A step that fails (an exception or Ctrl-C anywhere before its results are taken) is undone
with `rollback(checkpoint)`: requests admitted for it go back to the front of the queue with
their blocks released, running requests lose the blocks and block names it added, and its
pending prefix names are dropped: no block it would have written can be found by prefix
lookup, none leaks, and every request continues from where it was. What stands: preemptions
made while scheduling it (a victim recomputes its tokens, mostly from the prefix cache, with
the same results), cached blocks evicted to make room, and drafters' statistics.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..errors import DeepfuseError
from .kv_cache import KVCacheManager
from .request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_tokens: int = 512  # token budget of one step; also the prefill chunk size
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        if self.max_num_tokens < 1 or self.max_num_seqs < 1:
            raise DeepfuseError(f"max_num_tokens and max_num_seqs must be >= 1, got {self.max_num_tokens}, "
                                f"{self.max_num_seqs}")


@dataclass
class Checkpoint:
    """What a step may change, taken before it: the running requests with their table sizes (one per cache group),
    name counts and draft positions, and the prefix-cache counters."""

    running: list[tuple[Request, list[int], int, int]] = field(default_factory=list)
    prefix_queries: int = 0
    prefix_hits: int = 0
    replay_hits: int = 0
    replayed_tokens: int = 0


class Scheduler:
    def __init__(self, kv: KVCacheManager, config: SchedulerConfig):
        self.kv, self.config = kv, config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """The step's (request, number of new tokens) pairs, with KV blocks allocated."""
        budget, out, preempted = self.config.max_num_tokens, [], False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.remaining + (len(req.draft) if req.remaining == 1 else 0), budget)
            while not self.kv.can_allocate(req.kv, req.computed + n) and self.running[-1] is not req:
                self._preempt(self.running[-1])
                preempted = True
            if not self.kv.can_allocate(req.kv, req.computed + n):
                self._preempt(req)  # alone and still no room: wait until others finish
                preempted = True
                break
            self.kv.allocate(req.kv, req.tokens, req.computed + n)
            out.append((req, n))
            budget -= n
            i += 1
        while (not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            # prompt logprobs need every prompt row computed: no prefix from the cache for them
            req.kv = blocks = self.kv.new_seq(req.tokens) if req.needs_prompt_rows else self.kv.match_prefix(req.tokens)
            cached = blocks.cached
            n = min(len(req.tokens) - cached, budget)
            if not self.kv.can_allocate(blocks, cached + n):
                self.kv.free(blocks)
                break
            self.kv.allocate(blocks, req.tokens, cached + n)
            if not req.num_preemptions:  # a readmission recomputes; count first admissions only
                self.kv.stats.prefix_queries += len(req.tokens)
                self.kv.stats.prefix_hits += cached
                if blocks.replay_end:
                    self.kv.stats.replay_hits += 1
                    self.kv.stats.replayed_tokens += blocks.replay_end - cached
                req.num_cached_tokens = cached
            req.computed = cached
            self.running.append(self.waiting.popleft())
            out.append((req, n))
            budget -= n
        if not out and self.waiting:
            need = self.kv.blocks_needed(self.waiting[0].kv, len(self.waiting[0].tokens))
            raise DeepfuseError(f"request {self.waiting[0].request_id} needs {need} KV blocks and only "
                                f"{self.kv.pool.num_available()} can be freed; raise num_blocks")
        return out

    def checkpoint(self) -> Checkpoint:
        """Taken before a step; rollback(checkpoint) undoes it."""
        st = self.kv.stats
        return Checkpoint([(r, [len(t) for t in r.kv.tables], len(r.kv.names), r.draft_computed) for r in self.running],
                          st.prefix_queries, st.prefix_hits, st.replay_hits, st.replayed_tokens)

    def rollback(self, cp: Checkpoint) -> None:
        """Undoes what scheduling (and drafting for) a step that then failed did (module docstring)."""
        before = {id(r) for r, *_ in cp.running}
        for req in reversed([r for r in self.running if id(r) not in before]):  # admitted for the step
            self.running.remove(req)
            self.kv.free(req.kv)
            req.computed = 0
            if not req.num_preemptions:  # a readmission keeps its first admission's count
                req.num_cached_tokens = 0
            self.waiting.appendleft(req)
        for req in self.waiting:  # interrupted while being admitted: its prefix's references
            self.kv.free(req.kv)
        for req, num_blocks, num_names, draft_computed in cp.running:
            if req in self.running:  # not preempted (a victim's blocks are already back)
                self.kv.truncate(req.kv, num_blocks, num_names)
                req.draft_computed = draft_computed
        self.kv.discard_pending()
        st = self.kv.stats
        st.prefix_queries, st.prefix_hits, st.replay_hits, st.replayed_tokens = (
            cp.prefix_queries, cp.prefix_hits, cp.replay_hits, cp.replayed_tokens)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.kv)
        req.computed = req.draft_computed = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request) -> None:
        """Removes a finished or aborted request and frees its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req.kv)
