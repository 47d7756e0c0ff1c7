"""Gemma 3 from a Hugging Face directory: a tiny random Gemma3ForCausalLM written by transformers'
save_pretrained (norms stored as w, the model multiplies by 1 + w), loaded by load_model and
compared with transformers on the same weights, eagerly and through the compiled engine."""
import json

import pytest
import torch

from deepfuse import LLM, SamplingParams
from deepfuse.errors import DeepfuseError
from deepfuse.models import Gemma3, load_model
from tests.helpers import eager_step, greedy_with, hf_greedy

WINDOW = 4
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def text_config(**kw):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**{**dict(
        vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], final_logit_softcapping=3.0,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
        max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True), **kw})


def randomize_norms(hf):
    """transformers starts Gemma's norm weights at 0: give them values so that 1 + w is checked."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0, 0.5)
    return hf


def save_tokenizer(path):
    """A word-level tokenizer over the 96 ids, with Gemma's special tokens and no chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + [f"w{i}" for i in range(len(SPECIAL), 96)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
                            pad_token="<pad>").save_pretrained(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Gemma3ForCausalLM

    path = tmp_path_factory.mktemp("gemma3_hf")
    torch.manual_seed(0)
    hf = randomize_norms(Gemma3ForCausalLM(text_config()).eval())
    hf.save_pretrained(path)
    save_tokenizer(path)
    return hf, str(path)


PROMPT = [7, 30, 11, 95, 42, 8, 61, 19, 23, 77, 50]  # longer than the window


def test_hf_dir_loads_as_gemma3_and_matches_transformers(checkpoint):
    hf, path = checkpoint
    model, tok = load_model(path)
    c = model.config
    assert isinstance(model, Gemma3) and c.family == "gemma3"
    assert (c.sliding_window, c.full_attention_layers, c.rope_theta, c.rope_local_theta) == (WINDOW, (2,), 1e6, 10.0)
    assert (c.query_pre_attn_scalar, c.final_logit_softcap, c.tie_embeddings) == (24.0, 3.0, True)
    assert json.loads(open(f"{path}/config.json").read())["model_type"] == "gemma3_text"
    want, want_logits = hf_greedy(hf, PROMPT, 12)
    got, logits = greedy_with(eager_step(model), c, PROMPT, 12)
    assert (logits[0] - want_logits).abs().max().item() <= 1e-4
    assert got == want
    # the family's tokenizer defaults: chat turns end with <end_of_turn>; Gemma's turn template
    assert tok.eos_ids == [1, 5] and tok.render_chat([{"role": "user", "content": "w9"}]).startswith("<bos><start_of_turn>user")


def test_norms_without_the_one_offset_would_differ(checkpoint):
    """The comparison above can fail: HF's stored w used as the multiplier changes the logits."""
    hf, path = checkpoint
    model, _ = load_model(path, with_tokenizer=False)
    raw = {k: (v - 1 if k.endswith("norm.weight") else v) for k, v in model.weights.items()}
    _, logits = greedy_with(eager_step(Gemma3(model.config, raw)), model.config, PROMPT, 1)
    _, want_logits = hf_greedy(hf, PROMPT, 1)
    assert (logits[0] - want_logits).abs().max().item() > 1e-2


def test_compiled_engine_gives_the_eager_tokens(checkpoint):
    hf, path = checkpoint
    model, _ = load_model(path, with_tokenizer=False)
    want, _ = greedy_with(eager_step(model), model.config, PROMPT, 16)
    llm = LLM(path, block_size=4, num_blocks=64, max_num_tokens=8)  # the prompt in two chunks
    out = llm.generate([PROMPT, PROMPT[:5]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == want
    assert out[1].outputs[0].token_ids == greedy_with(eager_step(model), model.config, PROMPT[:5], 16)[0]


def test_multimodal_checkpoint_loads_its_language_model(tmp_path):
    """A gemma3 (image-text) checkpoint: its language model, vision tower dropped, gives
    transformers' text-only tokens. (Released ones have no final logit softcapping, which
    transformers' image-text model would not apply.)"""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    torch.manual_seed(1)
    hf = Gemma3ForConditionalGeneration(Gemma3Config(text_config=text_config(final_logit_softcapping=None),
                                                     vision_config=vision,
                                                     mm_tokens_per_image=4, image_token_index=90)).eval()
    randomize_norms(hf).save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    assert model.config.full_attention_layers == (2,) and model.config.sliding_window == WINDOW
    prompt = PROMPT[:-2]
    assert 90 not in prompt  # the image token: a text prompt holds none
    want, want_logits = hf_greedy(hf, prompt, 8)
    got, logits = greedy_with(eager_step(model), model.config, prompt, 8)
    assert (logits[0] - want_logits).abs().max().item() <= 1e-4
    assert got == want


@pytest.mark.parametrize("change,message", [
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}},
     "rope scaling 'linear' of the full-attention layers"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"model_type": "gemma4_text"}, r"model_type 'gemma4_text' is not supported yet \(supported: .*gemma3_text"),
], ids=["rope-scaling", "attention-softcap", "unknown-model-type"])
def test_what_the_model_cannot_run_is_refused(tmp_path, change, message):
    cfg = {**text_config().to_dict(), **change}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DeepfuseError, match=message):
        load_model(str(tmp_path), with_tokenizer=False)
