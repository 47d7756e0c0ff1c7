"""The collective launches of a partitioned ascend950 plan (all_reduce, all_gather of
ir/opdefs_collective.py) as HCCL calls in the generated host code (project.py). Each is queued
on the step's stream after the kernels before it, on the communicator the caller passes in
DeepfuseLaunchArgs.comm (one HcclComm per rank, HcclCommInitRootInfo):

    all_reduce  x[...] (in[0])            -> HcclAllReduce(in[0], out[0], numel, type, HCCL_REDUCE_SUM)
    all_gather  x[..., n, ...] along dim  -> dim 0: HcclAllGather(in[0], out[0], numel, type)
                                             else HcclAllGather into tmp[0] [world, ...x] (rank-major),
                                             then per rank one aclrtMemcpy2dAsync of its rows into
                                             its n-column band of out[0]

This file owns the plan entries and the C++ of these launches, not the emulated HCCL (emu/).
"""
from __future__ import annotations

from ...ir import Node
from .kernel import SIZE

COLLECTIVES = ("all_reduce", "all_gather")
HCCL_TYPES = {"f32": "HCCL_DATA_TYPE_FP32", "f16": "HCCL_DATA_TYPE_FP16", "bf16": "HCCL_DATA_TYPE_BFP16",
              "i32": "HCCL_DATA_TYPE_INT32", "i64": "HCCL_DATA_TYPE_INT64"}


def collective_launch(node: Node) -> dict:
    """The plan entries of a collective node: "collective" (the host function's name) and "tmps"
    (all_gather off dim 0: the [world, ...x] buffer HCCL gathers into)."""
    x = node.inputs[0].type
    world, rank = node.attrs["world"], len(x.shape)
    name = f"hccl_{node.op}_{x.dtype}_r{rank}_w{world}"
    tmps = []
    if node.op == "all_gather" and node.attrs["dim"] != 0:
        name += f"_d{node.attrs['dim']}"
        tmps = [{"shape": [world, *x.shape], "dtype": x.dtype}]
    return {"collective": name, "tmps": tmps}


def collectives_of(plan: dict) -> dict[str, dict]:
    """The plan's distinct collective functions by name -> one launch using it."""
    return {p["collective"]: p for p in plan["launches"] if p.get("collective")}


def _count(dims: range) -> str:
    return " * ".join(f"(uint64_t)a->in_shape[0][{d}]" for d in dims) or "1"


def collective_fn(name: str, p: dict) -> str:
    """The C++ host function `name` (a KernelFn) of collective launch p."""
    dtype, shape, world = p["out_dtype"][0], p["in_shape"][0], p["attrs"]["world"]
    comm, ty = "(HcclComm)a->comm", HCCL_TYPES[dtype]
    head = (f"// {p['op']} of a {dtype} {shape} (in_shape at run time) over the {world} ranks of a->comm\n"
            f"static aclError {name}(aclrtStream stream, const DeepfuseLaunchArgs* a)\n{{\n"
            f"    uint64_t count = {_count(range(len(shape)))};\n"
            f"    if (count == 0) {{\n        return ACL_SUCCESS;\n    }}\n")
    if p["op"] == "all_reduce":
        call = f"HcclAllReduce(a->in[0], a->out[0], count, {ty}, HCCL_REDUCE_SUM, {comm}, stream)"
        return head + f"    return {call} == HCCL_SUCCESS ? ACL_SUCCESS : ACL_ERROR_FAILURE;\n}}\n"
    dim = p["attrs"]["dim"]
    if dim == 0:
        call = f"HcclAllGather(a->in[0], a->out[0], count, {ty}, {comm}, stream)"
        return head + f"    return {call} == HCCL_SUCCESS ? ACL_SUCCESS : ACL_ERROR_FAILURE;\n}}\n"
    return head + f"""\
    if (HcclAllGather(a->in[0], a->tmp[0], count, {ty}, {comm}, stream) != HCCL_SUCCESS) {{
        return ACL_ERROR_FAILURE;
    }}
    // rank r's slice is rows x width bytes at tmp[0] + r * count; its band of each output row starts at r * width
    uint64_t rows = {_count(range(dim))};
    uint64_t width = count / rows * {SIZE[dtype]};
    for (uint64_t r = 0; r < {world}; r++) {{
        aclError rc = aclrtMemcpy2dAsync((uint8_t*)a->out[0] + r * width, {world} * width,
                                         (const uint8_t*)a->tmp[0] + r * count * {SIZE[dtype]}, width, width, rows,
                                         ACL_MEMCPY_DEVICE_TO_DEVICE, stream);
        if (rc != ACL_SUCCESS) {{
            return rc;
        }}
    }}
    return ACL_SUCCESS;
}}
"""


__all__ = ["COLLECTIVES", "collective_fn", "collective_launch", "collectives_of"]
