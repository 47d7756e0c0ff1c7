"""A with_epilogue launch on a device target as two kernels of one launch: the template's kernels
write the GEMM result into a scratch tensor, then the generated epilogue kernel reads it there.
No template changes; the launch's argument forms are remapped (the result's ["out", 0] becomes
["tmp", t]; the epilogue's inputs become the launch's inputs or that scratch).
"""
from __future__ import annotations

from ..ir import OPS, Node, Value


def split_epilogue(node: Node) -> tuple[Node, Node, Value]:
    """(the template node, the epilogue's kernel node, the GEMM result between them)."""
    a = node.attrs
    k = a["n_inner"]
    (ty,) = OPS[a["inner"]].infer([v.type for v in node.inputs[:k]], a["inner_attrs"])
    y = Value("gemm_result", ty)
    inner = Node(a["inner"], node.inputs[:k], [y], a["inner_attrs"])
    extra = node.inputs[k:]
    epi = Node("kernel", extra[:a["feeds"]] + [y] + extra[a["feeds"]:], node.outputs,
               {"kernel": a["kernel"], "ops": a["ops"][1:]})
    return inner, epi, y


def remap(form, n_inner: int, feeds: int, tmp: int):
    """An epilogue kernel's argument or tiling form, rewritten for the with_epilogue launch."""
    if not isinstance(form, list) or not form:
        return form
    if form[0] in ("in", "shape") and isinstance(form[1], int):
        i = form[1]
        if i == feeds:
            return ["tmp" if form[0] == "in" else "tmp_shape", tmp, *form[2:]]
        return [form[0], n_inner + (i if i < feeds else i - 1), *form[2:]]
    return [remap(f, n_inner, feeds, tmp) if isinstance(f, list) else f for f in form]


def result_to_tmp(form, tmp: int):
    """A template kernel's form with its output 0 written to scratch `tmp` instead."""
    if form == ["out", 0]:
        return ["tmp", tmp]
    if isinstance(form, list):
        return [result_to_tmp(f, tmp) if isinstance(f, list) else f for f in form]
    return form
