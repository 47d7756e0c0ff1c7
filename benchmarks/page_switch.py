"""For A/B runs of codegen/cpu/huge_pages.py in one process; build the executor inside them.

small_pages(): CPU executors move their packed weights into a buffer of 4 KiB pages
(MADV_NOHUGEPAGE) instead of 2 MiB ones. unmoved_weights(): they leave them where packing put
them (tensors of their own, wherever the allocator placed each)."""
from __future__ import annotations

import contextlib
from functools import partial


@contextlib.contextmanager
def _mover(replacement):
    from deepfuse.codegen.cpu import executor

    kept = executor.into_huge_pages
    executor.into_huge_pages = replacement
    try:
        yield
    finally:
        executor.into_huge_pages = kept


def small_pages(on: bool = True):
    """on=False: does nothing (so callers can pass a flag)."""
    from deepfuse.codegen.cpu import huge_pages

    return _mover(partial(huge_pages.into_huge_pages, huge=False)) if on else contextlib.nullcontext()


def unmoved_weights(on: bool = True):
    """on=False: does nothing (so callers can pass a flag)."""
    return _mover(lambda objects, keep: (objects, 0)) if on else contextlib.nullcontext()
