"""Passes: cleanup, fusion, lowering; PassManager and the standard pipelines."""
from ..errors import DeepfuseError
from .cleanup import cse, dce, fold_constants
from .fuse_add_rms_norm import fuse_add_rms_norm
from .fuse_linears import fuse_sibling_linears
from .fuse_moe import fuse_moe, fuse_shared_experts
from .fuse_norm_linear import fuse_norm_linear
from .fuse_qkv_attention import fuse_qkv_attention
from .fuse_qkv_rope import fuse_qkv_rope
from .fuse_split_biases import fuse_split_biases
from .fuse_swiglu import fuse_swiglu
from .fuse_swiglu_linear import fuse_swiglu_linear
from .manager import Pass, PassManager, PassReport
from .quantize import quantize_head_w8a8, quantize_int4, quantize_int4_a8, quantize_w8a8

QUANT_MODES = ("int4", "int4-head", "int4-head8", "int4-a8", "w8a8")


def cleanup_passes() -> list[Pass]:
    return [Pass("dce", dce), Pass("cse", cse), Pass("fold_constants", fold_constants)]


_REGISTERED: dict[str, Pass] = {}


def register_fusion(p: Pass) -> None:
    """Adds `p` to every fusion pipeline, after the built-in fusions (same name: replaced)."""
    _REGISTERED[p.name] = p


def unregister_fusion(name: str) -> None:
    _REGISTERED.pop(name, None)


def fusion_passes() -> list[Pass]:
    # fuse_moe first: it owns the router linear, which fuse_sibling_linears would otherwise
    # merge with a shared expert's gate/up projections (they read the same activation)
    return [fuse_moe, Pass("fuse_sibling_linears", fuse_sibling_linears), Pass("fuse_split_biases", fuse_split_biases),
            Pass("fold_constants", fold_constants),
            fuse_swiglu, fuse_shared_experts, Pass("fold_constants", fold_constants), fuse_add_rms_norm,
            *_REGISTERED.values(), Pass("dce", dce)]


def prologue_passes() -> list[Pass]:
    """Fusions into GEMM prologues and the cache write; after quantization (they match dense linears)."""
    return [fuse_norm_linear, fuse_swiglu_linear, Pass("fuse_qkv_rope", fuse_qkv_rope), fuse_qkv_attention,
            Pass("dce", dce)]


def quant_passes(quant: str | None) -> list[Pass]:
    """Quantization: None (weights stay in the compile dtype), "int4" (weight-only, the LM head
    stays in the compile dtype), "int4-head" (int4 with the LM head int4 too), "int4-head8" (int4
    with the LM head W8A8), "int4-a8" (int4 weights times int8 activations per group of 32, the LM
    head W8A8) or "w8a8" (int8 weights and activations, the LM head included)."""
    if quant is None:
        return []
    if quant not in QUANT_MODES:
        raise DeepfuseError(f"unknown quantization {quant!r} (available: {', '.join(QUANT_MODES)})")
    if quant == "w8a8":
        return [Pass("quantize_w8a8", quantize_w8a8(64))]
    if quant == "int4-a8":
        return [Pass("quantize_int4_a8", quantize_int4_a8(32)), Pass("quantize_head_w8a8", quantize_head_w8a8(64))]
    passes = [Pass("quantize_int4", quantize_int4(32, head=quant == "int4-head"))]
    if quant == "int4-head8":
        passes.append(Pass("quantize_head_w8a8", quantize_head_w8a8(64)))
    return passes


__all__ = [
    "Pass",
    "PassManager",
    "PassReport",
    "QUANT_MODES",
    "cleanup_passes",
    "cse",
    "dce",
    "fold_constants",
    "fuse_add_rms_norm",
    "fuse_moe",
    "fuse_norm_linear",
    "fuse_qkv_attention",
    "fuse_qkv_rope",
    "fuse_shared_experts",
    "fuse_swiglu_linear",
    "prologue_passes",
    "fuse_sibling_linears",
    "fuse_split_biases",
    "fuse_swiglu",
    "fusion_passes",
    "quant_passes",
    "register_fusion",
    "unregister_fusion",
    "quantize_int4",
    "quantize_int4_a8",
    "quantize_w8a8",
]
