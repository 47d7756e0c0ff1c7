"""Decode bursts (Engine(decode_steps=k)): a plain decode step runs k model steps before the
host takes any of their tokens, as vLLM's multi-step scheduling does. Each step after the first
is fed the token the one before it sampled, its inputs advanced in place (StepBuffers.
advance_decode) and the executor's prepared calls run again (CpuExecutor.rerun), so the
scheduler, the fill's views, the executor's layout lookup and the take run once for the k steps:
at batch 1 on a 2-core CPU they are most of a decode step's ~0.2 ms of host time.

A step bursts when every running request decodes one natively sampled token (no drafts, no
logprobs, no host sampling, none waiting for admission) and there are free blocks for all k
positions of every one (none evicted from the prefix cache; reserved unnamed, the take names
those its tokens filled). k is cut to the fewest tokens any request has left (max_tokens). The tokens are those of k steps run
one by one (sampling keys depend on position only): the outputs do not change. What does: a
request's tokens reach on_token k at a time; a request that ends inside a burst (a stop token
or string, whichever comes first) leaves the steps after it computed and dropped, and the burst
ends early once every request has sampled a stop token (stop strings are found at the take). A
fault anywhere in a burst undoes all of it (Engine.step's rollback), as for one step.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .batch import SeqChunk

if TYPE_CHECKING:
    from .engine import Engine, Launched, StepRun
    from .request import Request


def burst_steps(eng: Engine, scheduled: list[tuple[Request, int]], chunks: list[SeqChunk], host: list[bool]) -> int:
    """How many decode steps this scheduled step runs (see the module docstring), with blocks
    reserved for them; 1 where it does not burst (nothing reserved)."""
    k = eng.decode_steps
    if k < 2 or eng.drafter is not None or eng.keep_hidden or eng.scheduler.waiting:
        return 1
    if len(scheduled) != len(eng.scheduler.running):
        return 1
    # a request drawn on the host is so from its first token on (min_tokens ends as tokens come):
    # one not drawn there now is not for the rest of the burst either
    for (req, n), chunk, drawn_on_host in zip(scheduled, chunks, host):
        if (n != 1 or drawn_on_host or chunk.samples != 1 or req.remaining != 1 or req.params.logprobs is not None
                or req.needs_prompt_rows):
            return 1
        k = min(k, req.params.max_tokens - len(req.generated))
    if k < 2:
        return 1
    for g, pool in enumerate(eng.kv.pools):  # free blocks for every request's k positions (none evicted from
        # the prefix cache for positions a stop may leave unused)
        if sum(eng.kv.blocks_needed(req.kv, req.computed + k, g) for req, _ in scheduled) > len(pool.free):
            return 1
    for req, _ in scheduled:
        eng.kv.reserve(req.kv, req.computed + k)
    return k


def run_burst(eng: Engine, step: Launched) -> StepRun:
    """Runs a launched step's burst to its end -> the StepRun whose `burst` holds each scheduled
    request's tokens in order (the first step's logits and draws, which none of its rows use).
    The engine's statistics count the burst's steps once it has run them all."""
    tokens = [[t] for t in step.outputs[1].tolist()]
    stops = [eng._stop_ids(req.params) for req, _ in step.scheduled]
    ended = [toks[0] in stop for toks, stop in zip(tokens, stops)]
    inputs = step.inputs  # the last model call's
    for i in range(1, step.steps):
        if all(ended):
            break  # every request has sampled a stop token
        fed = [toks[-1] for toks in tokens]
        outputs = eng.model.rerun(inputs) if eng.buffers.advance_decode(fed) else None
        if outputs is None:  # a whole fill and a new model call
            chunks = [SeqChunk.of(req.kv, [t], req.computed + i, temperature=c.temperature, top_k=c.top_k,
                                  top_p=c.top_p, seed=c.seed) for (req, _), c, t in zip(step.scheduled, step.chunks, fed)]
            inputs, outputs = eng.forward(chunks)
        for j, t in enumerate(outputs[1].tolist()):
            tokens[j].append(t)
            ended[j] = ended[j] or t in stops[j]
    ran = eng._read(step, [toks[0] for toks in tokens])
    eng.stats.steps += len(tokens[0]) - 1
    eng.stats.burst_steps += len(tokens[0]) - 1
    return ran._replace(burst=tokens)
