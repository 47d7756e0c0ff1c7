"""Passes: cleanup, fusion, lowering; PassManager and the standard pipelines."""
from .cleanup import cse, dce, fold_constants
from .fuse_linears import fuse_sibling_linears
from .fuse_swiglu import fuse_swiglu
from .manager import Pass, PassManager, PassReport


def cleanup_passes() -> list[Pass]:
    return [Pass("dce", dce), Pass("cse", cse), Pass("fold_constants", fold_constants)]


def fusion_passes() -> list[Pass]:
    return [Pass("fuse_sibling_linears", fuse_sibling_linears), Pass("fold_constants", fold_constants),
            Pass("fuse_swiglu", fuse_swiglu), Pass("dce", dce)]


__all__ = [
    "Pass",
    "PassManager",
    "PassReport",
    "cleanup_passes",
    "cse",
    "dce",
    "fold_constants",
    "fuse_sibling_linears",
    "fuse_swiglu",
    "fusion_passes",
]
