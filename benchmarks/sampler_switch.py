"""reference_sampler(): while it is active, the CPU steps of engines in this process run as where the
self-check refused the native sampler (sample.cpp): a step program stops before the sampler and
the `sample` op's reference draws from Python. For A/B runs of the native sampler in one process."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def reference_sampler(on: bool = True):
    """on=False: does nothing (so callers can pass a flag). Steps bound while it is active keep the
    stop form afterwards: give each setting its own engine, or bind inside it only."""
    if not on:
        yield
        return
    from deepfuse.codegen.cpu import row_kernels, tail_kernels

    kept = row_kernels.native_sampler
    row_kernels.native_sampler = tail_kernels.native_sampler = lambda: None
    try:
        yield
    finally:
        row_kernels.native_sampler = tail_kernels.native_sampler = kept
