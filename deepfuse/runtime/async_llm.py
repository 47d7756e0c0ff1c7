"""AsyncLLM: the engine for servers. One background thread owns the Engine and runs its steps;
coroutines (any number, any time) send it requests and aborts through a queue and get their
outputs back through asyncio queues.

    llm = AsyncLLM("smollm2", dtype="bf16")  # the LLM built on the engine thread (see below)
    async for out in llm.generate("Hi", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)            # cumulative, as vLLM's; out.finished on the last
    await llm.abort("req-1")                  # from any coroutine; its blocks are freed
    llm.shutdown()

Every Engine call happens on the engine thread (the Engine is not thread-safe); other threads
read only `stats()`, a snapshot the engine thread publishes after each step. A prompt's n
completions are n engine requests ("<id>#<j>", seeded as Engine.generate seeds them), added
together so the later ones read the prompt's blocks from the prefix cache.

Given an LLM's arguments, AsyncLLM builds it on the engine thread, so that every OpenMP parallel
region of the process starts from that one thread. Given an LLM built on another thread (one that
ran parallel torch ops, as compiling does), the process holds two OpenMP thread pools on the
same cores, and each region then costs tens of microseconds where it costs ~5 from the process's
one pool: on the 2-core Xeon the bf16+int4 build (ATen's int4 GEMM, a region per projection)
decoded 59.2 tok/s at batch 1 so, against 153.2 built and run on the main thread and 150.8 built
and run on one other thread; int4-a8, whose step opens few regions, 359.7, 363.4 and 365.6
(benchmarks/engine_thread.py, engine_thread_xeon.json).
"""
from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import torch

from ..errors import DeepfuseError
from .detokenize import IncrementalText
from .engine import Engine
from .llm import LLM, prompt_text
from .outputs import RequestOutput, merge_completions, request_output
from .request import SamplingParams, completion_seed


class EngineFailure(RuntimeError):
    """The engine failed (a step raised, or its thread stopped): not the request's fault."""


_TAKEN = "taken"  # the first item of a stream: the engine has taken the request
RATE_WINDOW_S = 10.0  # EngineStats.tokens_per_s is measured over this many seconds
IDLE_PUBLISH_S = 1.0  # an idle engine thread still publishes its stats this often


@dataclass
class EngineStats:
    """What the engine thread last published: requests running and waiting, KV blocks, the
    prefix cache's hit rate, tokens computed and generated so far, speculative drafts."""

    running: int = 0
    waiting: int = 0
    blocks_total: int = 0
    blocks_used: int = 0
    prefix_hit_rate: float = 0.0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    tokens_per_s: float = 0.0  # output tokens/s over the last RATE_WINDOW_S
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which found cached

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV blocks held by requests (cached, unused blocks are free)."""
        return self.blocks_used / self.blocks_total if self.blocks_total else 0.0


@dataclass
class _Stream:
    """One request's state on the engine thread; outputs go to `put` (thread-safe)."""

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    put: Callable[[object], None]
    ids: list[str] = field(default_factory=list)  # its engine requests, one per completion
    texts: list[IncrementalText] = field(default_factory=list)
    done: dict[int, RequestOutput] = field(default_factory=dict)  # completion -> final output


