"""The family registry: lookups by name, GGUF architecture and model_type, refusals that list
what is supported, and a family registered from outside deepfuse found like a built-in one."""
import dataclasses

import pytest

from deepfuse.errors import DeepfuseError
from deepfuse.models import Gemma3, Gemma3Config, Llama, build_model, config_from_dict, family_by_name
from deepfuse.models.family import FAMILIES, Family, HFFormat, family_for_gguf_arch, family_for_hf_model_type, register
from deepfuse.models.hf_loader import config_from_hf


def test_builtin_families_are_found_by_each_of_their_names():
    assert family_by_name("llama").model is Llama and family_by_name("mixtral") is family_by_name("llama")
    assert family_by_name("gemma3").model is Gemma3 and family_for_gguf_arch("gemma3") is family_by_name("gemma3")
    assert family_for_hf_model_type("gemma3_text") is family_by_name("gemma3")
    assert family_for_hf_model_type("qwen2") is family_for_gguf_arch("llama") is family_by_name("qwen3_moe")


@pytest.mark.parametrize("lookup,message", [
    (lambda: family_for_gguf_arch("qwen2"), r"GGUF architecture 'qwen2' is not supported yet \(supported: gemma3, llama\)"),
    (lambda: family_for_hf_model_type("phi3"), r"model_type 'phi3' is not supported yet \(supported: gemma3, gemma3_text, "
                                                r"llama, mistral, mixtral, qwen2, qwen3_moe\)"),
    (lambda: family_by_name("nosuch"), r"model family 'nosuch' is unknown \(known: gemma3, llama, mixtral"),
])
def test_unsupported_names_are_refused_with_the_supported_list(lookup, message):
    with pytest.raises(DeepfuseError, match=message):
        lookup()


def test_a_name_or_model_type_another_family_holds_is_refused():
    with pytest.raises(ValueError, match="'qwen2' is already registered"):
        register(Family("other", Gemma3Config, Gemma3, hf=HFFormat(("qwen2",), config_from_hf)))
    with pytest.raises(ValueError, match="'llama' is already registered"):
        register(Family("llama", Gemma3Config, Gemma3))
    assert "other" not in FAMILIES


@dataclasses.dataclass(frozen=True)
class PluginConfig(Gemma3Config):
    family: str = "test_plugin"


class Plugin(Gemma3):
    pass


def test_a_registered_plugin_family_is_built_from_its_config_and_read_from_hf_configs():
    def from_hf(cfg):
        return PluginConfig(**{f.name: cfg[f.name] for f in dataclasses.fields(Gemma3Config) if f.name != "family"})

    register(Family("test_plugin", PluginConfig, Plugin, hf=HFFormat(("test_plugin_text",), from_hf)))
    try:
        cfg = PluginConfig(vocab_size=8, hidden_size=4, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                           head_dim=4, rope_theta=1e4, rope_local_theta=1e4, rms_norm_eps=1e-6, max_position=16,
                           query_pre_attn_scalar=4.0, sliding_window=0, full_attention_layers=(0,))
        assert config_from_dict(cfg.to_dict()) == cfg
        assert config_from_hf({**cfg.to_dict(), "model_type": "test_plugin_text"}) == cfg
        names = Gemma3.weight_names(None, cfg)  # the names the model checks; no math runs here
        assert type(build_model(cfg, dict.fromkeys(names))) is Plugin
    finally:
        FAMILIES.pop("test_plugin")
