"""Batch-invariant CPU kernels: the attention kernel told so gives a prompt's rows the same
bits whether the prompt comes whole, in chunks, or row by row beside other sequences; an int4
projection told to use one kernel gives each row the same bits at every row count; and where
that cannot be promised, compiling or loading says why."""
import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.models import load_model

H, HKV, BS, NB = 9, 3, 16, 96  # SmolLM2's heads; a cache of 96 blocks of 16


def run_chunks(kernel, q, k, v, chunks, tables, d, dtype):
    """Runs the attention kernel once per step; `chunks` lists each step's (sequence, first
    position, rows) entries. Returns every sequence's output rows, in position order."""
    cache = torch.zeros(2, NB, BS, HKV, d, dtype=dtype)
    got = {s: {} for s in range(len(q))}
    for step in chunks:
        rows = [(s, p) for s, p0, n in step for p in range(p0, p0 + n)]
        qs, ks, vs = (torch.stack([t[s][p] for s, p in rows]) for t in (q, k, v))
        slots = torch.tensor([int(tables[s, p // BS]) * BS + p % BS for s, p in rows])
        step_tables = torch.stack([tables[s] for s, _, _ in step])
        seq_lens = torch.tensor([p0 + n for _, p0, n in step])
        query_lens = torch.tensor([n for _, _, n in step])
        out = kernel(qs, ks, vs, cache, slots, step_tables, seq_lens, query_lens)
        for (s, p), o in zip(rows, out):
            got[s][p] = o
    return [torch.stack([got[s][p] for p in sorted(got[s])]) for s in got if got[s]]


@pytest.mark.parametrize("dtype,d,window", [(torch.bfloat16, 64, 0), (torch.bfloat16, 64, 100),
                                            (torch.float32, 64, 0), (torch.bfloat16, 128, 0)])
def test_attention_rows_do_not_depend_on_chunking_or_company(native, dtype, d, window):
    from deepfuse.codegen.cpu.kernels import FACTORIES
    from deepfuse.ir.opdefs_llm import attention as reference_attention

    torch.manual_seed(0)
    lens = [700, 100]  # the prompt under test, and a second sequence that shares some steps
    q = [torch.randn(n, H * d).to(dtype) for n in lens]
    k = [torch.randn(n, HKV * d).to(dtype) for n in lens]
    v = [torch.randn(n, HKV * d).to(dtype) for n in lens]
    tables = torch.randperm(NB)[:2 * 48].view(2, 48)
    attrs = dict(num_heads=H, num_kv_heads=HKV, head_dim=d, scale=d ** -0.5, window=window, batch_invariant=True)
    kernel = FACTORIES["attention"](attrs)
    whole = run_chunks(kernel, q, k, v, [[(0, 0, 700)]], tables, d, dtype)[0]
    steps = [[(0, 0, 300), (1, 0, 90)], [(0, 300, 257), (1, 90, 1)], [(0, 557, 16), (1, 91, 9)], [(0, 573, 1)],
             [(0, 574, 126)]]  # a long chunk, a short one, a single row (decode-like), the rest
    chunked = run_chunks(kernel, q, k, v, steps, tables, d, dtype)[0]
    assert torch.equal(whole, chunked)
    # and it is attention: the IR's reference on the whole prompt
    cache = torch.zeros(2, NB, BS, HKV, d, dtype=dtype)
    slots = torch.tensor([int(tables[0, p // BS]) * BS + p % BS for p in range(700)])
    want = reference_attention(q[0], k[0], v[0], cache, slots, tables[:1], torch.tensor([700]), torch.tensor([700]),
                               **{a: b for a, b in attrs.items() if a != "batch_invariant"})
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(whole.float(), want.float(), atol=tol, rtol=tol)


def test_int4_projection_rows_do_not_depend_on_the_row_count(native):
    from deepfuse.codegen.cpu.packed_weights import Q4Weights, q4_linear

    if not native.bf16_gemm_available():
        pytest.skip("neither AMX nor AVX512-BF16 on this machine: bf16 batch invariance is refused here")
    torch.manual_seed(0)
    n, kdim = 96, 256
    packed = torch.randint(0, 256, (n, kdim // 2), dtype=torch.uint8)
    scales, mins = torch.rand(n, kdim // 32) * 0.02, -torch.rand(n, kdim // 32) * 0.1
    w = Q4Weights(torch.bfloat16, packed, scales, mins, one_kernel=True)
    x = torch.randn(40, kdim).bfloat16()
    full = q4_linear(x, w)
    for rows in (1, 2, 3, 5, 17):
        assert torch.equal(q4_linear(x[:rows], w), full[:rows]), rows
    from deepfuse.ir.opdefs_quant import dequantize_q4

    want = x.float() @ dequantize_q4(packed, scales, mins).bfloat16().float().t()
    torch.testing.assert_close(full.float(), want, atol=2e-2, rtol=2e-2)


def test_batch_invariance_is_refused_where_it_cannot_hold(tiny_model):
    with pytest.raises(DeepfuseError, match="not 'ascend950'"):
        deepfuse.compile(tiny_model, target="ascend950", batch_invariant=True)


def test_batch_invariance_is_refused_for_moe(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64)
    ).eval().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    with pytest.raises(DeepfuseError, match="MoE layers group tokens by expert"):
        deepfuse.compile(model, batch_invariant=True)


def test_llm_refuses_an_artifact_compiled_without_it(tiny_model, tmp_path):
    from deepfuse.runtime.llm import LLM

    deepfuse.compile(tiny_model).save(str(tmp_path))
    with pytest.raises(DeepfuseError, match="compiled without batch invariance"):
        LLM(artifact=str(tmp_path), batch_invariant=True)
