"""Engine: requests in, tokens out, over a CompiledModel, a paged KV cache and a scheduler.

    eng = Engine(model)
    eng.add_request(prompt_ids, SamplingParams(...))   # any time, also between steps
    while eng.has_unfinished():
        finished = eng.step()                           # one compiled step for every scheduled token

Each step packs prompt chunks and decode tokens of all scheduled requests into one ragged
batch (prefill and decode share the compiled step); see scheduler.py for the policy. With
`spec=SpecConfig(...)`, a decoding request's chunk also carries draft tokens that the same
step verifies (see spec.py).
With `overlap=True` a plain decode step is launched before the step ahead of it is read,
its tokens fed on the device (overlap.py).
`generate()` runs a list of requests to completion; a request that is invalid comes back
with finish_reason "error" and the others still run. Outputs are outputs.py's RequestOutput
(vLLM's shape): step() and abort() give one per finished engine request, with its one
completion; generate() one per prompt, with its n completions.
"""
from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
from tqdm import tqdm

from ..codegen.artifact import CompiledModel
from ..errors import DeepfuseError
from ..inference_mode import inference_mode
from ..ir import DTYPES
from ..models.cache_groups import CacheGroup, cache_groups
from .batch import SeqChunk, StepBuffers
from .decode_burst import burst_steps, run_burst
from .drafting import make_drafter, set_drafts
from .finish import take_token
from .graphed_decode import GraphedDecode
from .host_sampling import RowBuffer, draw_on_host, needs_host_sampling
from .kv_cache import CacheConfig, KVCache, KVCacheManager
from .kv_store import DiskKVStore, model_fingerprint
from .latency import measure_latency
from .logprobs import RowLogprobs, logprob_rows, take_prompt_logprobs
from .outputs import RequestOutput, error_output, merge_completions, request_output
from .overlap import OverlapLoop
from .request import Request, SamplingParams, completion_seed
from .scheduler import Scheduler, SchedulerConfig
from .spec import SpecConfig, SpecStats
from .structured import Grammars

__all__ = ["Engine", "EngineStats", "RequestOutput", "SamplingParams"]


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens_computed: int = 0  # prompt positions whose KV was computed (not served by the prefix cache)
    tokens_computed: int = 0
    tokens_generated: int = 0
    ahead_steps: int = 0  # steps launched before the step ahead of them was read (overlap.py), then read
    burst_steps: int = 0  # decode steps run in a burst after its first (decode_burst.py)


