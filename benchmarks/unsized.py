"""The sm90/sm100 decode kernels as they were before they were sized for their shapes, for the
GPU benchmarks' A/B: every GEMM runs its one template kernel at any row count (no swapped,
split-K decode kernel and reduce; fused_moe's GEMMs their 64- or 128-row blocks), and
attention runs the one-pass paged kernel for every sequence (no split-KV kernels). Only a
comparison point: the engine never builds this.

    with one_pass_attention():      # while the plan (or artifact) is built
        art = deepfuse.compile(model, target=..., dtype=...)
    strip_sizing(art.runner)        # then drop the decode kernels from its launches
"""
from __future__ import annotations

import contextlib
from unittest import mock


@contextlib.contextmanager
def one_pass_attention():
    """Plans built inside emit the one-pass attention kernel with no short sequences (QSPLIT 0):
    it attends every sequence itself."""
    from deepfuse.codegen.triton import emit

    sized = emit.sizing
    with mock.patch.object(emit, "sizing", lambda node, arch: {**sized(node, arch), "QSPLIT": 0}):
        yield


def sizing_kernel(spec: dict) -> bool:
    """A kernel that only the sizing added: split-K decode GEMMs and their reduces, split-KV
    attention and its reduce, fused_moe's set of 16-row blocks (splitk.py, split_kv.py, emit.py
    name them so)."""
    name = spec["name"]
    return name.startswith("reduce_") or name.endswith(("_decode", "_split", "_small"))


def strip_sizing(runner) -> int:
    """Drops the sizing's kernels from a TritonRunner's launches and the `when` of the kernels
    kept (the template GEMM and one-pass attention then run at every shape); returns how many
    kernels were dropped. The runner must have been built under one_pass_attention()."""
    dropped, launches = 0, []
    for p, kernels, ref in runner.launches:
        kept = []
        for spec, fn in kernels:
            if sizing_kernel(spec):
                dropped += 1
                continue
            kept.append(({k: v for k, v in spec.items() if k != "when"}, fn))
        launches.append((p, kept, ref))
    runner.launches = launches
    return dropped
