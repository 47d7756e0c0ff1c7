"""Gemma 3 270M (Q4_K_M GGUF): deepfuse vs transformers loading the same GGUF, f32, cpu target.

The long prompt (> 600 tokens) makes the 512-token sliding window matter; a build that ignores
the window must not match transformers on it.
"""
import dataclasses
import os

import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.models import Gemma3, gemma3_gguf_path, load_model
from tests.conftest import CI
from tests.helpers import greedy_with, hf_greedy


def _path():
    try:
        return gemma3_gguf_path()
    except DeepfuseError as e:
        if CI:  # `make test` installs it: a failure there
            raise
        pytest.skip(str(e))


SHORT = "Why is the sky blue?"
LONG = " ".join(f"Note {i}: the {['red', 'green', 'blue', 'amber'][i % 4]} lamp in room {i * 7 % 31} was switched "
                f"{'on' if i % 3 else 'off'}." for i in range(48)) + " Summarise which lamps in room 5 were on."


@pytest.fixture(scope="module")
def gemma():
    _path()
    return load_model("gemma3")


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = _path()
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def compiled(gemma):
    model, tok = gemma
    return deepfuse.compile(model, target="cpu", tokenizer=tok)


@pytest.fixture(scope="module")
def long_ids(gemma):
    ids = gemma[1].encode(LONG)
    assert 600 < len(ids) < 900, len(ids)
    return ids


@pytest.mark.parametrize("which", ["short", "long"])
def test_greedy_32_and_first_logits_match_transformers(which, gemma, hf_model, compiled, long_ids):
    ids = gemma[1].encode(SHORT) if which == "short" else long_ids
    want, want_logits = hf_greedy(hf_model, ids, 32)
    got, logits = greedy_with(compiled, gemma[0].config, ids, 32, block_size=16)
    assert (logits[0] - want_logits).abs().max().item() <= 1e-3
    assert got == want


def test_ignoring_the_window_breaks_parity(gemma, hf_model, long_ids):
    """The sliding layers' window widened past the prompt (their RoPE base kept): the long
    prompt's logits leave transformers', so the parity above depends on the window."""
    model = gemma[0]
    wide = Gemma3(dataclasses.replace(model.config, sliding_window=model.config.max_position), model.weights)
    _, logits = greedy_with(deepfuse.compile(wide, target="cpu"), wide.config, long_ids, 1, block_size=16)
    _, want_logits = hf_greedy(hf_model, long_ids, 1)
    assert len(long_ids) > model.config.sliding_window
    assert (logits[0] - want_logits).abs().max().item() > 0.05


def test_chat_ends_turn_and_artifact_round_trips(gemma, compiled, tmp_path):
    tok = gemma[1]
    assert tok.render_chat([{"role": "user", "content": "Hi"}]) == \
        "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.backend.token_to_id("<end_of_turn>") in tok.eos_ids
    compiled.save(str(tmp_path / "art"))
    loaded = deepfuse.load(str(tmp_path / "art"))
    assert loaded.config == gemma[0].config and loaded.tokenizer.eos_ids == tok.eos_ids
