"""A tiny random Gemma 3 (eager) against transformers' Gemma3ForCausalLM on the same weights:
sliding and full layers, their two RoPE bases, query_pre_attn_scalar, final logit softcapping."""
import pytest
import torch

from deepfuse.models import Gemma3, Gemma3Config
from tests.helpers import eager_step, greedy_with, hf_greedy

WINDOW = 4


@pytest.fixture(scope="module")
def pair():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf_cfg = Gemma3TextConfig(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], final_logit_softcapping=3.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # norms start at zero: give them values so (1 + w) is checked
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    sd = hf.state_dict()
    weights = {k: (v + 1 if k.endswith("norm.weight") else v).clone() for k, v in sd.items() if k != "lm_head.weight"}
    cfg = Gemma3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=2, num_kv_heads=1,
                       head_dim=32, rope_theta=1e6, rope_local_theta=10.0, rms_norm_eps=1e-6, max_position=128,
                       query_pre_attn_scalar=24.0, sliding_window=WINDOW, full_attention_layers=(2,),
                       final_logit_softcap=3.0)
    return hf, Gemma3(cfg, weights)


def test_tiny_gemma3_matches_transformers(pair):
    hf, model = pair
    prompt = [int(t) for t in torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(1))]
    want, want_logits = hf_greedy(hf, prompt, 8)
    got, logits = greedy_with(eager_step(model), model.config, prompt, 8)
    assert logits[0].abs().max().item() <= 3.0  # the softcap holds
    assert (logits[0] - want_logits).abs().max().item() <= 1e-4
    assert got == want


def test_wrong_window_or_scale_differs(pair):
    """The comparison above can fail: one-off window or Llama's scale change the logits."""
    import dataclasses

    hf, model = pair
    prompt = list(range(3, 14))
    _, want_logits = hf_greedy(hf, prompt, 1)
    for change in ({"sliding_window": WINDOW + 1}, {"query_pre_attn_scalar": 32.0}):
        other = Gemma3(dataclasses.replace(model.config, **change), model.weights)
        _, logits = greedy_with(eager_step(other), other.config, prompt, 1)
        assert (logits[0] - want_logits).abs().max().item() > 1e-3, change
