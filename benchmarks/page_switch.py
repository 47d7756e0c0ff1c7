"""small_pages(): while it is active, CPU executors built in this process move their packed weights
into a buffer of 4 KiB pages (MADV_NOHUGEPAGE) instead of 2 MiB ones, for A/B runs of the
huge-page weights in one process (codegen/cpu/huge_pages.py)."""
from __future__ import annotations

import contextlib
from functools import partial


@contextlib.contextmanager
def small_pages(on: bool = True):
    """on=False: does nothing (so callers can pass a flag). Build the executor inside it."""
    if not on:
        yield
        return
    from deepfuse.codegen.cpu import executor, huge_pages

    kept = executor.into_huge_pages
    executor.into_huge_pages = partial(huge_pages.into_huge_pages, huge=False)
    try:
        yield
    finally:
        executor.into_huge_pages = kept
