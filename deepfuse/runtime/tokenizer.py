"""Tokenizer: a `tokenizers.Tokenizer` plus special ids and the chat template.

Built once from GGUF metadata or a HF directory (through transformers' converter), given the model
family's fix-ups (add_defaults; models.load_model applies them), then stored in artifacts as
tokenizer.json + tokenizer_config.json, which load fast. A GGUF's tokenizer is also cached under
~/.cache/deepfuse/tokenizers/<the file's sha256>/ (Gemma's 262k-entry vocabulary takes ~30 s to
convert).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field

from tokenizers import Tokenizer as HFTokenizer

from ..errors import DeepfuseError


@dataclass
class Tokenizer:
    backend: HFTokenizer
    bos_id: int | None
    eos_ids: list[int]
    add_bos: bool = False
    chat_template: str | None = None
    special: dict[str, str] = field(default_factory=dict)  # bos_token/eos_token strings for templates

    def encode(self, text: str) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """Applies the model's chat template with a generation prompt."""
        if not self.chat_template:
            raise DeepfuseError("this model has no chat template; use --no-chat")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=True, **self.special)

    def add_defaults(self, chat_template: str | None, eos_tokens: tuple[str, ...]) -> Tokenizer:
        """A model family's fix-ups: its chat template where the checkpoint brings none, and the
        tokens that also end a generation (Gemma's <end_of_turn>) where the vocabulary has them."""
        self.chat_template = self.chat_template or chat_template
        for token in eos_tokens:
            i = self.backend.token_to_id(token)
            if i is not None and i not in self.eos_ids:
                self.eos_ids.append(i)
        return self

    def save(self, directory: str) -> list[str]:
        self.backend.save(os.path.join(directory, "tokenizer.json"))
        cfg = {"bos_id": self.bos_id, "eos_ids": self.eos_ids, "add_bos": self.add_bos,
               "chat_template": self.chat_template, "special": self.special}
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, indent=1)
        return ["tokenizer.json", "tokenizer_config.json"]

    @staticmethod
    def load(directory: str) -> Tokenizer:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            cfg = json.load(f)
        return Tokenizer(HFTokenizer.from_file(os.path.join(directory, "tokenizer.json")), **cfg)

    @staticmethod
    def from_transformers(tok, chat_template: str | None) -> Tokenizer:
        """From a transformers fast tokenizer (as AutoTokenizer builds from GGUF or a directory)."""
        eos = tok.eos_token_id
        special = {k: getattr(tok, k) for k in ("bos_token", "eos_token") if getattr(tok, k, None)}
        return Tokenizer(tok.backend_tokenizer, tok.bos_token_id, [eos] if eos is not None else [],
                         add_bos=bool(getattr(tok, "add_bos_token", False)),
                         chat_template=chat_template, special=special)


def tokenizer_from_gguf(path: str, reader, cache_dir: str | None = None) -> Tokenizer:
    """The GGUF's tokenizer, from cache_dir (default ~/.cache/deepfuse/tokenizers) when built before."""
    from ..models.packaged import CACHE_DIR, sha256_file

    cache_dir = cache_dir or os.path.join(CACHE_DIR, "tokenizers")
    cached = os.path.join(cache_dir, sha256_file(path))
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return Tokenizer.load(cached)
    out = build_tokenizer_from_gguf(path, reader)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_dir)
    out.save(tmp)
    try:
        os.rename(tmp, cached)  # atomic; fails harmlessly where a concurrent build got there first
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def build_tokenizer_from_gguf(path: str, reader) -> Tokenizer:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    f = reader.fields.get("tokenizer.chat_template")
    out = Tokenizer.from_transformers(tok, f.contents() if f is not None else None)
    add_bos = reader.fields.get("tokenizer.ggml.add_bos_token")
    out.add_bos = bool(add_bos.contents()) if add_bos is not None else out.add_bos
    return out


def tokenizer_from_hf_dir(path: str) -> Tokenizer:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise DeepfuseError(f"{path} has no usable tokenizer ({str(e).splitlines()[0]}); "
                            "add tokenizer.json / tokenizer_config.json to the checkpoint") from None
    return Tokenizer.from_transformers(tok, getattr(tok, "chat_template", None))
