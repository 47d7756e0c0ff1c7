"""Requests: what a user asks for (SamplingParams) and what the engine tracks (Request).
What comes back is outputs.py's RequestOutput."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..errors import DeepfuseError
from .detokenize import IncrementalText
from .kv_cache import SeqBlocks
from .spec import SpecStats
from .structured import StructuredOutputsParams

if TYPE_CHECKING:
    from .host_sampling import TokenCounts
    from .outputs import Logprob
    from .structured import Matcher


@dataclass
class SamplingParams:
    """vLLM's names. temperature 0 = greedy (exact argmax); top_k 0 = off; max_tokens None = as
    many as the context holds (max_model_len minus the prompt); seed None = random; stop:
    strings that end the text (not in it unless include_stop_str_in_output: then the first
    listed of those found where the match starts ends it); logprobs: how many top
    log-probabilities to return per generated token (None = none; of the model's own logits,
    before any of the settings below); prompt_logprobs: the same for each prompt token (None for
    the first; the prompt is then computed in full, not served by the prefix cache).
    repetition_penalty (1 = off), presence_penalty and frequency_penalty (0 = off) and
    min_tokens (before it, no EOS, stop id or stop string ends the request); n: completions of the
    prompt (generate(); completion j > 0 is keyed by a seed derived from (seed, j), so completion 0
    equals the n = 1 run; the prompt's full blocks are computed once, in the prefix cache); min_p (0 = off): a
    token less likely than min_p times the most likely one is not drawn; logit_bias {token id: added
    to its logit}; allowed_token_ids: only these may be drawn. These are applied on the host:
    host_sampling.py. structured_outputs: a StructuredOutputsParams (or its fields as a dict)
    that the output must follow (structured.py; also drawn on the host). Invalid values raise
    DeepfuseError (a ValueError) naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    min_p: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raises for an invalid value; first takes vLLM's other spellings: a stop string alone,
        None for no stops, tuples for lists, top_k -1 for off."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            if getattr(self, name) is None:
                setattr(self, name, [])
        for name in ("stop", "stop_token_ids", "allowed_token_ids"):
            if isinstance(getattr(self, name), tuple):
                setattr(self, name, list(getattr(self, name)))
        if self.top_k == -1 and not isinstance(self.top_k, bool):
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if not (isinstance(self.n, int) and not isinstance(self.n, bool) and self.n >= 1):
            raise DeepfuseError(f"n must be an int >= 1, got {self.n!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise DeepfuseError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise DeepfuseError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise DeepfuseError(f"top_k must be an int >= 0 (0 or -1 disables it), got {self.top_k!r}")
        m = self.max_tokens
        if m is not None and not (isinstance(m, int) and not isinstance(m, bool) and m >= 1):
            raise DeepfuseError(f"max_tokens must be an int >= 1 or None (up to the context), got {m!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise DeepfuseError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise DeepfuseError(f"include_stop_str_in_output must be a bool, got {self.include_stop_str_in_output!r}")
        if not isinstance(self.stop, list) or any(not isinstance(s, str) or not s for s in self.stop):
            raise DeepfuseError(f"stop must be non-empty strings, got {self.stop!r}")
        if not (isinstance(self.stop_token_ids, list) and all(_is_id(t) for t in self.stop_token_ids)):
            raise DeepfuseError(f"stop_token_ids must be a list of token ids (ints >= 0), got {self.stop_token_ids!r}")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20):
            raise DeepfuseError(f"logprobs must be None or an int in [0, 20], got {self.logprobs!r}")
        pl = self.prompt_logprobs
        if pl is not None and not (isinstance(pl, int) and not isinstance(pl, bool) and 0 <= pl <= 20):
            raise DeepfuseError(f"prompt_logprobs must be None or an int in [0, 20], got {pl!r}")
        r = self.repetition_penalty
        if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0):
            raise DeepfuseError(f"repetition_penalty must be a finite number > 0 (1 disables it), got {r!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and -2 <= v <= 2):
                raise DeepfuseError(f"{name} must be a number in [-2, 2] (0 disables it), got {v!r}")
        if not (isinstance(self.min_tokens, int) and 0 <= self.min_tokens and (m is None or self.min_tokens <= m)):
            raise DeepfuseError(f"min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}")
        if not (isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1):
            raise DeepfuseError(f"min_p must be a number in [0, 1] (0 disables it), got {self.min_p!r}")
        b = self.logit_bias
        if b is not None and not (isinstance(b, dict) and all(_is_id(t) for t in b) and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in b.values())):
            raise DeepfuseError(f"logit_bias must be a dict of token id (int >= 0) to a finite number, got {b!r}")
        a = self.allowed_token_ids
        if a is not None and not (isinstance(a, list) and a and all(_is_id(t) for t in a)):
            raise DeepfuseError(f"allowed_token_ids must be a non-empty list of token ids (ints >= 0), got {a!r}")
        s = self.structured_outputs
        if s is not None and not isinstance(s, StructuredOutputsParams):
            raise DeepfuseError(f"structured_outputs must be a StructuredOutputsParams or None, got {type(s).__name__}")
        if s is not None and self.min_tokens:
            raise DeepfuseError("min_tokens cannot be combined with structured_outputs (the grammar decides where "
                                "the output may end)")


def completion_seed(seed: int, j: int) -> int:
    """The RNG seed of completion j of a request seeded `seed` (SamplingParams.n): seed itself
    for j = 0, else 62 bits of a hash of (seed, j)."""
    if j == 0:
        return seed
    return int.from_bytes(hashlib.blake2b(f"{seed}:{j}".encode(), digest_size=8).digest(), "little") >> 2


def _is_id(t: object) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


@dataclass
class Request:
    """Engine-side state of one request. tokens = prompt + generated; `computed` of them
    have their KV in the cache."""

    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    kv: SeqBlocks = field(default_factory=SeqBlocks)
    generated: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)  # [None, then one per prompt token]

    @property
    def needs_prompt_rows(self) -> bool:
        """Whether its prompt chunks must return every row's logits (prompt logprobs not all taken)."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt)
    detok: IncrementalText | None = None  # the text so far, where the request has stop strings
    counts: TokenCounts | None = None  # output counts for penalties (host_sampling.py), made when first needed
    stop_text: str | None = None  # the text up to the stop string that ended the request
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it (not EOS)
    finish: str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    draft: list[int] = field(default_factory=list)  # draft tokens to verify in the next step
    draft_computed: int = 0  # tokens whose KV a draft model (spec.ModelDrafter) has in its cache
    drafter_state: object = None  # the drafter's own record of this request (spec.NgramDrafter)
    spec: SpecStats = field(default_factory=SpecStats)
    matcher: Matcher | None = None  # its place in its grammar (structured outputs)
    hidden: torch.Tensor | None = None  # [D] f32, the target's hidden state that sampled tokens[-1] (MTP drafting)

    @property
    def remaining(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return len(self.tokens) - self.computed
