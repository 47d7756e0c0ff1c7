"""Prefill/decode disaggregation: a prefill worker and a decode worker, separate processes on this
host with an engine each; a request's prompt runs on the prefill worker, its KV moves to the
decode worker, which generates the rest.

    eng = DisaggregatedEngine("smollm2")           # starts the two worker processes
    outs = eng.generate([[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=8)])
    rid = eng.add_request([4, 5], SamplingParams(max_tokens=8))   # or one at a time, any time
    while eng.has_unfinished():
        for out in eng.get_finished(): ...
    eng.close()

The prefill worker runs each request to its first token (max_tokens 1, its other settings as
given) and reads the prompt's KV out of its cache (KVCache.read_rows) before the blocks are
freed. The rows travel to the decode worker through a torch.multiprocessing queue, in shared
memory, with the first token and its logprobs; the decode worker's engine takes the request
over (Engine.add_prefilled) and decodes it among the others it holds, so a long prompt never
stalls the decode steps. The first token reaches the caller as soon as the prefill worker has
it (time to first token); the output when the decode worker finishes.

Tokens: the first is drawn by the prefill engine, the rest by the decode engine, each with the
request's seed and position, as one engine draws them; they are one engine's tokens wherever the
step's numbers do not depend on the batch (the f32 build, batch-invariant mode). Limits: models
with one cache group (not hybrid ones), the cpu target; n completions run as n requests.
"""
from __future__ import annotations

import queue
import random
import time
from collections import deque
from dataclasses import dataclass, replace

import torch
import torch.multiprocessing as mp

from ..errors import DeepfuseError
from .outputs import RequestOutput, error_output, merge_completions
from .request import SamplingParams, completion_seed


@dataclass(frozen=True)
class WorkerOptions:
    """What both workers build: the compile settings and the Engine's."""

    dtype: str = "f32"
    quant: str | None = None
    with_tokenizer: bool = True
    block_size: int = 16
    num_blocks: int = 1024
    max_num_tokens: int = 512
    max_num_seqs: int = 64
    threads: int = 1  # torch threads per worker


def _engine(model, options: WorkerOptions, engine_class=None, **kw):
    """(Engine over the compiled model, tokenizer) in a worker process."""
    from ..compiler import compile as compile_model
    from ..models import load_model
    from .engine import Engine
    from .kv_cache import CacheConfig

    torch.set_num_threads(options.threads)
    tok = None
    if isinstance(model, str):
        model, tok = load_model(model, with_tokenizer=options.with_tokenizer)
    compiled = compile_model(model, target="cpu", dtype=options.dtype, quant=options.quant, tokenizer=tok)
    engine = (engine_class or Engine)(compiled, CacheConfig(options.block_size, options.num_blocks),
                                      options.max_num_tokens, options.max_num_seqs, **kw)
    if len(engine.cache.groups) > 1:
        raise DeepfuseError("prefill/decode disaggregation takes models with one cache group, not hybrid ones "
                            "(sliding-window and full-attention layers)")
    return engine, tok


def _drain(inbox, block: bool) -> list:
    """The messages waiting in inbox (at least one when block)."""
    got = [inbox.get()] if block else []
    while True:
        try:
            got.append(inbox.get_nowait())
        except queue.Empty:
            return got


def _prefill_main(model, options: WorkerOptions, inbox, to_decode, outbox) -> None:
    """The prefill worker: each request to its first token, then its prompt's KV to the decode worker."""
    from .engine import Engine

    class PrefillEngine(Engine):
        def _retire(self, req) -> None:
            if req.generated:  # finished at its first token: hand it over before its blocks are freed
                rows = self.cache.read_rows(req.kv.table, len(req.prompt))
                real = pending.pop(req.request_id)
                lps = req.logprobs[0] if req.logprobs else None
                outbox.put(("first", req.request_id, req.generated[0], time.time()))
                to_decode.put((req.request_id, req.prompt, real, req.generated[0], lps, req.prompt_logprobs, rows))
            super()._retire(req)

    pending: dict[str, SamplingParams] = {}
    try:
        engine, tok = _engine(model, options, PrefillEngine)
        outbox.put(("ready", "prefill", tok))
        stopping = False
        while not (stopping and not engine.has_unfinished()):
            for msg in _drain(inbox, block=not engine.has_unfinished() and not stopping):
                if msg is None:
                    stopping = True
                    continue
                rid, prompt, params = msg
                try:
                    engine.check(prompt, params)  # the real settings: the decode worker must take it
                    first = replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
                    engine.add_request(prompt, first, rid)
                    pending[rid] = params
                except DeepfuseError as e:
                    outbox.put(("error", rid, str(e)))
            if engine.has_unfinished():
                for out in engine.step():
                    if not out.outputs[0].token_ids:  # aborted before its first token
                        outbox.put(("error", out.request_id, "aborted before its first token"))
    except BaseException as e:  # noqa: BLE001  (reported to the caller, which raises it)
        outbox.put(("fail", "prefill", f"{type(e).__name__}: {e}"))
    finally:
        to_decode.put(None)


