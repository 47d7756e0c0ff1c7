"""Engine: runs a list of requests to completion over a CompiledModel and a paged KV cache.

Each step packs prompt chunks and decode tokens of all admitted sequences into one
ragged batch (prefill and decode share the compiled step). Admission reserves each
request's worst case (prompt + max_tokens) in cache blocks, so a step never runs out.
"""
from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..codegen.artifact import CompiledModel
from ..errors import DeepfuseError
from ..ir import DTYPES
from .batch import SeqChunk, build_step
from .kv_cache import CacheConfig, KVCache


@dataclass
class SamplingParams:
    """vLLM's names. temperature 0 = greedy; top_k 0 = off; seed None = random."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise DeepfuseError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise DeepfuseError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DeepfuseError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise DeepfuseError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (eos / stop token) or "length"
    ttft_s: float = 0.0
    total_s: float = 0.0


@dataclass
class _Seq:
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    finish: str | None = None
    t_first: float = 0.0


class Engine:
    def __init__(self, model: CompiledModel, cache: CacheConfig | None = None, max_num_tokens: int = 2048):
        self.model, self.max_num_tokens = model, max_num_tokens
        c = model.config
        self.cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, DTYPES[model.dtype], cache or CacheConfig())
        self.max_model_len = min(c.max_position, self.cache.config.num_blocks * self.cache.block_size)
        self.eos = set(model.tokenizer.eos_ids) if model.tokenizer else set()

    def _check(self, prompt: list[int], p: SamplingParams) -> None:
        p.validate()
        if not prompt:
            raise DeepfuseError("prompt is empty")
        if len(prompt) + p.max_tokens > self.max_model_len:
            raise DeepfuseError(f"prompt of {len(prompt)} tokens + max_tokens {p.max_tokens} exceeds the context "
                                f"of {self.max_model_len} tokens; shorten the prompt or lower max_tokens")
        if any(not 0 <= t < self.model.config.vocab_size for t in prompt):
            raise DeepfuseError(f"prompt has token ids outside the vocabulary [0, {self.model.config.vocab_size})")

    def _blocks_needed(self, s: _Seq) -> int:
        return math.ceil((len(s.prompt) + s.params.max_tokens) / self.cache.block_size)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None) -> list[RequestOutput]:
        """Runs every request to completion; on_token(request index, token id) streams."""
        for prompt, p in zip(prompts, params):
            self._check(prompt, p)
        seqs = [_Seq(i, list(pr), p, p.seed if p.seed is not None else random.getrandbits(62), list(pr))
                for i, (pr, p) in enumerate(zip(prompts, params))]
        waiting, running, t0 = list(seqs), [], time.perf_counter()
        reserved = 0
        while waiting or running:
            while waiting and reserved + self._blocks_needed(waiting[0]) <= self.cache.config.num_blocks:
                reserved += self._blocks_needed(waiting[0])
                running.append(waiting.pop(0))
            if not running:
                raise DeepfuseError(f"a request needs {self._blocks_needed(waiting[0])} KV blocks, the cache has "
                                    f"{self.cache.config.num_blocks}; raise num_blocks")
            self._step(running, on_token, t0)
            for s in [s for s in running if s.finish]:
                running.remove(s)
                reserved -= self._blocks_needed(s)
                self.cache.allocator.release(s.blocks)
                s.blocks = []
        total = time.perf_counter() - t0
        tok = self.model.tokenizer
        return [RequestOutput(s.prompt, s.generated, tok.decode(s.generated) if tok else "", s.finish or "length",
                              s.t_first, total) for s in seqs]

    def _step(self, running: list[_Seq], on_token, t0: float) -> None:
        budget, batch = self.max_num_tokens, []
        for s in running:
            n = min(len(s.tokens) - s.computed, budget)
            if n <= 0:
                break
            p = s.params
            batch.append((s, SeqChunk(s.tokens[s.computed:s.computed + n], s.computed, s.blocks,
                                      float(p.temperature), p.top_k, p.top_p, s.seed)))
            budget -= n
        inputs = build_step([c for _, c in batch], self.cache)
        _, next_tokens = self.model(inputs)
        for (s, chunk), tok in zip(batch, next_tokens.tolist()):
            s.computed += len(chunk.tokens)
            if s.computed < len(s.tokens):
                continue  # mid-prompt chunk: its sample is not a real token
            if not s.generated:
                s.t_first = time.perf_counter() - t0
            s.tokens.append(tok)
            s.generated.append(tok)
            if on_token:
                on_token(s.index, tok)
            stops = set(s.params.stop_token_ids) | (set() if s.params.ignore_eos else self.eos)
            if tok in stops:
                s.finish = "stop"
            elif len(s.generated) >= s.params.max_tokens:
                s.finish = "length"


@torch.inference_mode()
def greedy(model: CompiledModel, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy continuation of one prompt (ignores EOS): a convenience for tests and benchmarks."""
    out = Engine(model).generate([prompt], [SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)])
    return out[0].token_ids
