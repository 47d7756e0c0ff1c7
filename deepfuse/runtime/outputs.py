"""What comes back from a request, in vLLM's shape: a RequestOutput per prompt holding one
CompletionOutput per completion (SamplingParams.n), each with its text, tokens, logprobs and
finish reason; the request's timings are in `metrics`.

    out = llm.generate(["Hi"], SamplingParams(n=2))[0]
    out.prompt, out.prompt_token_ids, out.finished, out.metrics.ttft_s
    out.outputs[1].text, out.outputs[1].token_ids, out.outputs[1].finish_reason

Every layer returns this one shape: Engine.step() and Engine.abort() a RequestOutput with one
completion (an engine request is one completion), Engine.generate, LLM and AsyncLLM one with all n.
Owns no engine state; builds outputs from a Request (request.py) and merges completions.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request
    from .spec import SpecStats


@dataclass
class Logprob:
    """vLLM's: the log-probability of a token, its rank in the distribution (1 = most likely)
    and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per position: {token id: Logprob} (the top k and the sampled or prompt token)
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's fields, then deepfuse's). finish_reason: "stop" (EOS,
    a stop token or a stop string), "length" (max_tokens), "abort", "error" (nothing ran; the
    RequestOutput's `error` says why), or None while it runs. stop_reason: the stop string or
    stop token id that ended it (None for EOS, length, abort). cumulative_logprob: the sum of
    the sampled tokens' logprobs (None unless logprobs were asked for). token_times[i]: seconds
    from the request's arrival until token i came."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_times: list[float] = field(default_factory=list, repr=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings of a request. arrival_time, first_token_time, last_token_time, finished_time:
    wall-clock time.time() stamps (vLLM's names; None where not reached). ttft_s: seconds from
    arrival to the first token of any completion; total_s: to the last; tpot_s: mean seconds per
    output token after each completion's first; spec: speculative decoding's drafts verified
    and accepted (None without speculation)."""

    arrival_time: float
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    ttft_s: float = 0.0
    total_s: float = 0.0
    tpot_s: float = 0.0
    num_preemptions: int = 0
    spec: SpecStats | None = None


@dataclass
class RequestOutput:
    """vLLM's RequestOutput, plus `error` (the ValueError of a request that could not run) and
    `metrics` with deepfuse's timings. prompt: the prompt's text (None where it was token ids);
    prompt_logprobs: None for the first prompt token, then one entry per token (when asked for);
    num_cached_tokens: prompt tokens served by the prefix cache (completion 0's)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: Exception | None = None


def completion_of(req: Request, text: str, decode: Callable[[list[int]], str] | None,
                  finish: str | None, index: int = 0) -> CompletionOutput:
    """The completion a Request holds so far (finish None while it runs). decode names the
    logprob entries' tokens."""
    lps = None
    if req.params.logprobs is not None:
        lps = name_tokens(req.logprobs, decode)
    cum = sum(e[t].logprob for t, e in zip(req.generated, lps)) if lps is not None else None
    return CompletionOutput(index, text, list(req.generated), cum, lps, finish,
                            req.stop_reason if finish == "stop" else None, list(req.token_times))


def request_output(req: Request, text: str, decode: Callable[[list[int]], str] | None, finish: str | None,
                   spec: SpecStats | None) -> RequestOutput:
    """The RequestOutput of one engine request (one completion), finished when finish is set."""
    comp = completion_of(req, text, decode, finish)
    plps = name_tokens(req.prompt_logprobs, decode) if req.params.prompt_logprobs is not None else None
    now, wall_now = time.perf_counter(), time.time()
    metrics = _metrics(wall_now - (now - req.arrival), [comp], now - req.arrival,
                       wall_now if finish is not None else None, req.num_preemptions, spec)
    return RequestOutput(req.request_id, None, list(req.prompt), plps, [comp], finish is not None, metrics,
                         req.num_cached_tokens)


def merge_completions(outs: list[RequestOutput], request_id: str | None = None) -> RequestOutput:
    """One RequestOutput for a prompt's n completions (each an engine request, outs[j] holding
    completion j): their CompletionOutputs indexed 0..n-1, metrics over all of them."""
    first = outs[0]
    comps = [CompletionOutput(**{**o.outputs[0].__dict__, "index": j}) for j, o in enumerate(outs)]
    finished = all(o.finished for o in outs)
    ms = [o.metrics for o in outs if o.metrics is not None]
    metrics = None
    if ms:
        metrics = _metrics(min(m.arrival_time for m in ms), comps, max(m.total_s for m in ms),
                           max(m.finished_time for m in ms) if finished else None,
                           sum(m.num_preemptions for m in ms), _merged_spec([m.spec for m in ms]))
    return RequestOutput(request_id or first.request_id, first.prompt, first.prompt_token_ids, first.prompt_logprobs,
                         comps, finished, metrics, first.num_cached_tokens, first.error)


def error_output(request_id: str, prompt: object, error: Exception, n: int = 1) -> RequestOutput:
    """The output of a request that could not run: n empty completions, finish_reason "error"."""
    ids = list(prompt) if isinstance(prompt, list) else []
    comps = [CompletionOutput(j, "", [], None, None, "error") for j in range(n)]
    return RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids, None, comps, True, None, 0, error)


def name_tokens(entries: list[dict[int, Logprob] | None], decode: Callable[[list[int]], str] | None) -> list:
    """Fills in each Logprob's decoded_token (once), returns entries."""
    if decode is not None:
        for e in entries:
            for t, lp in (e or {}).items():
                if lp.decoded_token is None:
                    lp.decoded_token = decode([t])
    return entries


def _metrics(wall_arrival: float, comps: list[CompletionOutput], total_s: float, finished_time: float | None,
             preemptions: int, spec: SpecStats | None) -> RequestMetrics:
    """wall_arrival: the request's arrival as a time.time() stamp; comps' token_times count from it."""
    firsts = [c.token_times[0] for c in comps if c.token_times]
    lasts = [c.token_times[-1] for c in comps if c.token_times]
    gaps = sum(len(c.token_times) - 1 for c in comps if c.token_times)
    span = sum(c.token_times[-1] - c.token_times[0] for c in comps if c.token_times)
    return RequestMetrics(wall_arrival, wall_arrival + min(firsts) if firsts else None,
                          wall_arrival + max(lasts) if lasts else None, finished_time,
                          min(firsts) if firsts else 0.0, total_s, span / gaps if gaps else 0.0, preemptions, spec)


def _merged_spec(stats: list[SpecStats | None]) -> SpecStats | None:
    """The sum of the completions' speculative decoding counts (None without speculation)."""
    got = [s for s in stats if s is not None]
    if not got:
        return None
    from .spec import SpecStats

    out = SpecStats(sum(s.verifications for s in got), sum(s.drafted for s in got), sum(s.accepted for s in got))
    out.recent_rate = sum(s.recent_rate for s in got) / len(got)
    return out
