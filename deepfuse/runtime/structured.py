"""Structured outputs: a request's tokens kept to a JSON schema, any JSON object, a regex, a
choice of strings or an EBNF grammar, through xgrammar.

    SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", ...}))

A constrained request is drawn on the host (host_sampling.py): before its draw, every token the
grammar forbids next is set to -inf in its row's logits; each token it takes advances its
matcher (finish.take_token), and once the grammar is complete the request stops. Under
speculative decoding its drafts are cut before the first token the grammar forbids (those are
never verified), and each verified row is masked by the matcher's state after the drafts before
it, which the matcher reaches by accepting them and leaves by rolling them back
(host_sampling.verify_on_host). Grammars are compiled once per engine and cached by their spec.
Owns the matchers; does not schedule, stop or draw (the engine and host_sampling.py do).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from ..errors import DeepfuseError


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's: exactly one of json (a JSON schema, as a dict or its text), regex, choice (the
    output is one of these strings), grammar (EBNF, xgrammar's dialect, `root ::= ...`) or
    json_object (any JSON object)."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise DeepfuseError(f"structured_outputs takes exactly one of json, regex, choice, grammar, json_object; "
                                f"got {given or 'none'}")
        if self.choice is not None and not (isinstance(self.choice, (list, tuple)) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            raise DeepfuseError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got "
                                f"{self.choice!r:.80}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, str) and v):
                raise DeepfuseError(f"structured_outputs.{name} must be a non-empty string, got {v!r:.80}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise DeepfuseError(f"structured_outputs.json must be a JSON schema (a dict or its text), got {self.json!r:.80}")

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): what the compiled grammar is cached by."""
        if self.json is not None:
            schema = self.json if isinstance(self.json, dict) else _parse_schema(self.json)
            return "json", json.dumps(schema)  # key order kept: it is the order properties are generated in
        if self.choice is not None:
            return "regex", "|".join(_regex_escape(c) for c in self.choice)
        if self.regex is not None:
            return "regex", self.regex
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


def _parse_schema(text: str) -> dict:
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise DeepfuseError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise DeepfuseError("structured_outputs.json must be a JSON schema object")
    return schema


def _regex_escape(s: str) -> str:
    """s as a regex matching itself (xgrammar's regex dialect: escape every metacharacter)."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}" else ch for ch in s)


class Grammars:
    """The compiled grammars of one model's tokenizer: xgrammar's compiler and a cache by spec.
    vocab_size: the model's (the logits' width; may exceed the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int):
        try:
            import xgrammar as xgr
        except ImportError:
            raise DeepfuseError("structured outputs need xgrammar: pip install -e '.[structured]'") from None
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=tokenizer.eos_ids)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.cache: dict[tuple[str, str], object] = {}
        self.vocab_size = vocab_size

    def compile(self, p: StructuredOutputsParams):
        """The compiled grammar of p (cached); DeepfuseError naming what xgrammar refused."""
        key = p.key()
        if key not in self.cache:
            kind, text = key
            try:
                if kind == "json":
                    grammar = self.compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "regex":
                    grammar = self.compiler.compile_regex(text)
                elif kind == "grammar":
                    grammar = self.compiler.compile_grammar(text)
                else:  # any JSON object
                    grammar = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            except RuntimeError as e:
                detail = str(e).strip().splitlines()[0]
                raise DeepfuseError(f"structured_outputs ({kind}) cannot be compiled: {detail.split(': ', 1)[-1]}") from None
            self.cache[key] = grammar
        return self.cache[key]

    def matcher(self, p: StructuredOutputsParams) -> Matcher:
        return Matcher(self, self.xgr.GrammarMatcher(self.compile(p)))


class Matcher:
    """One request's place in its grammar."""

    def __init__(self, grammars: Grammars, matcher):
        self.xgr, self.matcher = grammars.xgr, matcher
        self.bitmask = grammars.xgr.allocate_token_bitmask(1, grammars.vocab_size)

    def mask(self, logits: torch.Tensor) -> None:
        """Sets logits [V] f32 (on the host) to -inf where the grammar forbids the next token."""
        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        self.xgr.apply_token_bitmask_inplace(logits[None], self.bitmask)

    def accept(self, token: int) -> bool:
        """Advances past token; False if the grammar does not allow it (then nothing changes)."""
        return self.matcher.accept_token(token)

    def rollback(self, count: int) -> None:
        """Undoes the last count accepted tokens."""
        if count:
            self.matcher.rollback(count)

    def allowed_prefix(self, tokens: list[int]) -> int:
        """How many of tokens, in order, the grammar allows from here (up to and including one that
        completes it); the matcher is left as it was."""
        n = 0
        for t in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            n += 1
        self.rollback(n)
        return n

    @property
    def done(self) -> bool:
        """The grammar is complete and its stop token taken: nothing may follow."""
        return self.matcher.is_terminated()
