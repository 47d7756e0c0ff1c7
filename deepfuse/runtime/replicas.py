"""Engine replicas as Ray actors behind a prefix-cache-aware router.

    llm = Replicas(2, model="smollm2")            # 2 actors, each an AsyncLLM over LLM("smollm2")
    async for out in llm.generate("Hi", SamplingParams(max_tokens=8), "req-1"):
        print(out.outputs[0].text)
    llm.shutdown()

    ReplicatedLLM("smollm2", replicas=2).generate(prompts, params)   # offline, like LLM.generate

Replicas has AsyncLLM's face (generate, add_request, abort, stats, shutdown, tokenizer,
max_model_len, on_finish), so the HTTP app serves it unchanged. This process tokenizes each prompt,
names its full blocks as the engines do (router.prompt_block_names) and asks the PrefixRouter for a
replica; the replica streams its outputs back and, with each finished request, the names its
prefix cache holds (replica_worker.py). A replica that dies fails its requests in flight with
EngineFailure and gets no new ones; the others go on.
"""
from __future__ import annotations

import asyncio
import os
import random
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import fields

import torch

from ..codegen.artifact import CompiledModel
from ..errors import DeepfuseError
from .async_llm import EngineFailure, EngineStats
from .llm import prompt_text, prompt_token_ids
from .outputs import RequestOutput, error_output
from .request import SamplingParams
from .router import PrefixRouter, prompt_block_names


def _ray():
    try:
        import ray
    except ImportError:
        raise DeepfuseError("engine replicas run on Ray, which is not installed: pip install -e '.[ray]'") from None
    return ray


def _is_token_ids(ids: object) -> bool:
    return isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)


