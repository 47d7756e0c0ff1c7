"""Qwen2 (biases on q/k/v): a tiny random checkpoint written by transformers, parity through
the compiled path."""
import pytest
import torch

import deepfuse
from deepfuse.models import load_model
from tests.helpers import greedy_with, hf_greedy


@pytest.mark.parametrize("windows", [{}, {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
                                     {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}],
                         ids=["full", "window-in-no-layer", "window-in-every-layer"])
def test_qwen2_parity_with_transformers(tmp_path, windows):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False, **windows)).eval()
    with torch.no_grad():  # transformers initialises biases to 0: make them matter
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    assert model.config.qkv_bias and not model.config.o_bias
    assert model.config.sliding_window == (4 if windows.get("max_window_layers") == 0 else 0)
    art = deepfuse.compile(model)
    assert art.graph.op_counts()["add_bias"] == 3 * 2
    prompt = [5, 17, 99, 3, 42, 7]
    want, want_logits = hf_greedy(hf, prompt, 16)
    got, logits = greedy_with(art, model.config, prompt, 16)
    assert got == want
    assert (logits[0] - want_logits).abs().max().item() <= 1e-4


def qwen2_dict(**kw) -> dict:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, **kw).to_dict()


def test_qwen2_windows_follow_max_window_layers():
    """Qwen2 slides only in layers from max_window_layers on: none of them (full attention),
    all of them (one window), or some (hybrid: refused, not silently windowed everywhere)."""
    from deepfuse.errors import DeepfuseError
    from deepfuse.models.hf_loader import config_from_hf

    assert config_from_hf(qwen2_dict()).sliding_window == 0
    assert config_from_hf(qwen2_dict(use_sliding_window=True, sliding_window=64, max_window_layers=4)).sliding_window == 0
    assert config_from_hf(qwen2_dict(use_sliding_window=True, sliding_window=64, max_window_layers=0)).sliding_window == 64
    cfg = qwen2_dict(use_sliding_window=True, sliding_window=64, max_window_layers=2)
    with pytest.raises(DeepfuseError, match="mix sliding-window and full-attention layers"):
        config_from_hf(cfg)
    cfg.pop("layer_types")  # as an older transformers wrote it: derived from max_window_layers
    with pytest.raises(DeepfuseError, match="mix sliding-window and full-attention layers"):
        config_from_hf(cfg)


def test_configs_whose_arithmetic_the_model_lacks_are_refused_by_name():
    from deepfuse.errors import DeepfuseError
    from deepfuse.models.hf_loader import config_from_hf

    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 8192, "rope_theta": 500000.0}
    for change, field in [({"hidden_act": "gelu_pytorch_tanh"}, "hidden_act"),
                          ({"rope_parameters": llama3}, "rope scaling 'llama3'"),
                          ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}}, "rope scaling 'linear'"),
                          ({"mlp_bias": True}, "mlp_bias"), ({"partial_rotary_factor": 0.5}, "partial_rotary_factor")]:
        with pytest.raises(DeepfuseError, match=field):
            config_from_hf({**qwen2_dict(), **change})
