"""Bound steps (codegen/cpu/bound.py): a step whose inputs have an earlier step's layout runs that
step's launches as bound calls, and gives exactly what the executor's own loop gives."""
import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu.bound import StepBinder
from deepfuse.codegen.cpu.kernels import rope_tables
from deepfuse.runtime.batch import SeqChunk, StepBuffers
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig, KVCache

PROMPTS = [[5, 9, 17, 3], [44, 2], [7, 7, 7, 8, 1, 60], [100]]


def with_binding(art, on: bool):
    """Fresh bindings (or none) for a compiled model's executor."""
    art.runner.binder = StepBinder() if on else None
    return art


@pytest.mark.parametrize("temperature", [0.9, 0.0])
@pytest.mark.parametrize("kind", ["f32", "bf16", "int4", "w8a8-kv8"])
def test_bound_steps_generate_the_tokens_of_the_executor_loop(tiny_model, native, kind, temperature):
    """Sampled rows and greedy ones: the whole step bound (the LM head and the sampler in the
    program) where the head's GEMM is native, else up to the sampling tail."""
    if kind == "w8a8-kv8" and not native.i8_gemm_available():
        pytest.skip("this CPU has no AVX512-VNNI")
    dtype, quant = {"f32": ("f32", None), "bf16": ("bf16", None), "int4": ("bf16", "int4"),
                    "w8a8-kv8": ("bf16", "w8a8")}[kind]
    art = deepfuse.compile(tiny_model, dtype=dtype, quant=quant, kv_cache_dtype="int8" if "kv8" in kind else None)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=12 + 3 * i, ignore_eos=True)
              for i in range(4)]
    runs = []
    for on in (True, False):
        eng = Engine(with_binding(art, on), CacheConfig(block_size=4, num_blocks=64), max_num_tokens=8)
        runs.append([o.outputs[0].token_ids for o in eng.generate(PROMPTS, params)])
        if on:  # decode steps ran bound, at least up to the sampling tail
            counts = [p.count for p in art.runner.binder.cache.values()]
            assert max(counts) >= len(art.runner.launches) - 5
            if kind in ("f32", "w8a8-kv8") or native.bf16_gemm_available():
                assert max(counts) == len(art.runner.launches)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("quant", [None, "int4-head"])
def test_gemma3_decode_steps_bind_and_match_the_executor_loop(native, quant):
    """A model with q/k head norms and sliding windows (tiny Gemma 3): its decode steps bind at
    least up to the sampling tail (head norms, plain and added norms included) and give the loop's tokens."""
    from tests.helpers import tiny_gemma3

    art = deepfuse.compile(tiny_gemma3(), dtype="bf16", quant=quant)
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=12 + 3 * i, ignore_eos=True) for i in range(4)]
    runs = []
    for on in (True, False):
        eng = Engine(with_binding(art, on), CacheConfig(block_size=4, num_blocks=64), max_num_tokens=8)
        runs.append([o.outputs[0].token_ids for o in eng.generate(PROMPTS, params)])
        if on:
            counts = [p.count for p in art.runner.binder.cache.values()]
            assert max(counts) >= len(art.runner.launches) - 6
    assert runs[0] == runs[1]


def decode_step(art, buffers, cache, tokens, starts, blocks):
    """Logits of one decode step (one token per sequence) through the engine's step buffers."""
    chunks = [SeqChunk([t], s, b) for t, s, b in zip(tokens, starts, blocks)]
    return art(buffers.fill(chunks, cache))[0].clone()


def test_a_bound_step_reads_its_inputs_new_contents(tiny_model, native):
    art = deepfuse.compile(tiny_model)
    c = tiny_model.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(block_size=4, num_blocks=16))
    buffers = StepBuffers(8, 4, 8)
    blocks = [[0, 1], [2, 3]]
    for step, (tokens, starts) in enumerate([([3, 4], [0, 0]), ([5, 6], [1, 1]), ([7, 8], [2, 5]), ([9, 1], [3, 6])]):
        got = decode_step(with_binding(art, True) if step == 0 else art, buffers, cache, tokens, starts, blocks)
        binder = art.runner.binder
        art.runner.binder = None
        want = decode_step(art, buffers, cache, tokens, starts, blocks)  # rewrites the same cache rows
        art.runner.binder = binder
        assert torch.equal(got, want)
    assert len(binder.cache) == 1  # one layout, bound once


def test_a_step_with_the_same_shapes_but_prompt_chunks_is_not_bound_past_attention(tiny_model, native):
    art = with_binding(deepfuse.compile(tiny_model), True)
    c = tiny_model.config
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(block_size=4, num_blocks=16))
    buffers = StepBuffers(8, 4, 8)
    first = [p["op"] for p in art.plan["launches"]].index("qkv_attention")
    for lens in ([3, 1], [2, 2], [1, 3]):  # 4 tokens of 2 sequences each time: one layout
        chunks = [SeqChunk(list(range(1, n + 1)), 0, b) for n, b in zip(lens, [[0], [1]])]
        got = art(buffers.fill(chunks, cache))[0].clone()
        art.runner.binder, binder = None, art.runner.binder
        want = art(buffers.fill(chunks, cache))[0]
        art.runner.binder = binder
        assert torch.equal(got, want)
    (prefix,) = binder.cache.values()
    assert prefix.count == first


def test_positions_past_the_bound_rope_tables_bind_again(tiny_model, native):
    art = with_binding(deepfuse.compile(tiny_model), True)
    c = tiny_model.config
    tables = rope_tables(c.head_dim, c.rope_theta)
    far = max(t[0].shape[0] for t in tables.full.values()) + 3 if tables.full else 4100
    nb = far // 4 + 1
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(block_size=4, num_blocks=nb))
    buffers = StepBuffers(8, 4, nb)
    blocks = [list(range(nb))]  # the same table width near and far: the same layout
    decode_step(art, buffers, cache, [3], [10], blocks)
    decode_step(art, buffers, cache, [4], [11], blocks)
    (prefix,) = art.runner.binder.cache.values()
    assert prefix.guards and all(check() for check in prefix.guards)  # the rope tables' rows: 11 is inside
    got = decode_step(art, buffers, cache, [5], [far], blocks)
    assert max(t[0].shape[0] for t in tables.full.values()) > far  # bound again on grown tables
    art.runner.binder = None
    assert torch.equal(got, decode_step(art, buffers, cache, [5], [far], blocks))