class Replicas:
    """num_replicas actors, each running LLM(model, **llm_kwargs) in its own process with
    `threads` torch threads (default: this process's threads shared out). model: a name or path
    (each replica compiles it), or a CompiledModel (written once as an artifact, which every
    replica loads). routing: "prefix" or "round_robin" (router.PrefixRouter, with max_imbalance).
    Starts a local Ray instance unless one is running (and stops it in shutdown)."""

    def __init__(self, num_replicas: int, model: str | CompiledModel = "smollm2", routing: str = "prefix",
                 max_imbalance: int = 8, threads: int | None = None,
                 on_finish: Callable[[RequestOutput], None] | None = None, **llm_kwargs):
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise DeepfuseError(f"replicas must be an integer >= 1, got {num_replicas!r}")
        ray = _ray()
        PrefixRouter(num_replicas, 1, routing, max_imbalance)  # checks the policy before any process starts
        from .replica_worker import ReplicaWorker

        self._artifact = None
        if isinstance(model, CompiledModel):
            self._artifact = tempfile.TemporaryDirectory(prefix="deepfuse-replicas-")
            model.save(self._artifact.name)
            llm_kwargs["artifact"] = self._artifact.name
        else:
            llm_kwargs["model"] = model
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(include_dashboard=False, num_cpus=os.cpu_count())
        threads = threads or max(1, torch.get_num_threads() // num_replicas)
        # the actors import deepfuse from where this process did
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        actor = ray.remote(ReplicaWorker).options(num_cpus=0, max_restarts=0,
                                                  runtime_env={"env_vars": {"PYTHONPATH": path}})
        self.workers = [actor.remote(llm_kwargs, threads) for _ in range(num_replicas)]
        try:
            infos = ray.get([w.info.remote() for w in self.workers])
        except BaseException:  # a replica process that died while starting: stop the others
            self.shutdown()
            raise
        bad = next((i["error"] for i in infos if "error" in i), None)
        if bad is not None:
            self.shutdown()
            raise DeepfuseError(bad)
        self.tokenizer = infos[0]["tokenizer"]
        self.max_model_len = infos[0]["max_model_len"]
        self.block_size = infos[0]["block_size"]
        self.router = PrefixRouter(num_replicas, self.block_size, routing, max_imbalance)
        self.on_finish = on_finish
        self._running: dict[str, int] = {}  # request id -> its replica

    async def generate(self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """As AsyncLLM.generate; stream=False yields the last output only."""
        outputs = await self.add_request(prompt, sampling_params, request_id, stream)
        async for out in outputs:
            yield out

    async def add_request(self, prompt: str | dict | list[int], sampling_params: SamplingParams | None = None,
                          request_id: str | None = None, stream: bool = True) -> AsyncIterator[RequestOutput]:
        """Routes the request and waits until its replica has taken it (DeepfuseError if it cannot
        run; a replica found dead here is skipped for the next choice)."""
        ray = _ray()
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise DeepfuseError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        request_id = request_id if request_id is not None else f"req-{random.getrandbits(64):016x}"
        if request_id in self._running:
            raise DeepfuseError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids(self.tokenizer, prompt)
        names = prompt_block_names(ids, self.block_size) if _is_token_ids(ids) else []
        while True:
            r = self.router.route(names)
            self.router.started(r, request_id, names)
            self._running[request_id] = r
            gen = self.workers[r].generate.options(num_returns="streaming", _generator_backpressure_num_objects=2
                                                   ).remote(ids, params, request_id, stream)
            try:
                first = await (await gen.__anext__())
            except (ray.exceptions.RayActorError, StopAsyncIteration):
                self._ended(r, request_id)
                self.router.mark_dead(r)
                continue
            except BaseException:
                self._ended(r, request_id)
                ray.cancel(gen)
                raise
            if first[0] == "error":
                self._ended(r, request_id)
                raise (DeepfuseError if first[1] == "DeepfuseError" else EngineFailure)(first[2])
            return _Stream(self, r, request_id, prompt_text(prompt), gen)

    async def _outputs(self, stream: _Stream, gen) -> AsyncIterator[RequestOutput]:
        ray = _ray()
        r, text = stream.replica, stream.text
        finished = False
        try:
            async for ref in gen:
                try:
                    item = await ref
                except ray.exceptions.RayActorError as e:
                    self.router.mark_dead(r)
                    raise EngineFailure(f"replica {r} stopped: {e}") from None
                if item[0] == "error":
                    raise EngineFailure(item[2])
                _, out, report = item
                out.prompt = text
                if report is not None:
                    self.router.report(r, *report)
                finished = out.finished
                if finished and self.on_finish is not None:
                    self.on_finish(out)
                yield out
            if not finished:  # the stream ended without its last output: the actor went away
                self.router.mark_dead(r)
                raise EngineFailure(f"replica {r} stopped before the request finished")
        finally:
            stream.end(finished)

    def _ended(self, r: int, request_id: str) -> None:
        self.router.finished(r, request_id)
        self._running.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Stops a request (no-op if it has ended); its stream gets a last output, finish "abort"."""
        r = self._running.get(request_id)
        if r is not None:
            await self.workers[r].abort.remote(request_id)

    def replica_stats(self) -> list[EngineStats | None]:
        """Each replica's EngineStats (None for a dead one); one round trip to every live replica."""
        ray = _ray()
        out = []
        for r, w in enumerate(self.workers):
            if not self.router.replicas[r].alive:
                out.append(None)
                continue
            try:
                out.append(ray.get(w.stats.remote(), timeout=10))
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self.router.mark_dead(r)
                out.append(None)
        return out

    def stats(self) -> EngineStats:
        """The live replicas' EngineStats added up (the hit rate over all their prefix lookups)."""
        live = [s for s in self.replica_stats() if s is not None]
        total = EngineStats(**{f.name: sum(getattr(s, f.name) for s in live) for f in fields(EngineStats)})
        total.prefix_hit_rate = total.prefix_hits / total.prefix_queries if total.prefix_queries else 0.0
        return total

    def shutdown(self) -> None:
        """Stops every replica (running requests are aborted) and Ray, if this object started it."""
        ray = _ray()
        for w in getattr(self, "workers", []):
            try:
                ray.get(w.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001  (a dead replica has nothing to stop)
                pass
            ray.kill(w)
        self.workers = []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        if self._artifact is not None:
            self._artifact.cleanup()
            self._artifact = None


class _Stream:
    """A request's outputs (an async iterator, as AsyncLLM's); closing it, started or not, ends
    the request's bookkeeping and aborts it on its replica if it has not finished."""

    def __init__(self, owner: Replicas, replica: int, request_id: str, text: str | None, gen):
        self.owner, self.replica, self.request_id, self.text = owner, replica, request_id, text
        self.ended = False
        self._it = owner._outputs(self, gen)

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> RequestOutput:
        return await self._it.__anext__()

    async def aclose(self) -> None:
        await self._it.aclose()
        self.end(False)

    def end(self, finished: bool) -> None:
        if self.ended:
            return
        self.ended = True
        owner, r = self.owner, self.replica
        owner._ended(r, self.request_id)
        if not finished and owner.router.replicas[r].alive:
            owner.workers[r].abort.remote(self.request_id)


class ReplicatedLLM:
    """LLM.generate over engine replicas: `ReplicatedLLM("smollm2", replicas=2).generate(prompts,
    params)` gives one RequestOutput per prompt, in order, each from the replica the router chose
    (an invalid request comes back with finish_reason "error", as from LLM). Replicas' arguments."""

    def __init__(self, model: str | CompiledModel = "smollm2", replicas: int = 2, routing: str = "prefix", **kwargs):
        self.replicas = Replicas(replicas, model, routing, **kwargs)
        self.tokenizer = self.replicas.tokenizer

    def generate(self, prompts: str | dict | list[str | dict | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise DeepfuseError(f"{len(plist)} SamplingParams for {len(prompts)} prompts")
        return asyncio.run(self._run(prompts, plist))

    async def _run(self, prompts: list, plist: list[SamplingParams]) -> list[RequestOutput]:
        async def one(i: int) -> RequestOutput:
            rid = f"offline-{i}-{random.getrandbits(32):08x}"
            try:
                outs = [out async for out in self.replicas.generate(prompts[i], plist[i], rid, stream=False)]
                return outs[-1]
            except DeepfuseError as e:
                n = plist[i].n if isinstance(plist[i].n, int) and plist[i].n >= 1 else 1
                return error_output(rid, prompts[i], e, n)

        # added in order (the router sees them as they come), then run together
        return list(await asyncio.gather(*[one(i) for i in range(len(prompts))]))

    def close(self) -> None:
        self.replicas.shutdown()
