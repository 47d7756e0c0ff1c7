"""CPU kernels of a step's sampling tail: the sampler, speculative verification and the sampled
rows, each with bind_new (bound.py): in a step program they run natively on the run's outputs,
behind stops that hand a step with a sampled row or a draft to Python."""
from __future__ import annotations

import torch

from ...ir import OPS
from .bound import Bound
from .kernels import Kernel, factory
from .program import NativeStop, RunOutput, program_op
from .row_kernels import native_rows


@factory("sample")
def _sample(attrs: dict) -> Kernel:
    ref = OPS["sample"].reference

    def sample(logits, temperature, top_k, top_p, seeds):
        # the check on numpy's view: after a decode step's weights have swept the caches, each
        # torch op's first call costs tens of microseconds (its code fetched again)
        if not (temperature.numpy() > 0).any():
            native = native_rows() if logits.is_cpu and logits.dtype == torch.float32 and logits.dim() == 2 \
                and logits.stride(1) == 1 and logits.shape[1] > 0 else None
            return native.argmax(logits) if native is not None else ref(logits, temperature, top_k, top_p, seeds)
        return ref(logits, temperature, top_k, top_p, seeds)

    def bind_new(logits, temperature, top_k, top_p, seeds) -> tuple[Bound, list[RunOutput]] | None:
        """In a step program: the argmax of the run's logits where no row has a temperature above
        0 (a stop holds the run before it otherwise: the draw runs from Python)."""
        if not isinstance(logits, RunOutput) or logits.dtype != torch.float32 or len(logits.shape) != 2 \
                or logits.shape[1] == 0 or not isinstance(temperature, torch.Tensor) \
                or temperature.dtype != torch.float32 or not temperature.is_contiguous() or native_rows() is None:
            return None
        tokens = RunOutput(logits.shape[:1], torch.int64)
        return Bound([NativeStop(temperature, at_most=0.0), program_op("argmax_to", logits, tokens)]), [tokens]

    sample.bind_new = bind_new
    return sample


@factory("spec_verify")
def _spec_verify(attrs: dict) -> Kernel:
    ref = OPS["spec_verify"].reference

    def spec_verify(tokens: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
        """The reference, except that a step without drafts (every row its sequence's last, as in
        plain decoding) keeps every token after one check instead of the reference's ten ops."""
        if not (draft_tokens.numpy() >= 0).any():
            return tokens  # the sampler's fresh tensor, as it is (no torch op: see sample)
        return ref(tokens, draft_tokens)

    def bind_new(tokens, draft_tokens) -> tuple[Bound, list] | None:
        """In a step program: the tokens as they are, behind a stop that holds the run where a row has a draft."""
        if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dtype != torch.int64 \
                or not draft_tokens.is_contiguous():
            return None
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
