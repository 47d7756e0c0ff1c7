"""Test helpers: run a step function greedily over a fresh paged cache."""
from __future__ import annotations

import torch

from deepfuse.ir import DTYPES
from deepfuse.models import step_specs
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache


def greedy_with(step, config, prompt: list[int], n: int, dtype=torch.float32, block_size: int = 4, kv=None):
    """step(inputs: dict) -> (logits, next, hidden). Returns (tokens, first-step logits).
    kv: the cache inputs' TensorType where it is not [.., head_dim] of `dtype` (an int8 cache)."""
    row, dtype = (kv.shape[4], DTYPES[kv.dtype]) if kv is not None else (config.head_dim, dtype)
    cache = KVCache(config.num_layers, config.num_kv_heads, row, dtype, CacheConfig(block_size=block_size, num_blocks=256),
                    getattr(step, "device", "cpu"))
    seq, blocks, start, out, first = list(prompt), [], 0, [], None
    for _ in range(n):
        logits, nxt, _ = step(build_step([SeqChunk(seq[start:], start, blocks)], cache))
        first = logits if first is None else first
        start = len(seq)
        seq.append(int(nxt[0]))
        out.append(int(nxt[0]))
    return out, first


def forced_logits(step, config, prompt: list[int], continuation: list[int], dtype=torch.float32,
                  block_size: int = 4, kv=None) -> torch.Tensor:
    """Logits f32 [len(continuation), V] of a prefill of `prompt` and then one decode step per
    token of `continuation` but the last, over a fresh paged cache: row i predicts continuation[i]
    (teacher forcing, so runs of different precisions see the same tokens). kv: as greedy_with."""
    row, dtype = (kv.shape[4], DTYPES[kv.dtype]) if kv is not None else (config.head_dim, dtype)
    cache = KVCache(config.num_layers, config.num_kv_heads, row, dtype, CacheConfig(block_size=block_size, num_blocks=256),
                    getattr(step, "device", "cpu"))
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
