"""OpenAI response bodies from RequestOutputs: whole responses, and the streamed chunks, which
carry only what each completion added since the last chunk (outputs are cumulative).

A choice's index is prompt * n + j (completions of several prompts); its finish_reason is
OpenAI's "stop" or "length" ("abort" only for a request the client left); vLLM's stop_reason
(the stop string or token id) rides along.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ..runtime.outputs import CompletionOutput, Logprob, RequestOutput


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(outs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    done = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def _alternatives(entry: dict[int, Logprob], k: int) -> list[tuple[str, float]]:
    """The top k of a logprob entry, by rank: (token text, logprob)."""
    ranked = sorted(entry.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)
    return [(lp.decoded_token or "", lp.logprob) for lp in ranked[:k]]


def completion_logprobs(c: CompletionOutput, start: int, k: int, offset: int) -> dict:
    """The legacy completions logprobs object of c's tokens from `start`; offset: the text
    length before them (text_offset counts from the start of the completion)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        text = entry[tok].decoded_token or ""
        tokens.append(text)
        lps.append(entry[tok].logprob)
        tops.append(dict(_alternatives(entry, k)) if k else None)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, start: int, k: int) -> dict:
    """The chat logprobs object ({"content": [...]}) of c's tokens from `start`."""
    content = []
    for tok, entry in zip(c.token_ids[start:], c.logprobs[start:]):
        text = entry[tok].decoded_token or ""
        content.append({"token": text, "logprob": entry[tok].logprob, "bytes": list(text.encode()),
                        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())}
                                         for t, v in _alternatives(entry, k)]})
    return {"content": content}


def completion_body(rid: str, model: str, outs: list[RequestOutput], k: int | None) -> dict:
    """POST /v1/completions' answer; outs: one finished output per prompt."""
    n = len(outs[0].outputs)
    choices = [{"index": i * n + c.index, "text": c.text,
                "logprobs": completion_logprobs(c, 0, k, 0) if k is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for i, o in enumerate(outs) for c in o.outputs]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage(outs)}


def chat_body(rid: str, model: str, out: RequestOutput, k: int | None) -> dict:
    """POST /v1/chat/completions' answer."""
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c, 0, k) if k is not None else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in out.outputs]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": usage([out])}


@dataclass
class Deltas:
    """What each choice has been sent so far: text characters and tokens."""

    text: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, int] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)

    def take(self, index: int, c: CompletionOutput) -> tuple[str, int] | None:
        """(the new text, the first new token) of a choice, or None when there is nothing to send
        (no new text and not finished, or finished and sent)."""
        if index in self.finished:
            return None
        sent, first = self.text.get(index, 0), self.tokens.get(index, 0)
        new = c.text[sent:]
        if not new and c.finish_reason is None:
            return None
        self.text[index], self.tokens[index] = len(c.text), len(c.token_ids)
        if c.finish_reason is not None:
            self.finished.add(index)
        return new, first


def completion_chunks(rid: str, model: str, created: int, prompt: int, out: RequestOutput, sent: Deltas,
                      k: int | None) -> list[dict]:
    """The chunks of a completions stream that `out` (of prompt number `prompt`) adds."""
    n, chunks = len(out.outputs), []
    for c in out.outputs:
        index = prompt * n + c.index
        before = sent.text.get(index, 0)
        got = sent.take(index, c)
        if got is None:
            continue
        text, first = got
        choice = {"index": index, "text": text,
                  "logprobs": completion_logprobs(c, first, k, before) if k is not None else None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        chunks.append({"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [choice]})
    return chunks


def chat_chunks(rid: str, model: str, created: int, out: RequestOutput, sent: Deltas, k: int | None) -> list[dict]:
    """The chunks of a chat stream that `out` adds (a choice's first chunk carries the role)."""
    chunks = []
    for c in out.outputs:
        opening = c.index not in sent.text
        got = sent.take(c.index, c)
        if got is None:
            continue
        text, first = got
        delta = {"role": "assistant", "content": text} if opening else {"content": text}
        choice = {"index": c.index, "delta": delta,
                  "logprobs": chat_logprobs(c, first, k) if k is not None else None,
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        chunks.append({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                       "choices": [choice]})
    return chunks


def usage_chunk(rid: str, model: str, created: int, obj: str, outs: list[RequestOutput]) -> dict:
    """The stream's last chunk under stream_options.include_usage: no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(outs)}
