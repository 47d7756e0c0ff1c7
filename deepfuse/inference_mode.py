"""inference_mode: a decorator that runs a function under torch.inference_mode(), entering it only
where it is not on already. The context manager's Python costs ~20 us a call where a decode step's
weights have just swept the caches (2-core Xeon, batch 1): a tenth of the step's host time, paid
again by every nested entry (an engine step, the model call inside it)."""
from __future__ import annotations

import functools

import torch


def inference_mode(f):
    @functools.wraps(f)
    def run(*args, **kw):
        if torch.is_inference_mode_enabled():
            return f(*args, **kw)
        with torch.inference_mode():
            return f(*args, **kw)

    return run
