"""Shared fixtures: a tiny random Llama (saved as a HF checkpoint) and the real SmolLM2."""
from __future__ import annotations

import os

# Triton reads this once, at import: its kernels run in the CPU interpreter in this test process
# (Triton's own debug switch; AOT compiles run in child processes without it)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import deepfuse  # noqa: E402
from deepfuse.models import load_model  # noqa: E402


def tiny_hf_config(**over):
    from transformers import LlamaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(over)
    return LlamaConfig(**kw)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random-weight Llama checkpoint directory written by transformers."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_hf_config()).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    model, _ = load_model(tiny_dir, with_tokenizer=False)
    return model


@pytest.fixture(scope="session")
def smollm2():
    """(Llama, Tokenizer) of the embedded SmolLM2-135M-Instruct, fp32."""
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_compiled(smollm2):
    model, tok = smollm2
    return deepfuse.compile(model, target="cpu", tokenizer=tok)


@pytest.fixture(scope="session")
def native():
    """The native CPU kernels' module (codegen/cpu/native.py); skips where it cannot be built."""
    from deepfuse.codegen.cpu.native import kernels

    mod = kernels()
    if mod is None:
        pytest.skip("no C++ compiler here")
    return mod