def _decode_main(model, options: WorkerOptions, inbox, outbox) -> None:
    """The decode worker: takes over prefilled requests as room allows and decodes them."""
    try:
        engine, _ = _engine(model, options)
        outbox.put(("ready", "decode", None))
        backlog, stopping = deque(), False
        while not (stopping and not backlog and not engine.has_unfinished()):
            busy = engine.has_unfinished() or bool(backlog)
            for msg in _drain(inbox, block=not busy and not stopping):
                if msg is None:
                    stopping = True
                else:
                    backlog.append(msg)
            while backlog and engine.can_take_prefilled(len(backlog[0][1])):
                rid, prompt, params, first, lps, plps, rows = backlog.popleft()
                try:
                    engine.add_prefilled(prompt, params, first, rows, rid, logprobs=lps, prompt_logprobs=plps)
                except DeepfuseError as e:
                    outbox.put(("error", rid, str(e)))
            if backlog and not engine.has_unfinished():  # too long for this cache even alone
                rid = backlog.popleft()[0]
                outbox.put(("error", rid, "the prompt's KV does not fit the decode worker's cache; raise num_blocks"))
            if engine.has_unfinished():
                for out in engine.step():
                    outbox.put(("done", out.request_id, out))
    except BaseException as e:  # noqa: BLE001
        outbox.put(("fail", "decode", f"{type(e).__name__}: {e}"))


