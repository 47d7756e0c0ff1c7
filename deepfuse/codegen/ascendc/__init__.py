"""The ascend950 target (Huawei Ascend 950, AscendC): fused graph -> AscendC kernels (vector
kernels on the AI vector cores, GEMMs on the cube cores through the Matmul API) -> a CANN
project (kernel sources, host launch code, tiling, CMake; see project.py).

The plan is the CPU plan's slot layout plus, per launch, the kernels emitted for its node (in
launch order, with their argument forms and tiling expressions) and the scratch tensors they
share. A collective (all_reduce, all_gather of a tensor-parallel rank's step) is an HCCL call of the
host code (collective.py). A launch without kernels runs its op's reference: on this machine,
in the emulator runner; in the CANN project's host code, it is listed as a host step. No Ascend compiler runs
here: the kernels are checked by compiling them with g++ against emu/ (runner.py).
"""
from __future__ import annotations

from dataclasses import replace

from ...ir import Graph, Node
from ...ir.opdefs_fused import is_q4a8
from ..device_epilogue import remap, result_to_tmp, split_epilogue
from ..device_plan import PLACEHOLDER, device_plan, named
from .collective import COLLECTIVES, collective_launch
from .emit import emit_gather, emit_vocab_gather
from .emit_attention import emit_qkv_attention
from .emit_gemm import emit_gemm
from .emit_generated import emit_generated, renderable
from .emit_moe import emit_fused_moe
from .emit_sample import emit_sample, emit_spec_verify
from .emit_w8a8 import QUANT_UB, emit_w8a8, quantize_ub_bytes
from .kernel import FLOATS, SIZE

DESCRIPTION = "Huawei Ascend 950 (arch 3510), AscendC kernels (checked in deepfuse's CPU emulator)"


def _single(fn):
    return lambda node, name: {"kernels": [fn(node, name)], "tmps": []}


EMITTERS = {
    "embedding": _single(emit_gather),
    "take_rows": _single(emit_gather),
    "vocab_embedding": _single(emit_vocab_gather),
    "linear": emit_gemm,
    "linear_q4": emit_gemm,
    "linear_w8a8": emit_w8a8,
    "logits": emit_gemm,
    "logits_w8a8": emit_w8a8,
    "rms_norm_linear": emit_gemm,
    "add_rms_norm_linear": emit_gemm,
    "swiglu_linear": emit_gemm,
    "qkv_attention": emit_qkv_attention,
    "fused_moe": emit_fused_moe,
    "sample": _single(emit_sample),
    "spec_verify": _single(emit_spec_verify),
    "kernel": emit_generated,  # generated kernels (deepfuse/kernel IR), rendered by emit_generated.py
}


def emit_with_epilogue(node: Node, name: str) -> dict:
    """A GEMM template and its generated epilogue as one launch: the GEMM writes its result into a
    scratch tensor that the epilogue kernel (vector cores) reads (device_epilogue.py)."""
    inner, epi, y = split_epilogue(node)
    out = EMITTERS[inner.op](inner, name)
    tmp = len(out["tmps"])
    kernels = [replace(k, args=[result_to_tmp(a, tmp) for a in k.args]) for k in out["kernels"]]
    fed = emit_generated(epi, name + "_epilogue")["kernels"][0]
    n, feeds = node.attrs["n_inner"], node.attrs["feeds"]
    fed = replace(fed, args=[remap(a, n, feeds, tmp) for a in fed.args],
                  tiling=[[f, ct, remap(e, n, feeds, tmp)] for f, ct, e in fed.tiling])
    return {"kernels": kernels + [fed], "tmps": out["tmps"] + [{"shape": list(y.type.shape), "dtype": y.type.dtype}]}


EMITTERS["with_epilogue"] = emit_with_epilogue


def emittable(node: Node) -> bool:
    """f32 / bf16 / f16 graphs; generated kernels as far as emit_generated renders them; head dims
    that are not multiples of 16 and int4 shapes the kernel does not tile go to the reference (a
    host step)."""
    if node.op not in EMITTERS or is_q4a8(node.attrs):  # int4-a8 fused forms: their decomposition
        return False
    if node.op == "kernel":  # the renderer's own check: dtypes, ops and UB it handles
        return renderable(node)
    if node.op == "with_epilogue":
        inner, epi, _ = split_epilogue(node)
        return emittable(inner) and renderable(epi)
    if "act_group" in node.attrs:  # W8A8 (emit_w8a8.py): int8 K tiles in whole 32-byte fractal rows, and
        g = node.attrs["act_group"]  # an activation row the quantize kernel holds in UB whole
        k = node.inputs[1 if node.op in ("linear_w8a8", "logits_w8a8") else -2].type.shape[1]  # wq [N, K]
        return g % 32 == 0 and quantize_ub_bytes(k, SIZE[node.inputs[0].type.dtype], k // g) <= QUANT_UB
    if "group_size" in node.attrs:  # int4: K in whole 64-element repeats, groups of whole 32-byte halves
        k = 2 * node.inputs[-3].type.shape[1]
        return k % 64 == 0 and node.attrs["group_size"] % 16 == 0
    if any(v.type.dtype not in FLOATS + ("i32", "i64", "u8") for v in node.inputs + node.outputs):
        return False
    if node.op == "qkv_attention":
        return node.attrs["head_dim"] % 16 == 0
    return True


def build_plan(g: Graph) -> dict:
    plan = device_plan(g, "ascend950")
    for n, p in zip(g.nodes, plan["launches"]):
        if n.op in COLLECTIVES:  # HCCL calls of the host code
            p.update(collective_launch(n))
            continue
        if not emittable(n):
            continue
        emitted = EMITTERS[n.op](n, PLACEHOLDER)
        p["kernels"] = named(n, [k.to_json() for k in emitted["kernels"]])
        p["tmps"] = emitted["tmps"]
    return plan


__all__ = ["DESCRIPTION", "EMITTERS", "build_plan", "emittable"]
