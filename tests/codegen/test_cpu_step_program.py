"""Native step programs (codegen/cpu/program.py, program.cpp): a bound decode step runs as one
native call, and every step gives bit for bit what the executor's own Python loop gives (the
kernels' Python dispatch, binding off), for decode and mixed prefill/decode steps."""
import pytest
import torch

import deepfuse
from deepfuse.codegen.cpu.bound import StepBinder
from deepfuse.codegen.cpu.program import NativeGuard, NativeOp
from deepfuse.ir import DTYPES
from deepfuse.runtime.batch import SeqChunk, StepBuffers
from deepfuse.runtime.kv_cache import CacheConfig, KVCache

BUILDS = {"f32": ("f32", None, None), "bf16": ("bf16", None, None), "int4": ("bf16", "int4", None),
          "w8a8-kv8": ("bf16", "w8a8", "int8"), "int4-a8": ("bf16", "int4-a8", None)}


def compiled(tiny_model, native, kind: str):
    if kind in ("w8a8-kv8", "int4-a8") and not (native.i8_gemm_available() and native.q4a8_gemm_available()):
        pytest.skip("this CPU has no AVX512-VNNI")
    dtype, quant, kv = BUILDS[kind]
    return deepfuse.compile(tiny_model, dtype=dtype, quant=quant, kv_cache_dtype=kv)


def run_step(art, buffers, cache, chunks, bound: bool) -> list[torch.Tensor]:
    """The step's outputs (copied), through the native program (bound) or the executor's loop."""
    runner = art.runner
    kept = runner.binder
    runner.binder = kept if bound else None
    try:
        return [t.clone() for t in art(buffers.fill(chunks, cache)) if isinstance(t, torch.Tensor)]
    finally:
        runner.binder = kept


def kv_cache(art) -> KVCache:
    """A cache of the build's KV layout (as the engine makes it)."""
    c, kv = art.config, art.kv_cache_type
    return KVCache(c.num_layers, c.num_kv_heads, kv.shape[4], DTYPES[kv.dtype], CacheConfig(block_size=4, num_blocks=32))


@pytest.mark.parametrize("kind", list(BUILDS))
def test_decode_steps_run_as_one_native_call_and_equal_the_executor_loop(tiny_model, native, kind):
    art = compiled(tiny_model, native, kind)
    art.runner.binder = StepBinder()
    cache = kv_cache(art)
    buffers = StepBuffers(16, 4, 8)
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    prompts = [[5, 9, 17], [44, 2, 8], [7, 7, 1]]
    run_step(art, buffers, cache, [SeqChunk(p, 0, b) for p, b in zip(prompts, blocks)], bound=False)
    for step in range(5):
        tokens = [(3 * step + i) % 100 + 1 for i in range(3)]
        chunks = [SeqChunk([t], 3 + step, b) for t, b in zip(tokens, blocks)]
        got = run_step(art, buffers, cache, chunks, bound=True)
        want = run_step(art, buffers, cache, chunks, bound=False)  # rewrites the same cache rows
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    (prefix,) = art.runner.binder.cache.values()
    assert prefix.count >= len(art.runner.launches) - 5  # all but the sampling tail
    assert all(isinstance(c, NativeOp) for c in prefix.calls)
    assert (prefix.segments.programs, prefix.segments.python_calls) == (1, 0)  # one native call


@pytest.mark.parametrize("kind", list(BUILDS))
def test_mixed_prefill_and_decode_steps_equal_the_executor_loop(tiny_model, native, kind):
    art = compiled(tiny_model, native, kind)
    art.runner.binder = StepBinder()
    cache = kv_cache(art)
    buffers = StepBuffers(16, 4, 8)
    blocks = [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    run_step(art, buffers, cache, [SeqChunk([5, 9, 17, 4], 0, blocks[0])], bound=False)
    for new in ([3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7]):  # one decode row and two prompt chunks
        chunks = [SeqChunk([11], 4, blocks[0]), SeqChunk(new, 0, blocks[1]), SeqChunk(new[:2], 0, blocks[2])]
        got = run_step(art, buffers, cache, chunks, bound=True)
        want = run_step(art, buffers, cache, chunks, bound=False)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert any(p.count for p in art.runner.binder.cache.values())  # the launches before attention ran bound


def test_a_failed_guard_runs_nothing(native):
    prog = native.StepProgram()
    pos, out = torch.tensor([3, 9], dtype=torch.long), torch.zeros(2, 4)
    prog.guard_below(pos, 10)
    prog.add(torch.ones(2, 4), torch.ones(2, 4), out)
    assert prog.run() and torch.equal(out, torch.full((2, 4), 2.0))
    out.zero_()
    pos[1] = 10
    assert not prog.run() and not out.any()
    assert not NativeGuard(pos, 10)() and NativeGuard(pos, 11)()


def test_the_spec_verify_kernel_equals_its_reference():
    from deepfuse.codegen.cpu.kernels import make_kernel
    from deepfuse.ir import OPS

    kernel, ref = make_kernel("spec_verify", {}), OPS["spec_verify"].reference
    g = torch.Generator().manual_seed(0)
    for r in range(0, 12):
        tokens = torch.randint(0, 3, (r,), generator=g)
        for drafts in (torch.full((r,), -1), torch.where(torch.rand(r, generator=g) < 0.3, -1,
                                                         torch.randint(0, 3, (r,), generator=g))):
            assert torch.equal(kernel(tokens, drafts), ref(tokens, drafts))
