"""Tensor and expert parallelism over processes: ranks started by the engine, collectives through
torch.distributed: gloo for the CPU target; NCCL for sm90/sm100 where the ranks have GPUs (rank r
on GPU r mod the count), gloo when those targets run in Triton's CPU interpreter; gloo for
ascend950, whose host code's HCCL calls the AscendC emulator hands to it (codegen/ascendc/hccl.py).

    eng = ShardedEngine("smollm2", world=2)         # starts 2 rank processes
    outs = eng.generate([[1, 2, 3]], [SamplingParams(temperature=0, max_tokens=8)])
    eng.close()

Each rank process loads the model, compiles its own partitioned step (sharded_compile.py) and keeps
only its weight shards and a kv cache of its kv heads; it runs a whole Engine (scheduler, cache
manager) on the same requests as every other rank, as SGLang's TP workers do. The engines are
deterministic, so they take the same decisions step by step, and the collectives inside the step
keep their numbers equal: the all-gathered logits are identical on every rank, so are the sampled
tokens. The caller's process holds no weights; it hands each request to all ranks (seeds fixed
first, so the ranks draw alike) and returns rank 0's outputs. A rank that fails reports its error
and the others give up at the process group's timeout.
"""
from __future__ import annotations

import os
import queue
import random
import tempfile
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..errors import DeepfuseError
from ..ir.opdefs_collective import use_communicator
from .outputs import RequestOutput
from .request import SamplingParams


class TorchCommunicator:
    """The collective ops' transport in a rank process: the default torch.distributed group."""

    def __init__(self, world: int):
        self.world = world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        y = x.contiguous().clone()
        dist.all_reduce(y)
        return y

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x)
        return torch.cat(parts, dim)

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.empty_like(x)
        dist.all_to_all_single(y, x.contiguous())
        return y


@dataclass(frozen=True)
class RankOptions:
    """What every rank builds: the compile dtype and the Engine's settings."""

    dtype: str = "f32"
    target: str = "cpu"  # cpu, sm90, sm100 or ascend950 (in the AscendC emulator)
    with_tokenizer: bool = True
    block_size: int = 16
    num_blocks: int = 1024
    max_num_tokens: int = 512
    max_num_seqs: int = 64
    enable_prefix_caching: bool = True
    threads: int = 1  # torch threads per rank
    moe_dispatch: str = "all_reduce"  # expert-parallel MoE: "all_reduce" or "all_to_all" (passes/shard.py)
    timeout_s: float = 300.0  # a collective waiting longer than this fails (a rank died)


