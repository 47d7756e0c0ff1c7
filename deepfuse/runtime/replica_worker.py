"""One engine replica, the body of a Ray actor (replicas.py starts it): an AsyncLLM over
LLM(**llm_kwargs) in the actor's process, its outputs streamed back by a Ray streaming generator.

Each item the generator yields is a tuple:
    ("taken",)                     the engine has taken the request (always first, unless an error)
    ("error", kind, message)       the request could not run (kind "DeepfuseError") or the engine
                                   failed ("EngineFailure"); nothing follows
    ("out", RequestOutput, report) a cumulative output; report is None except on the last output,
                                   where it is (seq, frozenset of the names the prefix cache holds)
With `stream` the generator yields the newest output each time the caller asks (outputs that came
meanwhile are skipped: each one holds the whole text so far); without, the last output only.
"""
from __future__ import annotations

import asyncio
import traceback

import torch

from ..errors import DeepfuseError
from .async_llm import AsyncLLM, EngineFailure
from .request import SamplingParams


class ReplicaWorker:
    """llm_kwargs: LLM's arguments (a model name or an artifact directory, engine settings);
    threads: torch threads of this process. An LLM that cannot be built is reported by info()."""

    def __init__(self, llm_kwargs: dict, threads: int):
        torch.set_num_threads(threads)
        self._seq = 0
        self._report: tuple[int, frozenset[bytes]] = (0, frozenset())
        self.llm: AsyncLLM | None = None
        self.error: str | None = None
        try:
            kwargs = dict(llm_kwargs)
            self.llm = AsyncLLM(kwargs.pop("model", "smollm2"), on_finish=self._finished, **kwargs)
        except DeepfuseError as e:
            self.error = str(e)
        except Exception as e:  # noqa: BLE001  (a bug: its name and traceback go to the caller)
            self.error = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"

    def info(self) -> dict:
        """block_size, max_model_len, num_blocks and the tokenizer; or {"error": message}."""
        if self.llm is None:
            return {"error": self.error}
        engine = self.llm.engine
        return {"block_size": engine.kv.bs, "max_model_len": engine.max_model_len,
                "num_blocks": engine.kv.pool.num_blocks, "tokenizer": self.llm.tokenizer}

    def _finished(self, out) -> None:
        """On the engine thread, after each finished request: the prefix cache's names, numbered."""
        self._seq += 1
        self._report = (self._seq, frozenset(self.llm.engine.kv.pool.by_name))

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, stream: bool = True):
        """The request's items (see the module's docstring); closing the generator aborts it."""
        try:
            outputs = await self.llm.add_request(prompt_ids, params, request_id)
        except (DeepfuseError, EngineFailure) as e:
            yield ("error", type(e).__name__, str(e))
            return
        yield ("taken",)
        latest: list = [None]
        ready = asyncio.Event()

        async def pump() -> None:
            try:
                async for out in outputs:
                    latest[0] = out
                    ready.set()
            except Exception as e:  # noqa: BLE001  (EngineFailure: sent on as an error item)
                latest[0] = e
                ready.set()

        task = asyncio.ensure_future(pump())
        try:
            while True:
                await ready.wait()
                ready.clear()
                item = latest[0]
                if isinstance(item, Exception):
                    yield ("error", type(item).__name__, str(item))
                    return
                if item.finished:
                    yield ("out", item, self._report)
                    return
                if stream:
                    yield ("out", item, None)
        finally:
            if not task.done():
                task.cancel()  # leaves AsyncLLM's stream unfinished: it aborts the request

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    def stats(self):
        """The AsyncLLM's EngineStats."""
        return self.llm.stats()

    def cached(self) -> tuple[int, frozenset[bytes]]:
        """The last report: (seq, the prefix cache's names after the last finished request)."""
        return self._report

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