class DisaggregatedEngine:
    """A prefill worker and a decode worker (module docstring). model: a name/path load_model
    accepts (each worker loads it) or a Llama-family model (sent to the workers). generate()
    takes token ids and SamplingParams like Engine.generate."""

    def __init__(self, model, options: WorkerOptions | None = None, start_timeout_s: float = 600.0):
        self.options = options or WorkerOptions()
        ctx = mp.get_context("spawn")
        self._outbox, self._to_prefill, self._to_decode = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self._procs = [
            ctx.Process(target=_prefill_main, args=(model, self.options, self._to_prefill, self._to_decode,
                                                    self._outbox), daemon=True, name="deepfuse-prefill"),
            ctx.Process(target=_decode_main, args=(model, self.options, self._to_decode, self._outbox), daemon=True,
                        name="deepfuse-decode")]
        for p in self._procs:
            p.start()
        self.tokenizer, self._next_id = None, 0
        self._arrival: dict[str, float] = {}  # unfinished request id -> when it was added (time.time())
        self._first: dict[str, float] = {}  # -> when the prefill worker had its first token
        self._prompts: dict[str, list[int]] = {}
        try:
            for _ in self._procs:
                msg = self._receive(start_timeout_s)
                if msg[0] != "ready":
                    raise DeepfuseError(f"unexpected message {msg[0]!r} from a starting worker")
                self.tokenizer = msg[2] if msg[1] == "prefill" else self.tokenizer
        except BaseException:
            self.close()
            raise

    def _receive(self, timeout_s: float, quiet_ok: bool = False) -> tuple | None:
        """The next message from a worker (None after timeout_s of silence where quiet_ok);
        DeepfuseError if a worker failed or exited, or went silent for timeout_s otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._outbox.get(timeout=max(0.0, min(5.0, deadline - time.monotonic())))
            except queue.Empty:
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead or (time.monotonic() >= deadline and not quiet_ok):
                    self.close()
                    raise DeepfuseError("disaggregated workers " + ("exited: " + ", ".join(dead) if dead
                                                                     else "timed out")) from None
                if time.monotonic() >= deadline:
                    return None
                continue
            if msg[0] == "fail":
                self.close()
                raise DeepfuseError(f"the {msg[1]} worker failed: {msg[2]}")
            return msg

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Sends one request (one completion: n must be 1) to the prefill worker; returns its id.
        Its output comes from get_finished (a request the workers refuse: finish_reason "error")."""
        if not self._procs:
            raise DeepfuseError("this disaggregated engine is closed")
        if not isinstance(params, SamplingParams):
            raise DeepfuseError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise DeepfuseError(f"n = {params.n} completions are generate()'s; here add one request per completion")
        if request_id is None:
            request_id = f"r{self._next_id}"
            self._next_id += 1
        if request_id in self._arrival:
            raise DeepfuseError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)  # both workers draw alike
        self._arrival[request_id] = time.time()
        self._prompts[request_id] = prompt
        self._to_prefill.put((request_id, list(prompt) if isinstance(prompt, (list, tuple)) else prompt,
                              replace(params, seed=seed)))
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self._arrival)

    def get_finished(self, timeout_s: float = 3600.0) -> list[RequestOutput]:
        """Waits for the workers' next message (at most timeout_s) and returns the requests it and
        any others waiting finished (possibly none, also after timeout_s of silence); their metrics are the caller's view: time to
        first token from add_request to the prefill worker's first token, TPOT over the rest."""
        first = self._receive(timeout_s, quiet_ok=True)
        msgs, out = [first] if first is not None else [], []
        while msgs:
            try:
                msgs.append(self._outbox.get_nowait())
            except queue.Empty:
                break
        for kind, rid, *rest in msgs:
            if kind == "fail":
                self.close()
                raise DeepfuseError(f"the {rid} worker failed: {rest[0]}")
            if kind == "first":
                self._first[rid] = rest[1]
            elif kind == "error":
                out.append(error_output(rid, self._prompts.pop(rid), DeepfuseError(rest[0])))
                self._arrival.pop(rid)
            elif kind == "done":
                out.append(self._caller_metrics(rest[0], self._arrival.pop(rid), self._first.pop(rid, None)))
                self._prompts.pop(rid)
        return out

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], timeout_s: float = 3600.0,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Every request to completion, one output per prompt in input order (n completions in its
        outputs; an invalid request's output has finish_reason "error" and its error)."""
        if len(prompts) != len(params):
            raise DeepfuseError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        ids, errors, done = {}, {}, {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            try:
                if not isinstance(p, SamplingParams):
                    raise DeepfuseError(f"params must be SamplingParams, got {type(p).__name__}")
                p.validate()
                seed = p.seed if p.seed is not None else random.getrandbits(62)
                for j in range(p.n):
                    rid = self.add_request(prompt, replace(p, n=1, seed=seed if j == 0 else completion_seed(seed, j)))
                    ids[rid] = (i, j)
            except DeepfuseError as e:
                errors[i] = e
        left, progress = set(ids), time.monotonic()
        while left:
            got = self.get_finished(timeout_s)
            if got:
                progress = time.monotonic()
            elif time.monotonic() - progress >= timeout_s:
                self.close()
                raise DeepfuseError(f"disaggregated workers finished nothing in {timeout_s:.0f} s")
            for out in got:
                if out.request_id in left:
                    left.discard(out.request_id)
                    i, j = ids[out.request_id]
                    if out.error is not None:
                        errors.setdefault(i, out.error)
                    done[i, j] = out
        outs = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            n = p.n if isinstance(p, SamplingParams) and isinstance(p.n, int) and p.n >= 1 else 1
            outs.append(error_output(str(i), prompt, errors[i], n) if i in errors
                        else merge_completions([done[i, j] for j in range(n)], str(i)))
        return outs

    @staticmethod
    def _caller_metrics(out: RequestOutput, arrival: float, first: float | None) -> RequestOutput:
        m = out.metrics
        if m is None:
            return out
        first = first if first is not None else m.first_token_time
        n = len(out.outputs[0].token_ids)
        last = m.last_token_time or first
        m.arrival_time, m.first_token_time = arrival, first
        m.ttft_s, m.total_s = first - arrival, (m.finished_time or last) - arrival
        m.tpot_s = (last - first) / (n - 1) if n > 1 else 0.0
        return out

    def close(self) -> None:
        """Stops the worker processes (idempotent)."""
        if self._procs and self._procs[0].is_alive():
            self._to_prefill.put(None)  # the prefill worker passes the stop on to the decode worker
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self._procs = []

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.close()