def _rank_main(rank: int, world: int, store: str, model, options: RankOptions, inbox, outbox,
               artifact: tuple[str, str | None] | None = None) -> None:
    """One rank: build (or load its part of a tensor-parallel artifact: (directory, digest)),
    report ready (rank 0 with the tokenizer), then run each request batch."""
    from ..models import load_model
    from ..sharded_compile import compile_rank
    from .engine import Engine
    from .kv_cache import CacheConfig
    from .loader import load_rank

    torch.set_num_threads(options.threads)
    dist.init_process_group(_backend(options.target, rank), init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=options.timeout_s))
    try:
        if artifact is not None:
            compiled = load_rank(artifact[0], rank, artifact[1])
            tok = compiled.tokenizer
        else:
            tok = None
            if isinstance(model, str):
                model, tok = load_model(model, with_tokenizer=options.with_tokenizer)
            compiled = compile_rank(model, world, rank, options.target, dtype=options.dtype, tokenizer=tok,
                                    moe_dispatch=options.moe_dispatch)
            del model  # from here the rank holds its shards only
        if compiled.plan.get("ep_rows", [world, rank]) != [world, rank]:
            raise DeepfuseError(f"rank {rank} of {world} loaded the plan of rank {compiled.plan['ep_rows'][1]} of "
                                f"{compiled.plan['ep_rows'][0]}")
        engine = Engine(compiled, CacheConfig(options.block_size, options.num_blocks, options.enable_prefix_caching),
                        options.max_num_tokens, options.max_num_seqs)
        outbox.put(("ready", rank, tok if rank == 0 else None))
        with use_communicator(TorchCommunicator(world)):
            while (job := inbox.get()) is not None:
                outs = engine.generate(*job)
                if rank == 0:
                    outbox.put(("done", rank, outs))
    except BaseException as e:  # noqa: BLE001  (reported to the caller, which raises it)
        outbox.put(("error", rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def _backend(target: str, rank: int) -> str:
    """NCCL for a GPU target on a machine with GPUs (this rank's GPU made current first), else gloo
    (cpu; sm90/sm100 in Triton's interpreter; ascend950, whose emulated HCCL runs over it)."""
    from ..codegen.triton.runner import interpreting

    if target in ("sm90", "sm100") and torch.cuda.is_available() and not interpreting():
        torch.cuda.set_device(rank % torch.cuda.device_count())
        return "nccl"
    return "gloo"


class ShardedEngine:
    """`world` rank processes running one model tensor-parallel (its MoE layers expert-parallel).
    model: a name/path load_model accepts (each rank loads it) or a Llama-family model (sent to
    the ranks). generate() takes token ids and SamplingParams like Engine.generate."""

    def __init__(self, model, world: int, options: RankOptions | None = None, start_timeout_s: float = 600.0,
                 artifact: str | None = None, artifact_digest: str | None = None):
        """artifact: a tensor-parallel artifact directory (`deepfuse compile --tp N`) each rank loads
        its part of (model is then ignored), pinned by artifact_digest where given."""
        if world < 2:
            raise DeepfuseError(f"a sharded engine needs at least 2 ranks, got {world}")
        from ..models.sharding import llama_sharding
        from ..passes.shard import MOE_DISPATCH
        from .loader import load_rank, read_manifest, tensor_parallel_size

        options = options or RankOptions()
        if options.moe_dispatch not in MOE_DISPATCH:
            raise DeepfuseError(f"moe_dispatch must be one of {', '.join(MOE_DISPATCH)}, got {options.moe_dispatch!r}")
        if artifact is not None:
            manifest = read_manifest(artifact, artifact_digest)  # a pinned digest is checked before any process starts
            if tensor_parallel_size(artifact) != world:
                load_rank(artifact, 0, artifact_digest)  # a clear error where it is no tensor-parallel artifact
                raise DeepfuseError(f"artifact {artifact} has {tensor_parallel_size(artifact)} ranks, not {world}")
            if options.moe_dispatch != "all_reduce":
                raise DeepfuseError("a tensor-parallel artifact fixes its MoE dispatch when compiled: recompile it "
                                    f"with --moe-dispatch {options.moe_dispatch} instead of asking for it here")
            options = replace(options, target=manifest["target"])  # its collectives' backend follows its target
        elif not isinstance(model, str):
            llama_sharding(model.config, world, options.moe_dispatch)  # refuse what does not split, before starting
        self.world, self.options = world, options
        self._dir = tempfile.TemporaryDirectory(prefix="deepfuse-tp-")
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world)]
        store = os.path.join(self._dir.name, "store")
        source = (artifact, artifact_digest) if artifact is not None else None
        self._procs = [ctx.Process(target=_rank_main, args=(r, world, store, None if source else model, self.options,
                                                           self._inboxes[r], self._outbox, source),
                                   daemon=True, name=f"deepfuse-rank{r}")
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self.tokenizer = None
        try:
            for _ in range(world):
                _, rank, tok = self._receive("ready", start_timeout_s)
                self.tokenizer = tok if rank == 0 else self.tokenizer
        except BaseException:
            self.close()
            raise

    def _receive(self, kind: str, timeout_s: float) -> tuple:
        waited = 0.0
        while True:
            try:
                msg = self._outbox.get(timeout=5.0)
            except queue.Empty:
                waited += 5.0
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead or waited >= timeout_s:
                    self.close()
                    why = "exited: " + ", ".join(dead) if dead else "timed out"
                    raise DeepfuseError(f"tensor-parallel ranks {why}") from None
                continue
            if msg[0] == "error":
                self.close()
                raise DeepfuseError(f"tensor-parallel rank {msg[1]} failed: {msg[2]}")
            if msg[0] == kind:
                return msg

    def generate(self, prompts: list[list[int]], params: list[SamplingParams], on_token=None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Engine.generate over the ranks: outputs in input order. on_token is not available (the
        tokens are produced in other processes)."""
        if on_token is not None:
            raise DeepfuseError("on_token streaming is not available with tensor_parallel_size > 1")
        if not self._procs:
            raise DeepfuseError("this sharded engine is closed")
        # every rank must draw with the same seeds: fix the ones the engines would pick at random
        params = [replace(p, seed=random.getrandbits(62)) if isinstance(p, SamplingParams) and p.seed is None else p
                  for p in params]
        for box in self._inboxes:
            box.put((list(prompts), list(params)))
        return self._receive("done", self.options.timeout_s)[2]

    def close(self) -> None:
        """Stops the rank processes (idempotent)."""
        for box, p in zip(self._inboxes, self._procs):
            if p.is_alive():
                box.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self._procs = []
        self._dir.cleanup()

    def __del__(self) -> None:
        if getattr(self, "_procs", None):
            self.close()


def engine_for_llm(model, world: int, target: str, dtype: str, block_size: int, num_blocks: int,
                   max_num_tokens: int, max_num_seqs: int, enable_prefix_caching: bool, artifact: str | None = None,
                   artifact_digest: str | None = None, moe_dispatch: str = "all_reduce",
                   **unsupported) -> ShardedEngine:
    """LLM(..., tensor_parallel_size=world)'s engine: ranks that compile `model`, or load their part
    of a tensor-parallel artifact (artifact, or model naming one). unsupported: LLM settings that
    the sharded engine does not take (each must be left at its default: None, False or 0)."""
    from ..codegen.artifact import CompiledModel

    if isinstance(model, CompiledModel):
        raise DeepfuseError("tensor_parallel_size > 1 compiles the model per rank: give a model name or path, "
                            "or a tensor-parallel artifact (`deepfuse compile --tp N`), not a compiled model")
    if artifact is None and isinstance(model, str) and os.path.isfile(os.path.join(model, "manifest.json")):
        artifact = model
    if artifact_digest is not None and artifact is None:
        raise DeepfuseError("artifact_digest pins an artifact directory; give one (artifact=...)")
    from ..codegen import get_target

    get_target(target)  # an unknown target is refused before any rank starts
    given = sorted(k for k, v in unsupported.items() if v not in (None, False, 0))
    if given:
        raise DeepfuseError(f"tensor_parallel_size > 1 does not support {', '.join(given)} yet; leave "
                            f"{'it' if len(given) == 1 else 'them'} unset")
    threads = max(1, torch.get_num_threads() // world)
    return ShardedEngine(None if artifact else model, world,
                         RankOptions(dtype, target, True, block_size, num_blocks, max_num_tokens, max_num_seqs,
                                     enable_prefix_caching, threads, moe_dispatch=moe_dispatch),
                         artifact=artifact, artifact_digest=artifact_digest)
