"""The request bodies of the OpenAI-compatible endpoints, with vLLM's extra sampling fields,
and their translation into SamplingParams.

A body that does not fit its model (unknown field, wrong type) is a 422; a value that fits but
cannot run (temperature -1, a prompt longer than the context) a 400 from SamplingParams or the
engine. Fields the server does not implement are named in the error, never ignored.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import DeepfuseError
from ..runtime.request import SamplingParams
from ..runtime.structured import StructuredOutputsParams

NonNegInt = Annotated[int, Field(ge=0)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object) or
    json_schema (its schema)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise DeepfuseError("response_format of type json_schema needs its json_schema")
        return StructuredOutputsParams(json=self.json_schema.json_schema)


class SamplingFields(BaseModel):
    """What completions and chat share: OpenAI's sampling fields, then vLLM's."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[NonNegInt] | None = None
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[NonNegInt] | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None  # vLLM's: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The SamplingParams these fields ask for (DeepfuseError naming a bad value). OpenAI's
        defaults: temperature 1, top_p 1."""
        if not self.skip_special_tokens:
            raise DeepfuseError("skip_special_tokens=false is not supported: texts leave special tokens out")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise DeepfuseError(f"logit_bias keys must be token ids, got {sorted(self.logit_bias)[:5]}") from None
        structured = self.response_format.structured() if self.response_format is not None else None
        if self.structured_outputs is not None:
            if structured is not None:
                raise DeepfuseError("give response_format or structured_outputs, not both")
            fields = set(StructuredOutputsParams.__dataclass_fields__)
            if not set(self.structured_outputs) <= fields:
                raise DeepfuseError(f"structured_outputs takes {sorted(fields)}, got {sorted(self.structured_outputs)}")
            structured = StructuredOutputsParams(**self.structured_outputs)
        return SamplingParams(
            structured_outputs=structured, n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k is None else self.top_k,
            max_tokens=max_tokens, seed=self.seed, ignore_eos=self.ignore_eos, stop=self.stop or [],
            include_stop_str_in_output=self.include_stop_str_in_output, stop_token_ids=self.stop_token_ids or [],
            logprobs=logprobs, prompt_logprobs=self.prompt_logprobs,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            min_tokens=self.min_tokens, min_p=0.0 if self.min_p is None else self.min_p, logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. prompt: text, token ids, or a list of either (one choice per
    prompt and completion, index = prompt * n + j). logprobs: top logprobs per token (0-20)."""

    prompt: str | list[str] | list[NonNegInt] | list[list[NonNegInt]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise DeepfuseError("prompt is empty")
        return list(p)

    def check(self) -> None:
        if self.echo:
            raise DeepfuseError("echo is not supported")
        if self.suffix:
            raise DeepfuseError("suffix is not supported")
        if self.best_of not in (None, self.n):
            raise DeepfuseError("best_of other than n is not supported")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, tool_call_id, ...: the template sees role and content
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(SamplingFields):
    """POST /v1/chat/completions. max_completion_tokens is OpenAI's newer name of max_tokens;
    logprobs: bool, top_logprobs: how many alternatives (0-20)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def conversation(self) -> list[dict[str, str]]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprob_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise DeepfuseError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None
