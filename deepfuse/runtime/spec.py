"""Speculative decoding: drafters propose tokens, the target verifies them in its normal step.

A decoding request's chunk becomes [last token, d1..dk]; the step samples all k+1 rows
(step input sample_rows), each with the randomness of its own position. The engine keeps
d1..dj while d_i equals the target's token at row i-1, then appends the target's token at
row j: for a deterministic drafter this is exactly rejection sampling with a one-hot
proposal, so greedy and seeded sampled outputs are the tokens decoding without drafts
gives (the target draws position p's token with the same key either way). Rejected drafts'
KV slots are simply overwritten later: `computed` advances past accepted tokens only.

    engine = Engine(model, spec=SpecConfig(method="ngram", num_draft_tokens=5))

Confidence-scheduled verification (schedule="confidence", the default): each step, the
drafts to verify are chosen to maximise expected tokens per unit of step time. Draft i of
a sequence is expected to be accepted with the product of its drafter's confidences up to
i; the step's time comes from a latency model ((sequences, tokens) in the step -> ms)
measured when the engine starts, cached on disk, and corrected with every step's measured
time. Drafts are taken most-confident first; the prefix with the best ratio is verified.
schedule="fixed" verifies k each step.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ..errors import DeepfuseError
from .latency import LatencyModel

METHODS = ("ngram", "draft", "mtp")
SCHEDULES = ("confidence", "fixed")


@dataclass(frozen=True)
class SpecConfig:
    """method: "ngram" (prompt lookup, no extra weights), "draft" (a smaller compiled model
    over the same vocabulary, passed to the Engine as draft_model; LLM builds one from the
    target's first draft_layers layers) or "mtp" (the draft head file draft_head, trained on
    the target by `deepfuse train-drafter`; see mtp.py). num_draft_tokens: k, the most drafts
    verified per sequence and step. max_ngram/min_ngram: the suffix lengths looked up."""

    method: str = "ngram"
    num_draft_tokens: int = 5
    max_ngram: int = 4
    min_ngram: int = 1
    schedule: str = "confidence"
    draft_layers: int = 0
    draft_head: str = ""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise DeepfuseError(f"unknown schedule {self.schedule!r} (available: {', '.join(SCHEDULES)})")
        if self.method not in METHODS:
            raise DeepfuseError(f"unknown speculative method {self.method!r} (available: {', '.join(METHODS)})")
        if self.num_draft_tokens < 1:
            raise DeepfuseError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.method == "mtp" and not self.draft_head:
            raise DeepfuseError('speculative method "mtp" needs draft_head, a file from `deepfuse train-drafter`')
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise DeepfuseError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")


@dataclass
class Draft:
    tokens: list[int]
    confidence: list[float]  # per token, the drafter's estimate that the target agrees


class Drafter(ABC):
    """Proposes drafts for a batch of decoding requests (each with room for ks[i] tokens)."""

    @abstractmethod
    def propose_batch(self, requests: list, ks: list[int]) -> list[Draft]: ...

    def observe(self, request, drafted: int, accepted: int) -> None:
        """After a step that verified `drafted` of the request's last draft and kept the first
        `accepted` of them. Drafters that learn from outcomes (NgramDrafter) override it."""
        return None


AGREE_ONLY, AGREE_ALL, AGREE_SPLIT = 0, 1, 2  # NgramDrafter.lookup


class AcceptanceTally:
    """Counts, by draft position i, of drafts verified whose predecessors were all
    accepted (`tried`) and of those accepted (`hit`): hit[i] / tried[i] estimates the chance
    that draft i is accepted given drafts 0..i-1 were. A run of copied tokens is accepted
    together or not at all, so these conditional rates, not one rate raised to the i-th
    power, are what a draft's chance is built from."""

    def __init__(self, hit: list[float], tried: list[float]):
        self.hit, self.tried = list(hit), list(tried)

    def add(self, drafted: int, accepted: int) -> None:
        """One verification: `drafted` drafts verified, the first `accepted` of them kept."""
        for i in range(min(drafted, accepted + 1)):
            self.tried[i] += 1
            self.hit[i] += i < accepted


