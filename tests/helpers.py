"""Test helpers: run a step function greedily over a fresh paged cache."""
from __future__ import annotations

import torch

from deepfuse.ir import DTYPES
from deepfuse.models import step_specs
from deepfuse.models.cache_groups import cache_groups
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache


def greedy_with(step, config, prompt: list[int], n: int, dtype=torch.float32, block_size: int = 4, kv=None):
    """step(inputs: dict) -> (logits, next, hidden). Returns (tokens, first-step logits).
    kv: the cache inputs' TensorType where it is not [.., head_dim] of `dtype` (an int8 cache)."""
    row, dtype = (kv.shape[4], DTYPES[kv.dtype]) if kv is not None else (config.head_dim, dtype)
    cache = KVCache(config.num_layers, config.num_kv_heads, row, dtype, CacheConfig(block_size=block_size, num_blocks=256),
                    getattr(step, "device", "cpu"), cache_groups(config))
    seq, blocks, start, out, first = list(prompt), [], 0, [], None
    for _ in range(n):
        logits, nxt, _ = step(build_step([SeqChunk(seq[start:], start, blocks)], cache))
        first = logits if first is None else first
        start = len(seq)
        seq.append(int(nxt[0]))
        out.append(int(nxt[0]))
    return out, first


def sampled_with(step, config, prompts: list[list[int]], n: int, params: list[dict], block_size: int = 16) -> list[list[int]]:
    """Seeded sampled decoding of several sequences in one batch: params[i] holds SeqChunk's
    temperature/top_k/top_p/seed for prompts[i]. step as greedy_with. Returns each one's n tokens."""
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, torch.float32,
                    CacheConfig(block_size=block_size, num_blocks=64), getattr(step, "device", "cpu"),
                    cache_groups(config))
    per = -(-(max(map(len, prompts)) + n) // block_size)
    seqs, starts, out = [list(p) for p in prompts], [0] * len(prompts), [[] for _ in prompts]
    for _ in range(n):
        chunks = [SeqChunk(s[st:], st, list(range(i * per, (i + 1) * per)), **p)
                  for i, (s, st, p) in enumerate(zip(seqs, starts, params))]
        _, nxt, _ = step(build_step(chunks, cache))
        for i, s in enumerate(seqs):
            starts[i] = len(s)
            s.append(int(nxt[i]))
            out[i].append(int(nxt[i]))
    return out


def forced_logits(step, config, prompt: list[int], continuation: list[int], dtype=torch.float32,
                  block_size: int = 4, kv=None) -> torch.Tensor:
    """Logits f32 [len(continuation), V] of a prefill of `prompt` and then one decode step per
    token of `continuation` but the last, over a fresh paged cache: row i predicts continuation[i]
    (teacher forcing, so runs of different precisions see the same tokens). kv: as greedy_with."""
    row, dtype = (kv.shape[4], DTYPES[kv.dtype]) if kv is not None else (config.head_dim, dtype)
    cache = KVCache(config.num_layers, config.num_kv_heads, row, dtype, CacheConfig(block_size=block_size, num_blocks=256),
                    getattr(step, "device", "cpu"), cache_groups(config))
    seq, blocks, start, out = list(prompt), [], 0, []
    for tok in continuation:
        logits, _, _ = step(build_step([SeqChunk(seq[start:], start, blocks)], cache))
        out.append(logits[0].float())
        start = len(seq)
        seq.append(tok)
    return torch.stack(out)


def hf_forced_logits(hf_model, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """forced_logits through transformers' own forward and its KV cache."""
    ids, past, out = torch.tensor([prompt]), None, []
    with torch.no_grad():
        for tok in continuation:
            res = hf_model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            out.append(res.logits[0, -1].float())
            ids = torch.tensor([[tok]])
    return torch.stack(out)


def eager_step(model):
    names = [s.name for s in step_specs(model.config, "f32")]
    return lambda inputs: model.step(*[inputs[k] for k in names])


def hf_greedy(hf_model, prompt: list[int], n: int):
    """transformers' own forward, greedy, EOS not special. Returns (tokens, first-step logits [V])."""
    ids = torch.tensor([prompt])
    out, first, past = [], None, None
    with torch.no_grad():
        for _ in range(n):
            res = hf_model(ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[0, -1]
            first = logits if first is None else first
            nxt = int(logits.argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out, first


def with_sinks(model, window: int = 0, seed: int = 0):
    """The model with gpt-oss-style learned attention sinks (random logits, N(0, 2^2) per head)
    and optionally a sliding window."""
    import dataclasses

    from deepfuse.models import Llama

    c = dataclasses.replace(model.config, attention_sinks=True, sliding_window=window)
    gen = torch.Generator().manual_seed(seed)
    sinks = {f"model.layers.{i}.self_attn.sinks": 2 * torch.randn(c.num_heads, generator=gen)
             for i in range(c.num_layers)}
    return Llama(c, {**model.weights, **sinks})


def scheduled_preemptions(prompt_lens: list[int], max_tokens: int, block_size: int, num_blocks: int,
                          max_num_tokens: int = 512, max_num_seqs: int = 64) -> list[int]:
    """Each request's preemptions under the scheduler's documented policy (runtime/scheduler.py's
    docstring), computed here from the workload alone: prefix caching off, every request running
    to max_tokens (ignore_eos). Each step, running requests first, oldest first, each taking what
    is left of its prompt (or one token) within the token budget; one that needs a block when none
    is free preempts the most recently admitted running request (itself when it is the last): its
    blocks are freed and it goes back to the front of the queue, to recompute its prompt and
    generated tokens. Then, in a step without a preemption, waiting requests are admitted first come
    first served while budget, sequence slots and blocks allow. A request whose KV covers t
    positions holds ceil(t / block_size) blocks; one whose chunk ends its known tokens samples one."""
    n_req = len(prompt_lens)
    length = list(prompt_lens)  # prompt + generated
    generated, computed, held, preempted = [0] * n_req, [0] * n_req, [0] * n_req, [0] * n_req
    waiting, running = list(range(n_req)), []
    blocks = lambda t: -(-t // block_size)  # noqa: E731
    free = lambda: num_blocks - sum(held)  # noqa: E731

    def preempt(r: int) -> None:
        running.remove(r)
        held[r], computed[r] = 0, 0
        preempted[r] += 1
        waiting.insert(0, r)

    while waiting or running:
        budget, step, stopped = max_num_tokens, [], False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(length[r] - computed[r], budget)
            while blocks(computed[r] + n) - held[r] > free() and running[-1] != r:
                preempt(running[-1])
                stopped = True
            if blocks(computed[r] + n) - held[r] > free():
                preempt(r)
                stopped = True
                break
            held[r] = max(held[r], blocks(computed[r] + n))
            step.append((r, n))
            budget -= n
            i += 1
        while not stopped and waiting and budget > 0 and len(running) < max_num_seqs:
            r = waiting[0]
            n = min(length[r], budget)
            if blocks(n) > free():
                break
            held[r] = blocks(n)
            running.append(waiting.pop(0))
            step.append((r, n))
            budget -= n
        assert step, "the workload cannot run in this cache"
        for r, n in step:
            computed[r] += n
            if computed[r] == length[r]:  # its chunk ended its known tokens: it samples the next one
                generated[r] += 1
                length[r] += 1
                if generated[r] == max_tokens:
                    running.remove(r)
                    held[r] = 0
    return preempted


def ngram_spec_counts(prompt: list[int], output: list[int], k: int, max_tokens: int, max_ngram: int = 4,
                      min_ngram: int = 1) -> dict:
    """What n-gram speculation with a fixed schedule must verify for a request whose tokens are
    `output` (the same with and without drafts), computed from the documented rules alone
    (runtime/spec.py): after its prefill each decoding step looks up the longest suffix of the
    sequence (max_ngram down to min_ngram tokens) that occurred earlier in it, and drafts the
    tokens that followed its latest earlier occurrence, at most min(k, max_tokens - generated - 1);
    the step keeps the drafts that equal the target's own tokens, up to the first that does not,
    and the target's token after them. Returns verifications, drafted, accepted and decode steps."""
    seq, gen = list(prompt), 1  # the prefill step samples output[0]
    seq.append(output[0])
    counts = dict(verifications=0, drafted=0, accepted=0, decode_steps=0)
    while gen < len(output):
        room = min(k, max_tokens - gen - 1)
        draft = []
        for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1) if room > 0 else ():
            earlier = [s for s in range(len(seq) - n) if seq[s:s + n] == seq[-n:]]
            if earlier:
                draft = seq[earlier[-1] + n:earlier[-1] + n + room]
                break
        accepted = 0
        while accepted < len(draft) and gen + accepted < len(output) and draft[accepted] == output[gen + accepted]:
            accepted += 1
        if draft:
            counts["verifications"] += 1
            counts["drafted"] += len(draft)
            counts["accepted"] += accepted
        counts["decode_steps"] += 1
        take = output[gen:gen + accepted + 1]
        seq += take
        gen += len(take)
    return counts


def check_spec_accounting(eng, outs, k: int) -> None:
    """Speculation's counts add up: the engine's are the requests' sums, some drafts were
    verified, at most k a verification, none kept that was not verified, and a request that ran to
    max_tokens gained its prefill's token plus, per verification, its kept drafts and one more."""
    stats = [o.metrics.spec for o in outs]
    assert eng.spec_stats.verifications == sum(s.verifications for s in stats) > 0
    assert eng.spec_stats.drafted == sum(s.drafted for s in stats)
    assert eng.spec_stats.accepted == sum(s.accepted for s in stats)
    for o, s in zip(outs, stats):
        assert s.verifications <= s.drafted <= k * s.verifications and s.accepted <= s.drafted
        if o.outputs[0].finish_reason == "length":
            assert len(o.outputs[0].token_ids) >= 1 + s.verifications + s.accepted


def tiny_gemma3(seed: int = 0):
    """A tiny random Gemma 3 (tied head, two sliding layers of window 4 and one full layer, q/k
    norms), weights drawn here: norm multipliers around 1, projections and embeddings ~0.2."""
    from deepfuse.models import Gemma3, Gemma3Config

    cfg = Gemma3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=2, num_kv_heads=1,
                       head_dim=32, rope_theta=1e6, rope_local_theta=10.0, rms_norm_eps=1e-6, max_position=128,
                       query_pre_attn_scalar=24.0, sliding_window=4, full_attention_layers=(2,))
    shapes = {"model.embed_tokens.weight": (96, 64), "model.norm.weight": (64,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + n + ".weight": (64,) for n in ("input_layernorm", "post_attention_layernorm",
                                                           "pre_feedforward_layernorm", "post_feedforward_layernorm")})
        shapes.update({p + "self_attn.q_norm.weight": (32,), p + "self_attn.k_norm.weight": (32,),
                       p + "self_attn.q_proj.weight": (64, 64), p + "self_attn.k_proj.weight": (32, 64),
                       p + "self_attn.v_proj.weight": (32, 64), p + "self_attn.o_proj.weight": (64, 64),
                       p + "mlp.gate_proj.weight": (96, 64), p + "mlp.up_proj.weight": (96, 64),
                       p + "mlp.down_proj.weight": (64, 96)})
    g = torch.Generator().manual_seed(seed)
    return Gemma3(cfg, {k: (1 + 0.2 * torch.randn(s, generator=g)) if len(s) == 1 else 0.2 * torch.randn(s, generator=g)
                        for k, s in shapes.items()})
