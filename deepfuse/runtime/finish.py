"""A request's new token and its stop conditions: take_token appends a sampled token to a
request (its tokens, times, counts, logprobs, grammar) and sets req.finish when it ends the
request: "stop" (a stop id, EOS unless ignore_eos, a stop string in the text so far, a grammar
completed), "abort" (a token the grammar refused) or "length" (max_tokens).

Owns no engine state: the engine passes its EOS ids and tokenizer (None: no stop strings).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .detokenize import IncrementalText, find_stop

if TYPE_CHECKING:
    from .request import Request


def take_token(req: Request, tok: int, now: float, logprobs: dict | None, eos: set[int], tokenizer) -> None:
    """Appends tok (drawn at time `now`, with its logprobs entry where the request asks for
    logprobs) to req, then sets req.finish (and stop_reason, stop_text) if tok ends it."""
    p = req.params
    req.tokens.append(tok)
    req.generated.append(tok)
    req.token_times.append(now - req.arrival)
    if req.counts is not None:
        req.counts.add(tok)
    if p.logprobs is not None:
        req.logprobs.append(logprobs)
    if req.matcher is not None:  # structured outputs: the drawn token is one the grammar allowed
        if not req.matcher.accept(tok):
            req.finish = "abort"
            return
        if req.matcher.done:  # complete, its stop token taken
            req.finish = "stop"
            return
    stoppable = len(req.generated) >= p.min_tokens
    if stoppable and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos)):
        req.finish = "stop"
        req.stop_reason = tok if tok in p.stop_token_ids else None
    elif p.stop and tokenizer is not None:  # the new tokens' text only (detokenize.py)
        if req.detok is None:
            req.detok = IncrementalText(tokenizer.decode)
        searched = len(req.detok.text)
        if req.detok.add(req.generated) and stoppable:
            at = find_stop(req.detok.text, p.stop, searched)
            if at >= 0:
                stop = next(s for s in p.stop if req.detok.text.startswith(s, at))
                if p.include_stop_str_in_output:
                    at += len(stop)
                req.stop_text, req.finish, req.stop_reason = req.detok.text[:at], "stop", stop
    if req.finish is None and len(req.generated) >= p.max_tokens:
        req.finish = "length"