class NgramDrafter(Drafter):
    """Prompt lookup: the longest suffix of the sequence (max_ngram .. min_ngram tokens) that
    occurred earlier in it; the tokens that followed its latest earlier occurrence are the
    draft. Confidence, learned online from every verification of every request: the chance
    that draft i is accepted given drafts before it were, tallied per kind of draft, and the
    running product of these. A draft's kind: the length of the suffix it was found by (a
    longer one is likelier a copy), whether that suffix's other occurrences agree on the next
    token, disagree or do not exist, and how the request's last verification went (none yet,
    its first draft rejected, some accepted, all accepted: a request copying a passage keeps
    copying). Kinds are shared by all requests, so one whose drafts go unverified is not shut
    out: its kind's rate is still learned from the others'."""

    def __init__(self, config: SpecConfig):
        self.config = config
        self.tallies: dict[tuple[int, int, int], AcceptanceTally] = {}

    def tally(self, kind: tuple[int, int, int]) -> AcceptanceTally:
        t = self.tallies.get(kind)
        if t is None:  # prior: one first draft in two is accepted, four in five of the drafts
            # after an accepted one (copying runs on), worth two and five verifications
            rest = self.config.num_draft_tokens - 1
            t = self.tallies[kind] = AcceptanceTally([1.0] + [4.0] * rest, [2.0] + [5.0] * rest)
        return t

    def propose_batch(self, requests: list, ks: list[int]) -> list[Draft]:
        drafts = []
        for r, k in zip(requests, ks):
            follow, n, agree = self.lookup(r.tokens, k) if k > 0 else ([], 0, AGREE_ONLY)
            state = r.drafter_state = r.drafter_state or _NgramState()
            state.kind = (n, agree, state.last)
            drafts.append(Draft(follow, self.confidence(state.kind, len(follow))))
        return drafts

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int, int]:
        """The draft (at most k tokens), the length n of the suffix it was found by (0: none),
        and what the suffix's other earlier occurrences say of the draft's first token:
        AGREE_ONLY (there are none), AGREE_ALL (all were followed by it), AGREE_SPLIT (not all)."""
        n_max = min(self.config.max_ngram, len(tokens) - 1)
        for n in range(n_max, self.config.min_ngram - 1, -1):
            suffix = tokens[-n:]
            starts = [s for s in range(len(tokens) - n - 1, -1, -1) if tokens[s:s + n] == suffix]
            if starts:  # the latest earlier occurrence (its continuation exists: it ends before the suffix)
                follow = tokens[starts[0] + n:starts[0] + n + k]
                nexts = {tokens[s + n] for s in starts}
                return follow, n, AGREE_ONLY if len(starts) == 1 else AGREE_ALL if len(nexts) == 1 else AGREE_SPLIT
        return [], 0, AGREE_ONLY

    def confidence(self, kind: tuple[int, int, int], count: int) -> list[float]:
        """Running products of the conditional acceptance rates of positions 0..count-1."""
        t, out, c = self.tally(kind), [], 1.0
        for i in range(count):
            c *= t.hit[i] / t.tried[i]
            out.append(c)
        return out

    def observe(self, request, drafted: int, accepted: int) -> None:
        state = request.drafter_state
        if state is None or not state.kind[0] or not drafted:
            return
        self.tally(state.kind).add(drafted, accepted)
        state.last = LAST_ALL if accepted == drafted else LAST_SOME if accepted else LAST_REJECTED


LAST_NONE, LAST_REJECTED, LAST_SOME, LAST_ALL = 0, 1, 2, 3  # a request's last verification (_NgramState)


@dataclass
class _NgramState:
    """NgramDrafter's per-request state (Request.drafter_state)."""

    last: int = LAST_NONE  # how its last verification went
    kind: tuple[int, int, int] = (0, AGREE_ONLY, LAST_NONE)  # its last draft's (suffix length, AGREE_*, last)


class DraftGate:
    """Drafting costs work whether or not the drafts are verified: a request whose recent
    acceptance rate r makes the expected accepted tokens (r + r^2 + ... + r^k) worth less than
    k draft steps (each `cost` of a target step) is not drafted for, except every PROBE-th
    round, which measures r again."""

    PROBE = 8

    def __init__(self, cost: float):
        self.cost = cost
        self.skipped: dict[str, int] = {}  # request id -> rounds skipped in a row

    def worth_drafting(self, request, k: int) -> bool:
        r = request.spec.recent_rate
        if request.spec.verifications < 2 or sum(r ** j for j in range(1, k + 1)) > k * self.cost:
            self.skipped.pop(request.request_id, None)
            return True
        n = self.skipped.get(request.request_id, 0) + 1
        self.skipped[request.request_id] = n % self.PROBE
        return n % self.PROBE == 0


