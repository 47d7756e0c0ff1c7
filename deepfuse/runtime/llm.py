"""LLM: the offline-inference face. `LLM("smollm2").generate(["Hi"], SamplingParams(...))`."""
from __future__ import annotations

import os

from ..codegen.artifact import CompiledModel
from ..errors import DeepfuseError
from .engine import Engine, SamplingParams
from .kv_cache import CacheConfig
from .outputs import RequestOutput
from .spec import SpecConfig


class LLM:
    """model: a model name/path (compiled now), an artifact directory or a CompiledModel
    (deepfuse.compile's; used as it is, like an artifact); artifact: an
    artifact directory (loaded and verified, never recompiled); quant: None, "int4" (4-bit
    weights; the LM head stays dense), "int4-head" (the LM head 4-bit too), "int4-head8" (the LM
    head int8 with int8 activations, as llama.cpp's Q4 files have it), "int4-a8" (as "int4-head8",
    and the int4 projections' activations int8 per group of 32: llama.cpp's Q4_1 x Q8_1 product) or "w8a8" (int8
    weights and activations: the fastest on CPUs with AVX512-VNNI, at about 1% perplexity over
    int4, docs/quantization.md); kv_cache_dtype: None (the cache holds
    `dtype`) or "int8" (cpu: k and v rows as int8 with a scale each, half of bf16's bytes for
    attention to read; docs/quantization.md). Engine settings:
    block_size and num_blocks size the paged KV cache; max_num_tokens is the token budget
    of one step (and the prefill chunk); max_num_seqs caps the batch; spec: a SpecConfig for
    speculative decoding (same outputs, fewer steps when drafts are accepted);
    batch_invariant: compile so that each request's tokens are the same whatever shares its
    steps (an artifact must have been compiled so); artifact_digest: "sha256:<hex>" as `deepfuse
    compile` prints it, pins the artifact loaded (any other or modified one is refused);
    swa_replay_tokens: bounded replay for models that mix sliding-window and full-attention
    layers (CacheConfig; 0: off); kv_store, kv_store_gb: a directory that keeps prefix-cache
    blocks on disk across evictions and restarts, and its size (runtime/kv_store.py);
    tensor_parallel_size: ranks (processes on this machine, gloo collectives) that each hold a shard
    of every layer (MoE experts: expert parallel), with the 1-process tokens (docs/distributed.md);
    a tensor-parallel artifact (`deepfuse compile --tp N`) runs on its N ranks without it;
    moe_dispatch: how those ranks' expert-parallel MoE layers meet their tokens, "all_reduce" or
    "all_to_all" (cpu; docs/distributed.md);
    cuda_graphs: decode steps as CUDA graphs of padded batch buckets (runtime/graphed_decode.py;
    None: where the model runs on a CUDA GPU; False: every step eager); overlap: launch each plain
    decode step before reading the one ahead of it (runtime/overlap.py; off by default);
    decode_steps: plain decode steps run before the host takes their tokens (runtime/decode_burst.py;
    the same outputs, streamed decode_steps tokens at a time; 1 by default; one process only)."""

    def __init__(self, model: str | CompiledModel = "smollm2", target: str = "cpu", dtype: str = "f32",
                 block_size: int = 16, num_blocks: int = 1024, max_num_tokens: int = 512, max_num_seqs: int = 64,
                 enable_prefix_caching: bool = True, artifact: str | None = None, quant: str | None = None,
                 spec: SpecConfig | None = None, batch_invariant: bool = False, kv_cache_dtype: str | None = None,
                 artifact_digest: str | None = None, swa_replay_tokens: int = 0, kv_store: str | None = None,
                 kv_store_gb: float = 4.0, tensor_parallel_size: int = 1, cuda_graphs: bool | None = None,
                 overlap: bool = False, moe_dispatch: str = "all_reduce", decode_steps: int = 1):
        from ..compiler import compile
        from .loader import load
        from .loader import tensor_parallel_size as artifact_ranks

        source = artifact or (model if isinstance(model, str) else None)
        ranks = artifact_ranks(source) if source is not None else 1
        if ranks > 1 and tensor_parallel_size == 1:  # a tensor-parallel artifact runs on its ranks
            tensor_parallel_size = ranks
        if not isinstance(decode_steps, int) or decode_steps < 1:
            raise DeepfuseError(f"decode_steps must be an integer >= 1, got {decode_steps!r}")
        if tensor_parallel_size != 1:
            if decode_steps != 1:
                raise DeepfuseError("decode_steps > 1 runs in one process: give tensor_parallel_size=1")
            from .distributed import engine_for_llm

            self.model, self.engine = None, engine_for_llm(
                model, tensor_parallel_size, target, dtype, block_size, num_blocks, max_num_tokens, max_num_seqs,
                enable_prefix_caching, artifact=artifact, artifact_digest=artifact_digest, quant=quant, spec=spec,
                batch_invariant=batch_invariant, kv_cache_dtype=kv_cache_dtype, swa_replay_tokens=swa_replay_tokens,
                kv_store=kv_store, overlap=overlap, moe_dispatch=moe_dispatch)
            self.tokenizer = self.engine.tokenizer
            return
        if moe_dispatch != "all_reduce":
            raise DeepfuseError(f"moe_dispatch={moe_dispatch!r} places expert-parallel MoE layers over ranks: give "
                                "tensor_parallel_size > 1")
        draft = None
        compiled = isinstance(model, CompiledModel)
        from_dir = not compiled and (artifact is not None or os.path.isfile(os.path.join(model, "manifest.json")))
        if artifact_digest is not None and not from_dir:
            raise DeepfuseError("artifact_digest pins an artifact directory; give one (artifact=...)")
        if compiled or from_dir:
            self.model = model if compiled else load(artifact or model, digest=artifact_digest)
            if batch_invariant and not self.model.batch_invariant:
                raise DeepfuseError("this model was compiled without batch invariance; recompile it with "
                                    "`deepfuse compile --batch-invariant`")
            if spec is not None and spec.method == "draft":
                raise DeepfuseError('speculative method "draft" needs the model itself, not a compiled one')
            if kv_cache_dtype is not None and kv_cache_dtype != self.model.kv_cache_dtype:
                raise DeepfuseError(f"this model was compiled with kv_cache_dtype {self.model.kv_cache_dtype!r}, "
                                    f"not {kv_cache_dtype!r}; recompile it with `deepfuse compile --kv-cache-dtype`")
        else:
            from ..models import load_model

            source, tok = load_model(model)
            self.model = compile(source, target=target, dtype=dtype, quant=quant, tokenizer=tok,
                                 batch_invariant=batch_invariant, kv_cache_dtype=kv_cache_dtype)
            if spec is not None and spec.method == "draft":
                if spec.draft_layers < 1:
                    raise DeepfuseError("SpecConfig.draft_layers must be >= 1 for the draft method")
                try:
                    first = source.first_layers(spec.draft_layers)
                except ValueError as e:
                    raise DeepfuseError(str(e)) from None
                draft = compile(first, target=target, dtype=dtype, quant=quant, batch_invariant=batch_invariant,
                                kv_cache_dtype=kv_cache_dtype)
        if self.model.tokenizer is None:
            raise DeepfuseError("this model has no tokenizer; pass token ids to Engine.generate instead")
        self.tokenizer = self.model.tokenizer
        self.engine = Engine(self.model, CacheConfig(block_size, num_blocks, enable_prefix_caching,
                                                 swa_replay_tokens=swa_replay_tokens, kv_store=kv_store,
                                                 kv_store_gb=kv_store_gb),
                             max_num_tokens, max_num_seqs, spec, draft, cuda_graphs=cuda_graphs, overlap=overlap,
                             decode_steps=decode_steps)

    def generate(self, prompts: str | dict | list[str | dict | list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, on_token=None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order (outputs.py: vLLM's shape, the n completions in
        its `outputs`). A prompt may be text, token ids, or vLLM's dicts
        {"prompt": text} and {"prompt_token_ids": ids}; sampling_params: one for all, or one per
        prompt (vLLM's name). Invalid requests come back with finish_reason "error" and `error`
        set; the others still run."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        ids = [self.prompt_token_ids(p) for p in prompts]  # the engine checks the rest
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(ids)
        outs = self.engine.generate(ids, plist, on_token, use_tqdm=use_tqdm and len(ids) > 1)
        for out, p in zip(outs, prompts):
            out.prompt = prompt_text(p)
        return outs

    def prompt_token_ids(self, prompt: object) -> object:
        """A prompt's token ids: text encoded, vLLM's prompt dicts unwrapped; anything else as it
        is (the engine names what is wrong with it)."""
        return prompt_token_ids(self.tokenizer, prompt)

    def chat(self, messages: str | list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None, on_token=None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates the assistant's reply through the model's chat template; as vLLM's, returns a
        list: one output for one conversation ([{"role": ..., "content": ...}, ...]) or one user
        message (str), one per conversation, in order, for a list of them."""
        batch = isinstance(messages, list) and bool(messages) and all(isinstance(c, list) for c in messages)
        conversations = messages if batch else [messages]
        prompts = [self.tokenizer.render_chat(_conversation(c)) for c in conversations]
        return self.generate(prompts, sampling_params, on_token, use_tqdm)


def prompt_token_ids(tokenizer, prompt: object) -> object:
    """LLM.prompt_token_ids with a given tokenizer."""
    if isinstance(prompt, dict) and len(prompt) == 1:
        if isinstance(prompt.get("prompt"), str):
            return tokenizer.encode(prompt["prompt"])
        if "prompt_token_ids" in prompt:
            return prompt["prompt_token_ids"]
    return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


def prompt_text(prompt: object) -> str | None:
    """The text of a prompt given as text (RequestOutput.prompt), else None."""
    if isinstance(prompt, dict) and len(prompt) == 1 and isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    return prompt if isinstance(prompt, str) else None


def _conversation(c: object) -> list[dict[str, str]]:
    """A chat turn list from a str (one user message) or a list of {"role", "content"} dicts."""
    if isinstance(c, str):
        return [{"role": "user", "content": c}]
    if not (isinstance(c, list) and c and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                             and isinstance(m.get("content"), str) for m in c)):
        raise DeepfuseError(f"a conversation must be a non-empty list of {{'role': str, 'content': str}} dicts, "
                            f"got {c!r:.80}")
    return c
