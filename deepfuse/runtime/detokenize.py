"""Incremental detokenization: the text of a growing list of token ids, decoding only the last
few tokens per step instead of the whole list (which made stop strings quadratic in the output).

The text so far is `tokenizer.decode(ids)` with the last tokens held back while they end in an
incomplete character (a multi-byte UTF-8 character split over tokens decodes to U+FFFD).
Each step decodes ids[prefix:] and ids[prefix:read], where `read` is where the text so far ends
and `prefix` where the previous step's new tokens began, and takes the difference: both decodes
start at the same token, so a decoder that treats a leading token specially (SentencePiece's
Metaspace strips a leading space) treats both alike, and the new tokens are decoded in context.
With byte fallback (<0xNN> tokens) a decoder turns a whole run of byte tokens into U+FFFD when
any of it is not UTF-8; text that came from a run's complete characters is kept here even if
the run later turns invalid (only random ids do that, not text spelled from a vocabulary).
Owns no tokenizer state; does not decide when a request stops (finish.py does).
"""
from __future__ import annotations

from collections.abc import Callable


class IncrementalText:
    """decode: token ids -> str, as Tokenizer.decode. `text` is the decoded text so far;
    add(ids) is called with the whole id list each time it grows and returns the new text."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode = decode
        self.text = ""
        self.prefix = 0  # first token of the context decoded with the new ones
        self.read = 0  # tokens whose text is in self.text

    def add(self, ids: list[int]) -> str:
        """The text that ids[read:] add to `text` ("" while it ends in an incomplete character)."""
        if len(ids) <= self.read:
            return ""
        new = self.decode(ids[self.prefix:])
        if new.endswith("\ufffd"):
            return ""
        delta = new[len(self.decode(ids[self.prefix:self.read])):] if self.read > self.prefix else new
        self.prefix, self.read = self.read, len(ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: list[str], searched: int) -> int:
    """The first index in text where one of `stops` starts, looking only at matches that end
    past text[:searched] (the text before was searched already), or -1."""
    hits = [i for i in (text.find(s, max(0, searched - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else -1
