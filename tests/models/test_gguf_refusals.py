"""GGUF files the llama model cannot run faithfully are refused by name, not loaded into
wrong tokens: rope scaling, Llama 3.1's rope frequency factors, tensors with no place in the model."""
import numpy as np
import pytest

from deepfuse.errors import DeepfuseError
from deepfuse.models.gguf_loader import load_gguf


def write_gguf(path, extra_tensors=(), **kv) -> str:
    """A 1-layer llama GGUF (f32, hidden 8, 2 heads, vocab 16), plus extra tensors and string fields."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(16)
    for key, value in kv.items():
        w.add_string(key, value)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (16, 8), "output_norm.weight": (8,), "blk.0.attn_norm.weight": (8,),
              "blk.0.ffn_norm.weight": (8,), "blk.0.attn_q.weight": (8, 8), "blk.0.attn_k.weight": (8, 8),
              "blk.0.attn_v.weight": (8, 8), "blk.0.attn_output.weight": (8, 8), "blk.0.ffn_gate.weight": (16, 8),
              "blk.0.ffn_up.weight": (16, 8), "blk.0.ffn_down.weight": (8, 16)}
    for name, shape in [*shapes.items(), *extra_tensors]:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_plain_llama_gguf_loads(tmp_path):
    config, weights = load_gguf(write_gguf(tmp_path / "ok.gguf", [("blk.0.attn_rot_embd", (4,))]))
    assert (config.num_layers, config.hidden_size, config.num_heads, config.vocab_size) == (1, 8, 2, 16)
    assert config.tie_embeddings and len(weights) == 11


@pytest.mark.parametrize("extra,kv,message", [
    ([("rope_freqs.weight", (2,))], {}, "rope_freqs.weight .* rope scaling factors"),
    ([("blk.0.attn_q.bias", (8,))], {}, "blk.0.attn_q.bias .* no place"),
    ([], {"llama.rope.scaling.type": "linear"}, "rope scaling 'linear'"),
], ids=["rope-freqs", "bias", "scaling-type"])
def test_gguf_the_model_cannot_run_is_refused_by_name(tmp_path, extra, kv, message):
    with pytest.raises(DeepfuseError, match=message):
        load_gguf(write_gguf(tmp_path / "bad.gguf", extra, **kv))
