"""A tiny random Llama: parity with transformers, and every execution mode agrees."""
import torch

import deepfuse
from deepfuse.compiler import trace_model
from deepfuse.ir import interpret
from tests.helpers import eager_step, greedy_with
from tests.helpers import hf_greedy as hf_greedy_loop

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def hf_greedy(tiny_dir, n):
    from transformers import LlamaForCausalLM

    return hf_greedy_loop(LlamaForCausalLM.from_pretrained(tiny_dir).eval(), PROMPT, n)


def test_parity_with_transformers_through_compiled_path(tiny_dir, tiny_model):
    art = deepfuse.compile(tiny_model, target="cpu")
    want, want_logits = hf_greedy(tiny_dir, 16)
    got, logits = greedy_with(art, tiny_model.config, PROMPT, 16)
    assert got == want
    assert (logits[0] - want_logits).abs().max() <= 1e-4


def test_eager_traced_compiled_artifact_agree(tiny_model, tmp_path):
    cfg = tiny_model.config
    eager = greedy_with(eager_step(tiny_model), cfg, PROMPT, 12)[0]
    g = trace_model(tiny_model)
    traced = greedy_with(lambda i: interpret(g, i), cfg, PROMPT, 12)[0]
    art = deepfuse.compile(tiny_model, target="cpu")
    compiled = greedy_with(art, cfg, PROMPT, 12)[0]
    art.save(str(tmp_path / "a"))
    loaded = greedy_with(deepfuse.load(str(tmp_path / "a")), cfg, PROMPT, 12)[0]
    unfused = greedy_with(deepfuse.compile(tiny_model, target="cpu", fuse=False), cfg, PROMPT, 12)[0]
    assert eager == traced == compiled == loaded == unfused


def test_bf16_compiled_close_to_fp32(tiny_model):
    f32 = greedy_with(deepfuse.compile(tiny_model), tiny_model.config, PROMPT, 1)[1]
    bf16 = greedy_with(deepfuse.compile(tiny_model, dtype="bf16"), tiny_model.config, PROMPT, 1,
                       dtype=torch.bfloat16)[1]
    assert (f32 - bf16).abs().max() < 0.1 * f32.abs().max()


def test_sliding_window_config_matches_transformers_mistral(tmp_path):
    """A Mistral-style checkpoint with a sliding window shorter than the prompt."""
    from transformers import MistralConfig, MistralForCausalLM

    from deepfuse.models import load_model

    torch.manual_seed(1)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                        max_position_embeddings=256, head_dim=16)
    hf = MistralForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    assert model.config.sliding_window == 4
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1]
    got = greedy_with(deepfuse.compile(model), model.config, PROMPT, 1)[1][0]
    assert (got - want).abs().max() <= 1e-4


def test_a_checkpoint_with_weights_the_model_does_not_use_is_refused(tiny_dir, tmp_path):
    """Extra tensors mean a part of the architecture this definition lacks (here an MLP bias):
    loading is refused with the tensor named; RoPE's stored inverse frequencies are fine."""
    import shutil

    import pytest
    from safetensors.torch import load_file, save_file

    from deepfuse.errors import DeepfuseError
    from deepfuse.models import load_model

    d = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, d)
    path = next(d.glob("*.safetensors"))
    weights = load_file(path)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    save_file(weights, path)
    load_model(str(d), with_tokenizer=False)
    weights["model.layers.1.mlp.down_proj.bias"] = torch.zeros(weights["model.norm.weight"].shape)
    save_file(weights, path)
    with pytest.raises(DeepfuseError, match=r"1 weights this model does not use, e.g. model.layers.1.mlp.down_proj.bias"):
        load_model(str(d), with_tokenizer=False)
