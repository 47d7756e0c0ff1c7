"""benchmarks/bound.py: its count of the throughput workload's multiply-adds against torch's own
flop counter over a transformers Llama, and its peak microbenchmark builds and runs."""
import os
import sys
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import bound  # noqa: E402


def small_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_projection_and_head_counts_equal_torch_flop_counter():
    """One request of p prompt tokens and k outputs feeds p + k - 1 tokens through the model and
    takes k rows of logits: transformers' forward over those tokens keeping k logits does the
    same matrix products (torch counts 2 flops a multiply-add; attention runs in SDPA, apart)."""
    from torch.utils.flop_counter import FlopCounterMode

    hf = small_llama()
    c = hf.config
    ours = bound.workload_macs(
        SimpleNamespace(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_layers=c.num_hidden_layers,
                        num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        vocab_size=c.vocab_size), [11], 5)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        hf(torch.arange(11 + 5 - 1)[None], logits_to_keep=5)
    counts = counter.get_flop_counts()["Global"]
    products = sum(v for op, v in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    assert products == 2 * (ours["projections"] + ours["lm_head"])


def test_attention_pairs_by_enumeration():
    config = SimpleNamespace(hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                             vocab_size=10)
    prompts, out = [3, 7, 1], 4
    pairs = sum(1 for p in prompts for query in range(p + out - 1) for key in range(query + 1))
    assert bound.workload_macs(config, prompts, out)["attention"] == pairs * 2 * 2 * (2 * 4)


def cpu_has(*flags: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            have = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return all(flag in have for flag in flags)


@pytest.mark.skipif(not cpu_has("avx512_bf16", "avx512_vnni"), reason="peak.cpp needs AVX512-BF16 and VNNI")
def test_peak_microbenchmark_builds_and_reports_both_instructions():
    peaks = bound.instruction_peaks(threads=1, iterations=200_000)
    assert set(peaks) == {"bf16", "int8"} and all(rate > 0 for rate in peaks.values())
