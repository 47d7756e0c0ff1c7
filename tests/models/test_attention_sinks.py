"""Learned attention sinks (gpt-oss): the attention op against transformers' GptOss eager
attention, and a model with sinks through the fusion pipeline and the CPU target against the
reference ops."""
import types

import pytest
import torch

import deepfuse
from deepfuse.ir import OPS, interpret
from deepfuse.runtime.batch import SeqChunk, build_step
from deepfuse.runtime.kv_cache import CacheConfig, KVCache
from tests.codegen.test_triton import mixed_step
from tests.helpers import eager_step, greedy_with, with_sinks

H, HKV, HD = 4, 2, 16


@pytest.mark.parametrize("window", [0, 5])
def test_sink_attention_matches_transformers_gpt_oss(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    torch.manual_seed(0)
    cache = torch.zeros(2, 8, 4, HKV, HD)
    lens, qlens = [11, 6], [11, 1]  # a whole prompt, and a decode at position 5 over cached keys
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]])
    cache[:, 3:5] = torch.randn(2, 2, 4, HKV, HD)  # the second sequence's earlier keys
    t = sum(qlens)
    q, k, v = torch.randn(t, H * HD), torch.randn(t, HKV * HD), torch.randn(t, HKV * HD)
    slots = torch.tensor([tables[0, p // 4] * 4 + p % 4 for p in range(11)] + [4 * 4 + 1])
    sinks = torch.randn(H) * 2
    got = OPS["attention"].reference(q, k, v, cache, slots, tables, torch.tensor(lens), torch.tensor(qlens), sinks,
                                     num_heads=H, num_kv_heads=HKV, head_dim=HD, scale=HD ** -0.5, window=window,
                                     sinks=True)
    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=H // HKV, training=False)
    a = 0
    for s, (n, length) in enumerate(zip(qlens, lens)):
        kv = cache[:, tables[s]].reshape(2, -1, HKV, HD)[:, :length]
        qpos, kpos = torch.arange(length - n, length)[:, None], torch.arange(length)[None, :]
        seen = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        mask = torch.zeros(n, length).masked_fill(~seen, float("-inf"))[None, None]
        want, _ = eager_attention_forward(module, q[a:a + n].view(1, n, H, HD).transpose(1, 2),
                                          kv[0].transpose(0, 1)[None], kv[1].transpose(0, 1)[None], mask, HD ** -0.5)
        torch.testing.assert_close(got[a:a + n], want.reshape(n, H * HD), atol=1e-5, rtol=1e-5)
        a += n


def test_a_model_with_sinks_compiles_and_matches_the_reference(tiny_model):
    model = with_sinks(tiny_model, window=6)
    art = deepfuse.compile(model)
    att = [n for n in art.graph.nodes if n.op == "qkv_attention"]
    assert len(att) == 2 and all(n.attrs.get("sinks") for n in att)  # the fusion kept the sinks
    step = mixed_step(model.config)
    got, want = art(step), interpret(art.graph, mixed_step(model.config))
    torch.testing.assert_close(got[0], want[0], atol=1e-4, rtol=1e-4)
    tokens, logits = greedy_with(art, model.config, [5, 17, 99, 3, 42, 8, 1, 77], 8)
    ref_tokens, ref_logits = greedy_with(eager_step(model), model.config, [5, 17, 99, 3, 42, 8, 1, 77], 8)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # the sinks matter: the same weights without them give other logits
    plain = deepfuse.compile(tiny_model)
    c = model.config
    cache = lambda: KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(4, 16))
    x = build_step([SeqChunk([5, 17, 99, 3], 0, [])], cache())
    assert (art(x)[0] - plain(build_step([SeqChunk([5, 17, 99, 3], 0, [])], cache()))[0]).abs().max() > 1e-2


def test_hf_checkpoint_with_sinks_is_detected(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import LlamaForCausalLM

    from deepfuse.models import load_model
    from tests.conftest import tiny_hf_config

    LlamaForCausalLM(tiny_hf_config()).save_pretrained(tmp_path)
    f = next(tmp_path.glob("*.safetensors"))
    weights = load_file(str(f))
    weights.update({f"model.layers.{i}.self_attn.sinks": torch.randn(4) for i in range(2)})
    save_file(weights, str(f), metadata={"format": "pt"})
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    assert model.config.attention_sinks and "model.layers.1.self_attn.sinks" in model.weight_names()
