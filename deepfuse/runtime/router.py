"""Which replica runs a request: the one whose prefix cache holds the longest start of its prompt,
by the engines' own block names (block_pool.block_hash chained over full blocks), else the least
loaded. Round-robin is the baseline policy. Pure bookkeeping, no processes: replicas.py feeds it.

    router = PrefixRouter(2, block_size=16)
    names = prompt_block_names(ids, 16)
    r = router.route(names)           # a replica index
    router.started(r, "req-1", names)
    ...                               # the request runs on replica r
    router.finished(r, "req-1")
    router.report(r, seq, cached)     # what replica r's cache held (seq orders its reports)

What the router believes replica r caches is the union of
- the names r last reported (its pool's committed names, sent with each finished request and
  ordered by a per-replica sequence number, so a late report never overwrites a newer one), and
- the names of the prompts routed to r that have not finished yet (their blocks are being
  written or are about to be; a request admitted in the same step as another with its prefix
  shares the other's pending blocks).
So an eviction is seen at the replica's next report; between reports the router may still
send a request to a replica that has just evicted its prefix (it then recomputes it).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..errors import DeepfuseError
from .block_pool import block_hash

POLICIES = ("prefix", "round_robin")


def prompt_block_names(tokens: list[int], block_size: int) -> list[bytes]:
    """The names of the full blocks a replica's prefix cache could serve for this prompt: the
    hash chain over its blocks, the last token left out (an engine always computes it), as
    KVCacheManager.match_prefix names them."""
    names, parent = [], b""
    for i in range((len(tokens) - 1) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        names.append(parent)
    return names


@dataclass
class _Replica:
    reported: frozenset[bytes] = frozenset()
    seq: int = -1  # the sequence number of the report held
    inflight: dict[str, list[bytes]] = field(default_factory=dict)  # request id -> its prompt's names
    pending: Counter = field(default_factory=Counter)  # name -> in-flight prompts that have it
    alive: bool = True

    def holds(self, name: bytes) -> bool:
        return name in self.reported or name in self.pending


class PrefixRouter:
    """policy "prefix": the live replica with the longest cached prefix of the prompt (ties: the
    least loaded), unless it has more than `max_imbalance` requests in flight beyond the least
    loaded live replica, or no replica holds any block of the prompt: then the least loaded (ties
    taken in turn). "round_robin": live replicas in turn. Load is the number of requests routed
    to a replica that have not finished."""

    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix", max_imbalance: int = 8):
        if num_replicas < 1:
            raise DeepfuseError(f"a router needs at least 1 replica, got {num_replicas}")
        if policy not in POLICIES:
            raise DeepfuseError(f"routing policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        if block_size < 1 or max_imbalance < 0:
            raise DeepfuseError("block_size must be >= 1 and max_imbalance >= 0")
        self.block_size, self.policy, self.max_imbalance = block_size, policy, max_imbalance
        self.replicas = [_Replica() for _ in range(num_replicas)]
        self._turn = 0

    def load(self, r: int) -> int:
        return len(self.replicas[r].inflight)

    def matched(self, r: int, names: list[bytes]) -> int:
        """How many leading blocks of the prompt replica r is believed to hold."""
        rep = self.replicas[r]
        return next((i for i, n in enumerate(names) if not rep.holds(n)), len(names))

    def live(self) -> list[int]:
        return [r for r, rep in enumerate(self.replicas) if rep.alive]

    def route(self, names: list[bytes]) -> int:
        """The replica for a prompt with these block names (prompt_block_names)."""
        live = self.live()
        if not live:
            raise DeepfuseError("no replica is alive to take the request")
        if self.policy == "round_robin":
            return self._in_turn(live)
        least = min(self.load(r) for r in live)
        match = {r: self.matched(r, names) for r in live}
        best = max(match.values())
        if best > 0:
            r = min((r for r in live if match[r] == best), key=self.load)
            if self.load(r) <= least + self.max_imbalance:
                return r
        return self._in_turn([r for r in live if self.load(r) == least])

    def _in_turn(self, candidates: list[int]) -> int:
        """The first candidate at or after the turn pointer (cyclic), and the pointer moves past it."""
        n = len(self.replicas)
        r = min(candidates, key=lambda c: (c - self._turn) % n)
        self._turn = (r + 1) % n
        return r

    def started(self, r: int, request_id: str, names: list[bytes]) -> None:
        """Request request_id (with its prompt's block names) now runs on replica r."""
        rep = self.replicas[r]
        if request_id in rep.inflight:
            raise DeepfuseError(f"request id {request_id!r} is already running on replica {r}")
        rep.inflight[request_id] = names
        rep.pending.update(names)

    def finished(self, r: int, request_id: str) -> None:
        """Request request_id has ended on replica r (finished, aborted or failed)."""
        rep = self.replicas[r]
        names = rep.inflight.pop(request_id, None)
        if names is not None:
            rep.pending.subtract(names)
            for n in names:
                if rep.pending.get(n, 0) <= 0:
                    rep.pending.pop(n, None)

    def report(self, r: int, seq: int, cached: frozenset[bytes]) -> None:
        """Replica r's pool held exactly `cached` at its report number seq; older reports are ignored."""
        rep = self.replicas[r]
        if seq > rep.seq:
            rep.seq, rep.reported = seq, frozenset(cached)

    def mark_dead(self, r: int) -> None:
        """Replica r failed: no request is routed to it again."""
        rep = self.replicas[r]
        rep.alive, rep.reported = False, frozenset()
        rep.inflight.clear()
        rep.pending.clear()
