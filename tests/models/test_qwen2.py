"""Qwen2 (biases on q/k/v): a tiny random checkpoint written by transformers, parity through
the compiled path."""
import json

import pytest
import torch

import deepfuse
from deepfuse.models import load_model
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.kv_cache import CacheConfig
from tests.helpers import greedy_with, hf_greedy

SLIDING = {"use_sliding_window": True, "sliding_window": 4}


@pytest.mark.parametrize("windows,layout", [({}, (0, ())), ({**SLIDING, "max_window_layers": 2}, (0, ())),
                                          ({**SLIDING, "max_window_layers": 0}, (4, ())),
                                          ({**SLIDING, "max_window_layers": 1}, (4, (0,)))],
                         ids=["full", "window-in-no-layer", "window-in-every-layer", "hybrid"])
def test_qwen2_parity_with_transformers(tmp_path, windows, layout):
    """Through the engine too (ragged steps, its block policy: a hybrid keeps every block)."""
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
    assert (model.config.sliding_window, model.config.full_attention_layers) == layout
    art = deepfuse.compile(model)
    # q, k and v's biases: one concatenated bias on the merged q/k/v projection (fuse_split_biases),
    # a generated add, which is the projection's epilogue where the GEMM has one output (layer 0's
    # rms_norm_linear; add_rms_norm_linear also returns its residual sum)
    biases = [n.attrs["ops"] for n in art.graph.nodes if n.op in ("kernel", "with_epilogue") and "add" in n.attrs["ops"]]
    assert biases == [["rms_norm_linear", "add"], ["add"]] and "add_bias" not in art.graph.op_counts()
    assert art.graph.op_counts()["qkv_attention"] == 2  # the split is free for the attention fusion
    prompt = [5, 17, 99, 3, 42, 7]
    want, want_logits = hf_greedy(hf, prompt, 16)
    got, logits = greedy_with(art, model.config, prompt, 16)
    assert got == want
    assert (logits[0] - want_logits).abs().max().item() <= 1e-4
    eng = Engine(art, CacheConfig(block_size=4, num_blocks=32), max_num_tokens=4)  # the prompt in two chunks
    assert eng.kv.window == (0 if layout[1] else layout[0])
    out = eng.generate([prompt, prompt[:3]], [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2)
    assert out[0].outputs[0].token_ids == want


def qwen2_dict(**kw) -> dict:
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                       num_key_value_heads=2, **kw).to_dict()


def test_qwen2_windows_follow_max_window_layers():
    """Qwen2 slides only in layers from max_window_layers on: none, all, or some of them (the
    rest attend to everything), whether the config lists layer_types or not (older ones)."""
    from deepfuse.models.cache_groups import cache_groups
    from deepfuse.models.hf_loader import config_from_hf

    def windows(**kw):
        c = config_from_hf(qwen2_dict(**kw))
        return c.sliding_window, c.full_attention_layers, [(g.window, g.layers) for g in cache_groups(c)]

    every = (0, 1, 2, 3)
    assert windows() == (0, (), [(0, every)])
    assert windows(use_sliding_window=True, sliding_window=64, max_window_layers=4) == (0, (), [(0, every)])
    assert windows(use_sliding_window=True, sliding_window=64, max_window_layers=0) == (64, (), [(64, every)])
    assert windows(use_sliding_window=True, sliding_window=64, max_window_layers=2) == (64, (0, 1),
                                                                                          [(0, (0, 1)), (64, (2, 3))])
    cfg = qwen2_dict(use_sliding_window=True, sliding_window=64, max_window_layers=3)
    cfg.pop("layer_types")  # as an older transformers wrote it: derived from max_window_layers
    c = config_from_hf(cfg)
    assert (c.sliding_window, c.full_attention_layers) == (64, (0, 1, 2))
    assert [c.window_of(i) for i in range(4)] == [0, 0, 0, 64]
    assert type(c).from_dict(json.loads(json.dumps(c.to_dict()))) == c  # as an artifact's manifest keeps it


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


@pytest.mark.parametrize("target", ["sm90", "ascend950"])
def test_qwen2_on_the_device_targets_has_no_host_steps(tmp_path, target):
    """The biased q/k/v projection is one launch there: the GEMM template with its generated
    RMSNorm prologue and bias epilogue (one Triton kernel; prologue, cube GEMM and epilogue kernels
    of one AscendC launch). Greedy tokens as the interpreter's."""
    import os

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from deepfuse.ir import interpret

    if target == "sm90" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs Triton's interpreter")
    if target == "ascend950" and __import__("shutil").which("g++") is None:
        pytest.skip("the AscendC emulator needs g++")
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=False)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    hf.save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    art = deepfuse.compile(model, target=target)
    assert art.plan["host_steps"] == []
    assert [p["attrs"]["ops"] for p in art.plan["launches"] if p["kind"] == "template+generated"] == \
        [["rms_norm_linear", "add"]]
    prompt = [5, 17, 99, 3, 42, 7]
    want = greedy_with(lambda inputs: interpret(art.graph, inputs), model.config, prompt, 4, block_size=16)
    got = greedy_with(art, model.config, prompt, 4, block_size=16)
    assert got[0] == want[0]
