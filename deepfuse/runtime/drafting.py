"""Drafts for speculative decoding, as the engine asks for them each step: make_drafter builds
the drafter a SpecConfig names (spec.py's n-gram and draft-model drafters, mtp.py's MTP head),
and set_drafts gives every decoding request its draft tokens for the next step (req.draft),
capped by what could ever be kept and, under the confidence schedule, by the step's latency
model (spec.choose_drafts).

Owns no engine state: the engine passes its scheduler, context length and latency model.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import DeepfuseError
from .host_sampling import drafts_allowed
from .mtp import MtpDrafter
from .spec import ModelDrafter, NgramDrafter, SpecConfig, choose_drafts

if TYPE_CHECKING:
    from ..codegen.artifact import CompiledModel
    from .kv_cache import KVCache, KVCacheManager
    from .request import Request
    from .scheduler import Scheduler


def make_drafter(spec: SpecConfig, draft_model: CompiledModel | None, model: CompiledModel, kv: KVCacheManager,
                 cache: KVCache, scheduler: Scheduler, max_blocks: int):
    """The drafter of spec.method for `model`; "draft" needs draft_model (same vocabulary) and a
    target whose layers do not mix sliding-window and full attention (one cache group)."""
    if spec.method == "ngram":
        return NgramDrafter(spec)
    if spec.method == "mtp":
        return MtpDrafter(spec.draft_head, model)
    if len(cache.groups) > 1:
        raise DeepfuseError('speculative method "draft" is not supported for models that mix sliding-window and '
                            'full-attention layers; use "ngram" or "mtp"')
    if draft_model is None:
        raise DeepfuseError('speculative method "draft" needs a draft_model (LLM builds one from '
                            'SpecConfig.draft_layers)')
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise DeepfuseError(f"the draft model's vocabulary ({draft_model.config.vocab_size} tokens) differs from "
                            f"the target's ({model.config.vocab_size}): its tokens cannot be verified")
    return ModelDrafter(draft_model, kv, cache.config, scheduler.config.max_num_tokens,
                        scheduler.config.max_num_seqs, max_blocks,
                        cost=draft_model.config.num_layers / model.config.num_layers)


def set_drafts(drafter, spec: SpecConfig, scheduler: Scheduler, max_model_len: int,
               host_sampled: Callable[[Request], bool], latency) -> None:
    """Proposes drafts for every running request that is decoding and sets each one's req.draft
    (latency: the engine's latency model under the confidence schedule, else None: every
    proposed draft token)."""
    k = spec.num_draft_tokens
    decoding, ks, base, others = [], [], 0, 0
    for req in scheduler.running:
        if req.remaining != 1:
            base += req.remaining
            others += 1
            continue
        # no drafts past max_tokens or the context: they could never be kept; none where the host
        # draws the token with penalties that count the output (host_sampling.drafts_allowed)
        room = min(k, req.params.max_tokens - len(req.generated) - 1, max_model_len - len(req.tokens))
        if host_sampled(req) and not drafts_allowed(req.params):
            room = 0
        decoding.append(req)
        ks.append(max(room, 0))
    drafts = drafter.propose_batch(decoding, ks)
    for req, d in zip(decoding, drafts):  # structured outputs: drafts the grammar forbids are not verified
        if req.matcher is not None and d.tokens:
            n = req.matcher.allowed_prefix(d.tokens)
            d.tokens, d.confidence = d.tokens[:n], d.confidence[:n]
    if latency is None:
        counts = [len(d.tokens) for d in drafts]
    else:
        base = min(base, scheduler.config.max_num_tokens) + len(decoding)
        seqs = min(others + len(decoding), scheduler.config.max_num_seqs)
        counts = choose_drafts(drafts, seqs, base, float(len(decoding)), latency)
    for req, d, n in zip(decoding, drafts, counts):
        req.draft = d.tokens[:n]