class ModelDrafter(Drafter):
    """Drafts greedily with a smaller compiled model over the target's vocabulary (the
    target's first N layers, say); a draft token's confidence is the running product of the
    draft model's probabilities for its tokens. Its KV cache has its own tensors but the
    target's block ids, so each request's block table serves both. Each round first runs
    the tokens the draft model has not seen (the prompt once, then the tokens accepted since),
    then k - 1 one-token steps; all requests of a round share its steps. Requests whose
    drafts do not pay are skipped (DraftGate; a draft step costs draft layers / target layers)."""

    def __init__(self, draft, kv, cache_config, max_num_tokens: int, max_num_seqs: int, max_blocks: int,
                 cost: float = 0.0):
        from ..ir import DTYPES
        from .batch import StepBuffers
        from .kv_cache import KVCache

        c = draft.config
        self.model, self.kv, self.budget, self.max_seqs = draft, kv, max_num_tokens, max_num_seqs
        kv = draft.kv_cache_type
        self.cache = KVCache(c.num_layers, c.num_kv_heads, kv.shape[4], DTYPES[kv.dtype], cache_config, draft.device)
        self.buffers = StepBuffers(max_num_tokens, max_num_seqs, max_blocks)
        self.gate = DraftGate(cost)  # one draft step in target steps (draft layers / target layers)

    def _run(self, chunks) -> tuple[list[int], list[float]]:
        """One draft-model step; each chunk's greedy next token and its probability."""
        import torch

        logits, nxt, _ = self.model(self.buffers.fill(chunks, self.cache))
        probs = torch.softmax(logits, -1).gather(1, nxt[:, None]).flatten()
        return nxt.tolist(), probs.tolist()

    def propose_batch(self, requests: list, ks: list[int]) -> list[Draft]:
        from .batch import SeqChunk

        drafts = [Draft([], []) for _ in requests]
        live = []
        for i, (r, k) in enumerate(zip(requests, ks)):
            end = len(r.tokens) + k - 1  # positions the draft steps write
            if k > 0 and self.gate.worth_drafting(r, k) and self.kv.can_allocate(r.kv, end):
                self.kv.reserve(r.kv, end)  # unnamed: the target's step names what it writes
                live.append(i)
        # a request not scheduled since its last round has nothing new: its last token runs again
        pending = {i: min(requests[i].draft_computed, len(requests[i].tokens) - 1) for i in live}
        while pending:  # catch up: the tokens the draft model has not seen, ending with the last one
            chunks, owners, budget = [], [], self.budget
            for i, start in pending.items():
                r = requests[i]
                n = min(len(r.tokens) - start, budget)
                if n <= 0 or len(chunks) == self.max_seqs:
                    break
                chunks.append(SeqChunk(r.tokens[start:start + n], start, r.kv.table))
                owners.append((i, start + n))
                budget -= n
            toks, probs = self._run(chunks)
            for (i, end), tok, p in zip(owners, toks, probs):
                if end == len(requests[i].tokens):
                    del pending[i]
                    drafts[i] = Draft([tok], [p])
                else:
                    pending[i] = end
        for i in live:
            requests[i].draft_computed = len(requests[i].tokens)
        for j in range(1, max((ks[i] for i in live), default=0)):
            more = [i for i in live if ks[i] > j]
            chunks = [SeqChunk([drafts[i].tokens[-1]], len(requests[i].tokens) + j - 1, requests[i].kv.table)
                      for i in more]
            toks, probs = self._run(chunks)
            for i, tok, p in zip(more, toks, probs):
                drafts[i].tokens.append(tok)
                drafts[i].confidence.append(drafts[i].confidence[-1] * p)
        return drafts



@dataclass
class SpecStats:
    """Per request (RequestOutput.spec) and overall (Engine.spec_stats)."""

    verifications: int = 0  # (sequence, step) pairs that verified at least one draft
    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    recent_rate: float = 0.5  # acceptance rate, exponentially weighted (half weight on the last verification)

    def add(self, drafted: int, accepted: int) -> None:
        self.verifications += 1
        self.drafted += drafted
        self.accepted += accepted
        self.recent_rate = 0.5 * self.recent_rate + 0.5 * accepted / drafted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying sequence gains per step: its accepted drafts + the target's own token."""
        return (self.accepted + self.verifications) / self.verifications if self.verifications else 0.0

    @property
    def verified_per_step(self) -> float:
        return self.drafted / self.verifications if self.verifications else 0.0


def choose_drafts(drafts: list[Draft], seqs: int, base_tokens: int, gain: float, latency: LatencyModel) -> list[int]:
    """How many of each sequence's drafts to verify. seqs, base_tokens: the step's sequences
    and tokens without drafts; gain: tokens the step yields without drafts (one per decoding
    sequence). Drafts are taken most likely first (a sequence's next draft is likely by the
    product of its confidences so far); of these prefixes, the one with the most expected
    tokens per ms of step time wins (the latency curve has steps, so not the first local best)."""
    counts = [0] * len(drafts)
    heap = [(-d.confidence[0], s) for s, d in enumerate(drafts) if d.tokens]
    heapq.heapify(heap)
    order, expected, tokens = [], gain, base_tokens
    best, best_len = expected / latency.predict(seqs, tokens), 0
    while heap:
        neg, s = heapq.heappop(heap)
        expected, tokens = expected - neg, tokens + 1
        order.append(s)
        counts[s] += 1
        ratio = expected / latency.predict(seqs, tokens)
        if ratio > best:
            best, best_len = ratio, len(order)
        d = drafts[s]
        if counts[s] < len(d.tokens):
            heapq.heappush(heap, (-d.confidence[counts[s]], s))
    counts = [0] * len(drafts)
    for s in order[:best_len]:
        counts[s] += 1
    return counts