def sliding_blocks(cache: CacheConfig, groups: list[CacheGroup], max_num_tokens: int, max_num_seqs: int) -> int:
    """A hybrid model's sliding-group block count: cache.sliding_blocks, or enough for max_num_seqs
    windows of ceil(W/BS) + 1 blocks plus one step's chunk, and never more than num_blocks (0: one group)."""
    if len(groups) < 2:
        return 0
    if cache.sliding_blocks:
        return cache.sliding_blocks
    bs = cache.block_size
    window = max_num_seqs * (-(-groups[1].window // bs) + 2) + -(-max_num_tokens // bs)
    return min(cache.num_blocks, window)


class StepRun(NamedTuple):
    """What one step computed, before the requests take it."""

    scheduled: list[tuple[Request, int]]
    chunks: list[SeqChunk]
    logits: torch.Tensor  # [R, V] the sampled rows'
    sampled: list[int]  # [R] the step's tokens (-1 after a rejected draft)
    drawn: dict[int, int]  # sampled row -> token drawn on the host
    logprobs: RowLogprobs
    hidden: torch.Tensor | None
    time: float
    burst: list[list[int]] | None = None  # a decode burst's tokens, per scheduled request (decode_burst.py)


class Launched(NamedTuple):
    """A step whose kernels are launched and whose tokens are not read yet. inputs and outputs
    (logits [R, V], next_tokens [R], hidden) are valid until the next step is launched."""

    scheduled: list[tuple[Request, int]]
    chunks: list[SeqChunk]
    host: list[bool]  # each chunk's token drawn by host_sampling.py
    inputs: dict[str, torch.Tensor]
    outputs: list[torch.Tensor]
    steps: int = 1  # decode steps it runs before its tokens are taken (decode_burst.py)


class Engine:
    def __init__(self, model: CompiledModel, cache: CacheConfig | None = None, max_num_tokens: int = 512,
                 max_num_seqs: int = 64, spec: SpecConfig | None = None, draft_model: CompiledModel | None = None,
                 cuda_graphs: bool | None = None, overlap: bool = False, decode_steps: int = 1):
        """cuda_graphs: run plain decode steps in padded batch buckets over static inputs
        (graphed_decode.py), captured as CUDA graphs where the model runs on a CUDA GPU. None:
        on exactly there; True elsewhere runs the same buckets without capture (the CPU tests).
        overlap: launch each plain decode step before reading the step ahead of it, its tokens
        fed on the device (overlap.py: which steps, and what runs synchronously); the same
        outputs. Off by default on every target (docs/targets.md says why).
        decode_steps: plain decode steps run per scheduling round before the host takes their
        tokens (decode_burst.py: which steps burst); the same outputs, tokens given out
        decode_steps at a time. 1: every step is taken as it ends."""
        if not isinstance(decode_steps, int) or decode_steps < 1:
            raise DeepfuseError(f"decode_steps must be an integer >= 1, got {decode_steps!r}")
        if decode_steps > 1 and overlap:
            raise DeepfuseError("decode_steps > 1 and overlap are two ways of running ahead of the host: choose one")
        self.model = model
        c = model.config
        kv = model.kv_cache_type
        cache = cache or CacheConfig()
        groups = cache_groups(c)
        graphed = model.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.cache = KVCache(c.num_layers, c.num_kv_heads, kv.shape[4], DTYPES[kv.dtype], cache, model.device, groups,
                             sliding_blocks(cache, groups, max_num_tokens, max_num_seqs), scratch=graphed)
        store = None
        if cache.kv_store is not None:
            store = DiskKVStore(cache.kv_store, int(cache.kv_store_gb * 2 ** 30), model_fingerprint(model, cache.block_size))
        self.kv = KVCacheManager(self.cache, exact_replay=getattr(c, "swa_replay_exact", False), store=store)
        self.scheduler = Scheduler(self.kv, SchedulerConfig(max_num_tokens, max_num_seqs))
        self.max_model_len = self._max_model_len(max_num_tokens)
        self.buffers = StepBuffers(max_num_tokens, max_num_seqs, -(-self.max_model_len // self.cache.block_size),
                                   incremental=True)
        self.graphed = GraphedDecode(model, self.cache, max_num_seqs, self.buffers.max_blocks) if graphed else None
        self.tokenizer = model.tokenizer
        self.eos = set(model.tokenizer.eos_ids) if model.tokenizer else set()
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.spec = spec
        self.drafter = make_drafter(spec, draft_model, model, self.kv, self.cache, self.scheduler,
                                    self.buffers.max_blocks) if spec else None
        self.spec_stats = SpecStats()
        self.latency = measure_latency(self) if spec and spec.schedule == "confidence" else None
        # keep Request.hidden, the hidden state that sampled each request's last token (MTP drafting, training)
        self.keep_hidden = bool(getattr(self.drafter, "needs_hidden", False))
        self._next_id = 0
        self._unreturned: list[RequestOutput] = []  # finished in a step whose on_token raised
        self.host_rows = RowBuffer()  # host_sampling.py's copy of its rows
        self.overlap = OverlapLoop(self) if overlap else None
        self.decode_steps = decode_steps

    def _max_model_len(self, budget: int) -> int:
        """The longest sequence (prompt + output) a request may ask for: the model's context,
        capped by the cache's tokens. Under a sliding window a sequence holds only its window's
        blocks and one step's chunk (at most ceil(W/BS) + ceil(budget/BS) + 2 blocks), so where
        the cache holds that many a lone request always fits, and the cache does not cap it."""
        c, bs, blocks = self.model.config, self.cache.block_size, self.cache.config.num_blocks
        if self.kv.window and blocks >= -(-self.kv.window // bs) + -(-budget // bs) + 2:
            return c.max_position
        return min(c.max_position, blocks * bs)

    # ---- requests -------------------------------------------------------------------------

    def check(self, prompt: list[int], params: SamplingParams) -> None:
        """Raises DeepfuseError (a ValueError) naming what is wrong with a request."""
        if not isinstance(params, SamplingParams):
            raise DeepfuseError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if not isinstance(prompt, list) or any(not isinstance(t, int) or isinstance(t, bool) for t in prompt):
            got = type(prompt).__name__ if not isinstance(prompt, list) else \
                f"a list holding {next(type(t).__name__ for t in prompt if not isinstance(t, int) or isinstance(t, bool))}"
            raise DeepfuseError(f"prompt must be token ids (a list of ints) or, for LLM, a string, {{'prompt': str}} "
                                f"or {{'prompt_token_ids': [int]}}; got {got}")
        if not prompt:
            raise DeepfuseError("prompt is empty")
        if params.max_tokens is None and len(prompt) >= self.max_model_len:
            raise DeepfuseError(f"prompt of {len(prompt)} tokens leaves no room to generate in the context "
                                f"(max_model_len {self.max_model_len}); shorten the prompt")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > self.max_model_len:
            raise DeepfuseError(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} exceeds "
                                f"the context (max_model_len {self.max_model_len}); shorten the prompt or lower max_tokens")
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise DeepfuseError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(t >= vocab for t in ids):
                raise DeepfuseError(f"{name} has token ids outside the vocabulary [0, {vocab})")
        if params.allowed_token_ids is not None and params.min_tokens and set(params.allowed_token_ids) <= self._stop_ids(params):
            raise DeepfuseError("allowed_token_ids holds only stop ids (EOS or stop_token_ids), so min_tokens "
                                "cannot be met")
        if params.structured_outputs is not None:
            self.grammars().compile(params.structured_outputs)  # cached: _add takes it from there

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queues a request; returns its id. Invalid requests raise and change nothing."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise DeepfuseError(f"n = {params.n} completions are generate()'s; here add one request per "
                                "completion, each with its own seed")
        return self._add(prompt, params, request_id).request_id

    def _add(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
             seed: int | None = None, queue: bool = True) -> Request:
        """The checked request, registered (and queued to the scheduler unless queue=False)."""
        prompt = list(prompt) if isinstance(prompt, (list, tuple)) else prompt  # the caller's list is not shared
        self.check(prompt, params)
        if params.max_tokens is None:  # as many as the context holds
            params = replace(params, max_tokens=self.max_model_len - len(prompt))
        if request_id is None:
            request_id = str(self._next_id)
            self._next_id += 1
        if request_id in self.requests:
            raise DeepfuseError(f"request id {request_id!r} is already in use")
        if seed is None:
            seed = params.seed if params.seed is not None else random.getrandbits(62)
        req = Request(request_id, prompt, params, seed, time.perf_counter(), list(prompt))
        if params.structured_outputs is not None:
            req.matcher = self.grammars().matcher(params.structured_outputs)
        self.requests[request_id] = req
        if queue:
            self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stops a queued or running request; returns its output (finish_reason "abort")."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        req.finish = "abort"
        self.scheduler.finish(req)
        return self._output(req)

    def add_prefilled(self, prompt: list[int], params: SamplingParams, first_token: int, kv_rows: torch.Tensor,
                      request_id: str | None = None, seed: int | None = None, logprobs: dict | None = None,
                      prompt_logprobs: list | None = None) -> str:
        """Takes over a request whose prompt another engine of the same model computed (prefill/decode
        disaggregation, disaggregated.py): kv_rows [L, 2, len(prompt), kv heads, row], the prompt's
        KV as KVCache.read_rows gives it; first_token, the token that engine sampled after the
        prompt (with its logprobs entry, {token id: Logprob}, and the prompt logprobs, where
        asked for). The request
        goes on from its second token, drawn with its seed's keys as here. Check
        can_take_prefilled first; a request that its first token ends comes back from the next
        step(). Returns its id; an invalid request raises and changes nothing."""
        if not self.can_take_prefilled(len(prompt)):
            raise DeepfuseError(f"no room for a prefilled request of {len(prompt)} tokens (sequences or KV blocks)")
        if isinstance(params, SamplingParams) and params.logprobs is not None and logprobs is None:
            raise DeepfuseError("the request asks for logprobs: pass its first token's entry ({token id: Logprob})")
        if tuple(kv_rows.shape[:3]) != (self.model.config.num_layers, 2, len(prompt)):
            raise DeepfuseError(f"kv_rows has shape {tuple(kv_rows.shape)}, not [{self.model.config.num_layers}, 2, "
                                f"{len(prompt)}, ...] for this model and prompt")
        req = self._add(prompt, params, request_id, seed, queue=False)
        rid, seq = req.request_id, self.kv.new_seq(req.tokens)
        try:
            self.kv.allocate(seq, req.tokens, len(prompt))
            self.cache.write_rows(seq.table, kv_rows)
        except BaseException:  # bad rows (or Ctrl-C): no request, no blocks
            self.kv.free(seq)
            self.kv.discard_pending()
            del self.requests[rid]
            raise
        self.kv.commit()  # its full blocks are written: later prompts may find them
        req.kv, req.computed, req.prompt_logprobs = seq, len(prompt), list(prompt_logprobs or [])
        self._append(req, first_token, time.perf_counter(), logprobs)
        if req.finish:
            self.kv.free(seq)
            del self.requests[rid]
            self._unreturned.append(self._output(req))
        else:
            self.scheduler.running.append(req)
        return rid

    def can_take_prefilled(self, num_tokens: int) -> bool:
        """Whether add_prefilled has room now for a prompt of num_tokens tokens (a sequence slot and
        the blocks for it and its next token)."""
        return (len(self.scheduler.running) < self.scheduler.config.max_num_seqs
                and self.kv.can_allocate(self.kv.new_seq([]), num_tokens + 1))

    def _retire(self, req: Request) -> None:
        """A request that finished in a step leaves the scheduler (its blocks freed) and the engine."""
        self.scheduler.finish(req)
        del self.requests[req.request_id]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._unreturned)

    # ---- steps ----------------------------------------------------------------------------

    @inference_mode
    def step(self, on_token: Callable[[str, int], None] | None = None) -> list[RequestOutput]:
        """Runs one step; returns the requests that finished in it. on_token(id, token) streams
        a request's new tokens once its state is updated (a finished one has left `requests`);
        it may abort any request (one not yet reached in this step gets no tokens in it).
        With overlap on, it launches the next step first, then takes this one's tokens (overlap.py)."""
        if self._unreturned:  # the step before raised in on_token
            carried, self._unreturned = self._unreturned, []
            return carried
        if self.overlap is not None:
            return self.overlap.step(on_token)
        checkpoint = self.scheduler.checkpoint()
        try:
            ran = self._run_step()
        except BaseException:  # an error or Ctrl-C inside the step: as if it never ran
            self.scheduler.rollback(checkpoint)
            raise
        return [] if ran is None else self._take(ran, on_token)

    def _take(self, ran: StepRun, on_token: Callable[[str, int], None] | None) -> list[RequestOutput]:
        """Gives a step's tokens to its requests (stop conditions, outputs, on_token); returns
        the requests that finished. A request that finished or was aborted since the step was
        scheduled takes nothing (an overlapped step's row: overlap.py)."""
        self.kv.commit()  # its KV is written: its full blocks may now be found by prefix lookup
        finished, row = [], 0
        self._unreturned = finished  # come back from the next step() if on_token raises in this one
        sampled, drawn, lps, now = ran.sampled, ran.drawn, ran.logprobs, ran.time
        burst = ran.burst is not None  # a decode burst: each request's steps' tokens, one position each
        for i, ((req, n), chunk) in enumerate(zip(ran.scheduled, ran.chunks)):
            first, row = row, row + chunk.samples
            if req.finish:  # aborted by an on_token callback earlier in this step, or (overlap) before it
                continue
            start = req.computed
            req.draft = []
            if burst:
                new = ran.burst[i]
                end = start + len(new)
            elif chunk.verify and chunk.samples > 1:
                new, accepted = self._verified(ran, req, chunk, first, row)
                end = start + 1 + accepted
            else:
                if req.needs_prompt_rows:
                    take_prompt_logprobs(req, start, ran.logits[first:row])
                first = row - 1  # the chunk's last row samples its next token
                end = start + n
                new = [drawn.get(first, sampled[first])]
            self.stats.tokens_computed += len(new) if burst else n  # (a burst's steps past a stop too)
            mid_prompt = end < len(req.tokens)  # its sample is not a real token
            if not mid_prompt:
                if self.keep_hidden:  # the state an MTP head drafts from: the row that sampled the last new token
                    req.hidden = ran.hidden[first + len(new) - 1].to(torch.float32, copy=True)
                k = req.params.logprobs
                # tokens first, then `computed`: an error or Ctrl-C between leaves tokens the next step computes
                for j, tok in enumerate(new):
                    self._append(req, tok, now, lps.entry(first + j, tok, k) if k is not None else None)
                    if req.finish:
                        new = new[:j + 1]
                        break
            if burst:  # computed: the positions before its last token (one that ended inside the burst
                # leaves the later steps' KV as a stop leaves a step's: never computed); the blocks its
                # tokens filled, reserved unnamed, get their names
                end = start + len(new)
                req.computed = end
                self.kv.allocate(req.kv, req.tokens, end)
                self.kv.commit()
            else:
                req.computed = end
            self.stats.prompt_tokens_computed += max(0, min(end, len(req.prompt)) - start)
            self.kv.computed(req.kv, end)
            if mid_prompt:
                continue
            if req.finish:
                self._retire(req)
                finished.append(self._output(req))
            # once the request's state is whole (a callback that raises leaves it consistent)
            for tok in new if on_token else ():
                on_token(req.request_id, tok)
        self._unreturned = []
        return finished

    def _verified(self, ran: StepRun, req: Request, chunk: SeqChunk, first: int, row: int) -> tuple[list[int], int]:
        """A verify chunk's new tokens (rows first .. row-1 of the step) and how many of its drafts
        were accepted; counts the acceptance for the request, the engine and the drafter."""
        if first in ran.drawn:  # drawn on the host: its rows up to the first draw that differs from its
            # draft, or up to a draft that completes its grammar (then every token is a kept draft)
            new = [ran.drawn[r] for r in range(first, row) if r in ran.drawn]
            accepted = len(new) - (new != chunk.tokens[1:1 + len(new)])
        else:  # the step verified the drafts (spec_verify): its tokens are -1 after the first rejection
            new = [t for t in ran.sampled[first:row] if t >= 0]
            accepted = len(new) - 1
        req.spec.add(chunk.samples - 1, accepted)
        self.spec_stats.add(chunk.samples - 1, accepted)
        self.drafter.observe(req, chunk.samples - 1, accepted)
        return new, accepted

    def _run_step(self) -> StepRun | None:
        """Drafts, schedules and runs one step (None when nothing is scheduled). It changes request
        state only through the scheduler, so Scheduler.rollback undoes it."""
        step = self._launch()
        if step is None:
            return None
        return self._read(step) if step.steps == 1 else run_burst(self, step)

    def _launch(self) -> Launched | None:
        """Drafts, schedules and launches one step, not waiting for it (None when nothing is scheduled)."""
        self._draft()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return None
        chunks, host = [], []
        for req, n in scheduled:
            p = req.params
            verify = req.remaining == 1 and n > 1  # the last token and n - 1 drafts
            toks = [req.tokens[req.computed], *req.draft[:n - 1]] if verify else req.tokens[req.computed:req.computed + n]
            host.append(self._host_sampled(req))  # host_sampling.py draws its token: the step only takes the argmax
            every_row = not verify and req.needs_prompt_rows  # prompt logprobs: logits of every row
            chunks.append(SeqChunk.of(req.kv, toks, req.computed, temperature=0.0 if host[-1] else float(p.temperature),
                                      top_k=p.top_k, top_p=p.top_p, seed=req.seed,
                                      samples=n if verify or every_row else 1, verify=verify))
        steps = burst_steps(self, scheduled, chunks, host) if self.decode_steps > 1 else 1
        t0 = time.perf_counter()
        inputs, outputs = self.forward(chunks)
        if self.latency is not None:
            self.latency.observe(len(chunks), sum(len(c.tokens) for c in chunks), (time.perf_counter() - t0) * 1000)
        return Launched(scheduled, chunks, host, inputs, outputs, steps)

    def _read(self, step: Launched, sampled: list[int] | None = None) -> StepRun:
        """A launched step's results: its tokens (read from the device, waiting for the step, unless
        given), host draws and logprobs."""
        logits, next_tokens, hidden = step.outputs
        if sampled is None:
            sampled = next_tokens.tolist()  # waits for the step (a device's KV writes included)
        now = time.perf_counter()
        drawn = draw_on_host(step.scheduled, step.chunks, step.host, logits, step.inputs["seeds"], self.host_rows,
                             self._stop_ids)
        lps = logprob_rows(step.scheduled, step.chunks, logits)
        self.stats.steps += 1
        return StepRun(step.scheduled, step.chunks, logits, sampled, drawn, lps, hidden, now)

    def forward(self, chunks: list[SeqChunk], tokens: torch.Tensor | None = None
                ) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
        """Runs one step's chunks -> (its host inputs, [logits [R, V], next_tokens [R], hidden]),
        not waiting for the device: a plain decode step in its bucket (graphed_decode.py) where
        graphs are on, any other step eagerly. tokens [T] on the model's device: the step's token
        ids, in place of the chunks' (an overlapped step's, fed from the last step's outputs)."""
        if self.graphed is not None and self.graphed.fits(chunks):
            return self.graphed(chunks, tokens)
        again = self.buffers.refill(chunks, self.cache) if tokens is None else None
        if again is not None:  # a decode step after one of the same sequences: the last call's prepared
            outputs = self.model.rerun(again)  # calls over its inputs, rewritten (no views, no layout lookup)
            if outputs is not None:
                return again, outputs
            inputs = self.buffers.fresh_views()  # not rerun (nothing ran): the step is written, call afresh
        else:
            inputs = self.buffers.fill(chunks, self.cache)
        if tokens is not None and inputs["tokens"].device == tokens.device:
            inputs["tokens"].copy_(tokens)
        elif tokens is not None:  # a GPU's eager step: the runner takes an input already there as it is
            inputs = {**inputs, "tokens": tokens}
        return inputs, self.model(inputs)

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos)

    def grammars(self) -> Grammars:
        """The compiled grammars of structured outputs (made on first use)."""
        if getattr(self, "_grammars", None) is None:
            if self.tokenizer is None:
                raise DeepfuseError("structured outputs need a model with a tokenizer")
            self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size)
        return self._grammars

    def _host_sampled(self, req: Request) -> bool:
        """Whether req's next token is drawn by host_sampling.py."""
        return needs_host_sampling(req.params, len(req.generated), self._stop_ids(req.params))

    def _draft(self) -> None:
        """Proposes drafts for every running request that is decoding (speculative decoding)."""
        if self.drafter is not None:
            set_drafts(self.drafter, self.spec, self.scheduler, self.max_model_len, self._host_sampled, self.latency)

    def _append(self, req: Request, tok: int, now: float, logprobs: dict[int, float] | None) -> None:
        """req takes tok, and finishes if tok ends it (finish.py)."""
        self.stats.tokens_generated += 1
        take_token(req, tok, now, logprobs, self.eos, self.tokenizer)

    def _output(self, req: Request) -> RequestOutput:
        text = req.stop_text if req.stop_text is not None else \
            (self.tokenizer.decode(req.generated) if self.tokenizer else "")
        return request_output(req, text, self.token_text, req.finish or "abort", req.spec if self.spec else None)

    def token_text(self, ids: list[int]) -> str:
        """The text of token ids, special tokens included (logprob entries name their tokens so)."""
        return self.tokenizer.backend.decode(ids, skip_special_tokens=False) if self.tokenizer else ""

    # ---- offline --------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: list[SamplingParams],
                 on_token: Callable[[int, int], None] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every request to completion, one output per prompt in input order (a prompt's n
        completions in its `outputs`). An invalid request gets finish_reason "error" with
        the ValueError in `error`; the others still run. on_token(request index, token id)
        streams (requests of one completion only)."""
        if len(prompts) != len(params):
            raise DeepfuseError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        if on_token is not None and any(getattr(p, "n", 1) != 1 for p in params):
            raise DeepfuseError("on_token streams one completion per prompt; it cannot be used with n > 1")
        done: dict[tuple[int, int], RequestOutput] = {}  # (prompt index, completion) -> its output
        index: dict[str, tuple[int, int]] = {}
        added: dict[str, Request] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                for j in range(p.n if isinstance(p, SamplingParams) else 1):
                    seed = None if j == 0 else completion_seed(p.seed, j) if p.seed is not None else random.getrandbits(62)
                    rid = self._add(prompt, p, seed=seed).request_id
                    index[rid], added[rid] = (i, j), self.requests[rid]
            except DeepfuseError as e:  # raised for the first completion, before any was added
                n = p.n if isinstance(p, SamplingParams) and isinstance(p.n, int) and p.n >= 1 else 1
                done[i, 0] = error_output("", prompt, e, n)

        def stream(rid: str, tok: int) -> None:
            if on_token and rid in index:  # requests added elsewhere may run in these steps too
                on_token(index[rid][0], tok)

        left = len(index)
        try:
            with torch.inference_mode(), tqdm(total=len(index), desc="requests", unit="req", disable=not use_tqdm,
                                              leave=False) as bar:
                while left and self.has_unfinished():
                    for out in self.step(stream if on_token else None):
                        if out.request_id in index:  # requests added elsewhere may finish here too
                            done[index[out.request_id]] = out
                            left -= 1
                            bar.update()
        except BaseException:  # on_token raised, or Ctrl-C: this call's requests leave the engine with it
            for rid in index:
                self.abort(rid)
            self._unreturned = [o for o in self._unreturned if o.request_id not in index]
            raise
        for rid, key in index.items():  # aborted by on_token: what abort() returned
            if key not in done:
                done[key] = self._output(added[rid])
        return [done[i, 0] if done[i, 0].error is not None else merge_completions([done[i, j] for j in range(p.n)])
                for i, p in enumerate(params)]