class AsyncLLM:
    """llm: an LLM (its engine is taken over: do not call it directly any more), or the
    arguments of one (AsyncLLM("smollm2", dtype="bf16")). on_finish(out) runs on the engine
    thread for each finished request (servers record latencies there)."""

    def __init__(self, llm: LLM | object = "smollm2", on_finish: Callable[[RequestOutput], None] | None = None,
                 **llm_kwargs):
        self.on_finish = on_finish
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._owner: dict[str, _Stream] = {}  # engine request id -> its stream (engine thread only)
        self._stats = EngineStats()
        self._history: deque[tuple[float, int]] = deque()  # (time, tokens generated) at each publish
        self._errored: BaseException | None = None
        built: list[LLM | BaseException] = [llm] if isinstance(llm, LLM) else []
        ready = threading.Event()

        def run() -> None:
            try:
                torch.set_num_threads(torch.get_num_threads())  # the process's setting for this thread's regions
                if not built:  # the LLM built here: this thread starts every parallel region
                    built.append(LLM(llm, **llm_kwargs))
            except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread below
                built[:] = [e]
            if isinstance(built[0], LLM) and isinstance(built[0].engine, Engine):
                self.llm, self.engine, self.tokenizer = built[0], built[0].engine, built[0].tokenizer
                ready.set()
                self._loop()
            else:
                ready.set()

        self.engine: Engine
        self._thread = threading.Thread(target=run, name="deepfuse-engine", daemon=True)
        self._thread.start()
        try:
            ready.wait()
        except BaseException:  # Ctrl-C while the LLM builds: the thread stops once it has built it
            self._commands.put(("stop", None))
            raise
        if isinstance(built[0], BaseException):
            raise built[0]
        if not isinstance(built[0].engine, Engine):
            kind = type(built[0].engine).__name__
            built[0].engine.close()
            raise DeepfuseError(f"AsyncLLM (and `deepfuse serve`) runs one in-process engine, not a {kind} "
                                "(tensor-parallel ranks); serve a one-process model or artifact")

    # ---- coroutine side -------------------------------------------------------------------

    async def generate(self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields the request's output each time it grows (cumulative: the whole text so far),
        the last with finished=True. A prompt: text, token ids, {"prompt": text} or
        {"prompt_token_ids": ids}. An invalid request raises DeepfuseError before any output;
        leaving the loop early (or being cancelled) aborts the request."""
        outputs = await self.add_request(prompt, sampling_params, request_id)
        async for out in outputs:
            yield out

    async def add_request(self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None,
                          request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Queues a request and waits until the engine has taken it (DeepfuseError if it cannot
        run); returns its outputs as generate() yields them."""
        if self._errored is not None:
            raise EngineFailure(f"the engine stopped: {self._errored}")
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise DeepfuseError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{random.getrandbits(64):016x}"
        ids = self.llm.prompt_token_ids(prompt)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        stream = _Stream(request_id, prompt_text(prompt), ids, params,
                         lambda item: loop.call_soon_threadsafe(outputs.put_nowait, item))
        self._commands.put(("add", stream))
        try:
            taken = await outputs.get()
        except asyncio.CancelledError:
            self._commands.put(("abort", request_id))
            raise
        if isinstance(taken, BaseException):
            raise taken
        return self._outputs(request_id, outputs)

    async def _outputs(self, request_id: str, outputs: asyncio.Queue) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    async def abort(self, request_id: str) -> None:
        """Stops a request (no-op if it has ended); its stream gets a last output, finish "abort"."""
        self._commands.put(("abort", request_id))

    def stats(self) -> EngineStats:
        """The engine thread's latest published counts (safe from any thread)."""
        return self._stats

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def shutdown(self) -> None:
        """Stops the engine thread; running requests are aborted."""
        if self._thread.is_alive():
            self._commands.put(("stop", None))
            self._thread.join()

    # ---- engine thread --------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # a bug: fail every stream rather than leave it waiting
            self._errored = e
            for s in list(self._streams.values()):
                s.put(EngineFailure(f"the engine stopped: {e}"))
            raise

    def _serve(self) -> None:
        while True:
            # idle: wait for a command (publishing now and then); busy: take what has come and step
            commands = []
            if not self.engine.has_unfinished():
                try:
                    commands.append(self._commands.get(timeout=IDLE_PUBLISH_S))
                except queue.Empty:
                    pass
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for kind, arg in commands:
                if kind == "stop":
                    for rid in list(self._streams):
                        self._abort(rid)
                    return
                self._add(arg) if kind == "add" else self._abort(arg)
            if self.engine.has_unfinished():
                self._step()
            self._publish()

    def _add(self, s: _Stream) -> None:
        if s.request_id in self._streams:
            s.put(DeepfuseError(f"request id {s.request_id!r} is already in use"))
            return
        p = s.params
        try:
            n = p.n if isinstance(p.n, int) and not isinstance(p.n, bool) and p.n >= 1 else 1
            for j in range(n):
                seed = p.seed if j == 0 or p.seed is None else completion_seed(p.seed, j)
                eid = self.engine.add_request(s.prompt_ids, replace(p, n=1, seed=seed), f"{s.request_id}#{j}")
                s.ids.append(eid)
                s.texts.append(IncrementalText(self.engine.tokenizer.decode))
                self._owner[eid] = s
        except DeepfuseError as e:  # raised for the first completion, before any was added
            for eid in s.ids:
                self.engine.abort(eid)
                del self._owner[eid]
            s.put(e)
            return
        self._streams[s.request_id] = s
        s.put(_TAKEN)

    def _abort(self, request_id: str) -> None:
        s = self._streams.get(request_id)
        if s is None:
            return
        for j, eid in enumerate(s.ids):
            out = self.engine.abort(eid)
            if out is not None:
                s.done[j] = out
        self._emit(s)

    def _step(self) -> None:
        grown: dict[str, _Stream] = {}

        def on_token(eid: str, _: int) -> None:
            s = self._owner.get(eid)
            if s is not None:
                grown[s.request_id] = s

        try:
            finished = self.engine.step(on_token)
        except Exception as e:  # a bug or a device error: every request fails, the thread goes on
            for rid in list(self._streams):
                s = self._streams[rid]
                for eid in s.ids:
                    self.engine.abort(eid)
                self._close(s)
                s.put(EngineFailure(f"the engine failed in a step: {e}"))
            return
        for out in finished:
            s = self._owner.get(out.request_id)
            if s is not None:
                s.done[s.ids.index(out.request_id)] = out
                grown[s.request_id] = s
        for s in grown.values():
            self._emit(s)

    def _emit(self, s: _Stream) -> None:
        """Sends the stream its output so far; the last one closes it."""
        parts = []
        for j, eid in enumerate(s.ids):
            if j in s.done:
                parts.append(s.done[j])
                continue
            req = self.engine.requests[eid]
            s.texts[j].add(req.generated)
            parts.append(request_output(req, _shown(s.texts[j].text, req.params), self.engine.token_text, None, None))
        out = merge_completions(parts, s.request_id)
        out.prompt = s.prompt
        if out.finished:
            self._close(s)
            if self.on_finish is not None:
                self.on_finish(out)
        s.put(out)

    def _close(self, s: _Stream) -> None:
        self._streams.pop(s.request_id, None)
        for eid in s.ids:
            self._owner.pop(eid, None)

    def _publish(self) -> None:
        e = self.engine
        now, generated = time.monotonic(), e.stats.tokens_generated
        self._history.append((now, generated))
        while len(self._history) > 2 and now - self._history[1][0] >= RATE_WINDOW_S:
            self._history.popleft()
        t0, g0 = self._history[0]
        # blocks of every cache group (a hybrid model has a pool per group)
        self._stats = EngineStats(len(e.scheduler.running), len(e.scheduler.waiting),
                                  sum(p.num_blocks for p in e.kv.pools), e.kv.num_used(), e.kv.usage()["prefix_hit_rate"],
                                  e.stats.prompt_tokens_computed, generated, e.stats.steps,
                                  e.spec_stats.drafted, e.spec_stats.accepted,
                                  (generated - g0) / (now - t0) if now > t0 else 0.0,
                                  e.kv.stats.prefix_queries, e.kv.stats.prefix_hits)


def _shown(text: str, p: SamplingParams) -> str:
    """The part of a running completion's text that is sure to stay: the last characters wait
    while they could begin a stop string (which the final text leaves out)."""
    if not p.stop or p.include_stop_str_in_output:
        return text
    return text[:max(0, len(text) - (max(len(s) for s in p.stop) - 1))]

