"""Qwen2 (biases on q/k/v): a tiny random checkpoint written by transformers, parity through
the compiled path."""
import torch

import deepfuse
from deepfuse.models import load_model
from tests.helpers import greedy_with, hf_greedy


def test_qwen2_parity_with_transformers(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)).eval()
    with torch.no_grad():  # transformers initialises biases to 0: make them matter
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    assert model.config.qkv_bias and not model.config.o_bias
    art = deepfuse.compile(model)
    assert art.graph.op_counts()["add_bias"] == 3 * 2
    prompt = [5, 17, 99, 3, 42, 7]
    want, want_logits = hf_greedy(hf, prompt, 16)
    got, logits = greedy_with(art, model.config, prompt, 16)
    assert got == want
    assert (logits[0] - want_logits).abs().max().item() <= 1e-4
