"""CPU kernels of a step's sampling tail: the sampler, speculative verification and the sampled
rows, each with bind_new (bound.py): in a step program they run natively on the run's outputs
(sample.cpp). Where the self-check refused the native sampler, greedy rows still run natively,
behind stops that hand a step with a sampled row or a draft to Python."""
from __future__ import annotations

import torch

from ...ir import OPS
from .bound import Bound
from .kernels import Kernel, factory
from .program import NativeStop, RunOutput, program_op
from .row_kernels import native_rows, native_sampler, sample_rows


@factory("sample")
def _sample(attrs: dict) -> Kernel:
    def sample(logits, temperature, top_k, top_p, seeds):
        return sample_rows(logits, temperature, top_k, top_p, seeds)

    def bind_new(logits, temperature, top_k, top_p, seeds) -> tuple[Bound, list[RunOutput]] | None:
        """In a step program: every row's token from the run's logits (sample.cpp), greedy and
        sampled rows alike. Where the self-check refused the native sampler: the argmax, behind a
        stop that holds the run where a row has a temperature above 0 (the draw then runs from Python)."""
        if not isinstance(logits, RunOutput) or logits.dtype != torch.float32 or len(logits.shape) != 2 \
                or logits.shape[1] == 0 or native_rows() is None \
                or not all(isinstance(t, torch.Tensor) and t.is_cpu and t.shape == tuple(logits.shape[:1])
                           and t.is_contiguous() for t in (temperature, top_k, top_p, seeds)) \
                or (temperature.dtype, top_p.dtype, top_k.dtype, seeds.dtype) != (torch.float32,) * 2 + (torch.int64,) * 2:
            return None
        tokens = RunOutput(logits.shape[:1], torch.int64)
        if native_sampler() is not None:
            return Bound([program_op("sample_to", logits, temperature, top_k, top_p, seeds, tokens)]), [tokens]
        return Bound([NativeStop(temperature, at_most=0.0), program_op("argmax_to", logits, tokens)]), [tokens]

    sample.bind_new = bind_new
    return sample


@factory("spec_verify")
def _spec_verify(attrs: dict) -> Kernel:
    ref = OPS["spec_verify"].reference

    def spec_verify(tokens: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
        """The native pass (sample.cpp), else the reference, except that a step without drafts
        (every row its sequence's last, as in plain decoding) keeps every token after one check."""
        if not (draft_tokens.numpy() >= 0).any():
            return tokens  # the sampler's fresh tensor, as it is (no torch op: after a step's weight
            # sweep each torch op's first call costs tens of microseconds, its code fetched again)
        native = native_sampler()
        if native is not None and tokens.dtype == draft_tokens.dtype == torch.int64 and tokens.is_contiguous() \
                and draft_tokens.is_contiguous() and tokens.dim() == 1:
            return native.spec_verify(tokens, draft_tokens)
        return ref(tokens, draft_tokens)

    def bind_new(tokens, draft_tokens) -> tuple[Bound, list] | None:
        """In a step program: the verified tokens into the run's tensor (sample.cpp); where the
        self-check refused it, the tokens as they are, behind a stop that holds the run where a row
        has a draft."""
        if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype != torch.int64 or not draft_tokens.is_cpu \
                or not draft_tokens.is_contiguous() or draft_tokens.shape != tuple(tokens.shape):
            return None
        if isinstance(tokens, RunOutput) and native_sampler() is not None:
            kept = RunOutput(tokens.shape, torch.int64)
            return Bound([program_op("spec_verify_to", tokens, draft_tokens, kept)]), [kept]
        return Bound([NativeStop(draft_tokens, below=0)]), [tokens]

    spec_verify.bind_new = bind_new
    return spec_verify


@factory("take_rows")
def _take_rows(attrs: dict) -> Kernel:
    ref = OPS["take_rows"].reference

    def take_rows_kernel(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return ref(x, rows)

    def bind_new(x, rows) -> tuple[Bound, list[RunOutput]] | None:
        """In a step program: x[rows] into the run's tensor."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or not isinstance(rows, torch.Tensor):
            return None
        out = RunOutput((rows.shape[0], x.shape[1]), x.dtype)
        return Bound([program_op("index_select_to", x, rows, out)]), [out]

    take_rows_kernel.bind_new = bind_new
    return take_rows_kernel
