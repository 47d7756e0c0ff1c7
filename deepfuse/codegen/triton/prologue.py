"""Generated GEMM prologues for the Triton templates: the A operand of rms_norm_linear,
add_rms_norm_linear and swiglu_linear (dense, int4 or W8A8) is the prologue op's decomposition,
lowered to the kernel IR (kernel/build.kernel_of) and rendered into the template's `$PRE` and
`$LOAD_A` slots. No prologue is hand-written; any op a prologue-fusion pass puts before a GEMM
renders the same way.

The prologue's index space is (rows, 1, K): the GEMM's [BM, BK] A tiles are its tiles. Values
below a reduction (RMSNorm's sum of squares) are computed in `$PRE`, one loop over K per
reduction level; the A operand's own level is computed tile by tile in the GEMM's K loop. An
output other than A (add_rms_norm_linear's residual sum) is stored once, by the pid_n == 0
programs, in the loop where it is computed.
"""
from __future__ import annotations

import re

from ...frontend import ops
from ...ir import Node
from ...kernel.build import kernel_of
from ...kernel.ir import Kernel, elem_closure, levels
from .generated import _Body

PROLOGUES = {  # op -> (the prologue over its first n inputs, n)
    "rms_norm_linear": (lambda a: (lambda x, w: ops.rms_norm(x, w, eps=a["eps"])), 2),
    "add_rms_norm_linear": (lambda a: (lambda x, r, w: ops.add_rms_norm(x, r, w, eps=a["eps"])), 3),
    "swiglu_linear": (lambda a: (lambda x: ops.swiglu(x)), 1),
}
ROWS = """    rb = xrow[:, None].to(tl.int64)
    pm = row_ok[:, None]
    g = 0
"""


def _tile_names(line: str) -> str:
    """The renderer's names in the GEMM's terms: its row mask is pm (the template's rm holds
    row indices), its [BR, BC] tiles are [BM, BK]."""
    return re.sub(r"\bBC\b", "BK", re.sub(r"\bBR\b", "BM", re.sub(r"\brm\b", "pm", line)))


def prologue_kernel(node: Node) -> tuple[Kernel, list[int]]:
    make, n_in = PROLOGUES[node.op]
    k, reads, _ = kernel_of(make(node.attrs), [v.type for v in node.inputs[:n_in]], f"{node.op}_prologue")
    return k, reads


def render(node: Node) -> tuple[str, str, list[tuple[int, str]], list[tuple[int, str]]]:
    """($PRE, $LOAD_A, [(node input, parameter)], [(node output, parameter)]) for the node's prologue.
    Input 0's parameter is x_ptr (the templates read its dtype); the others p<i>_ptr."""
    k, reads = prologue_kernel(node)
    a_buf = k.outputs[-1].name  # the A operand; earlier outputs are node outputs
    ins = {b.name: ("x_ptr" if reads[i] == 0 else f"p{reads[i]}_ptr") for i, b in enumerate(k.inputs)}
    outs = {b.name: f"s{j}_ptr" for j, b in enumerate(k.outputs[:-1])}
    body = _Body(k, ins | outs | {a_buf: "unused"})
    lv = levels(k)
    a_store = next(i for i in k.body if i.op == "store" and i.attrs["buf"] == a_buf)
    last = lv[a_store.args[0]]
    pre: list[str] = []
    body.lines = []
    for i in k.body:  # row values below every reduction: the constants
        if i.kind == "row" and i.op not in ("reduce", "store", "load") and lv[i.out] == 0:
            body.instr(i, 1)
    consts = "\n".join(body.lines) + ("\n" if body.lines else "")
    for p in range(last + 1):
        consumers = [i for i in k.body if (i.op == "reduce" and lv[i.args[0]] == p)
                     or (i.op == "store" and i.attrs["buf"] != a_buf and lv[i.args[0]] == p)]
        if p == last:
            consumers.append(a_store)
        need = elem_closure(k, [i.args[0] for i in consumers])
        body.lines = []
        inner = 2  # in $PRE's own loop over K, or in the template's (LOAD_A)
        if p < last:
            for i in consumers:
                if i.op == "reduce":
                    body.reduce_init(i, 1)
            body.put(f"for k0 in range(0, {k.space[2]}, BK):", 1)
            body.put("kk = k0 + rk", 2)
            body.put(f"k_ok = kk < {k.space[2]}", 2)
        body.put("cols = kk[None, :]", inner)
        body.put("cm = k_ok[None, :]", inner)
        for i in k.body:
            if i.out in need:
                body.instr(i, inner)
            elif i in consumers and i is not a_store:
                if i.op == "reduce":
                    body.reduce_step(i, inner)
                else:  # a non-A output: stored once, by the first column of programs
                    body.put("if pid_n == 0:", inner)
                    body.instr(i, inner + 1)
        if p < last:
            for i in consumers:
                if i.op == "reduce":
                    body.reduce_fold(i, 1)
            for i in k.body:  # row values of the next level
                if i.kind == "row" and i.op not in ("reduce", "store", "load") and lv[i.out] == p + 1:
                    body.instr(i, 1)
        else:
            body.put(f"a = v{a_store.args[0]}", inner)
        block = "\n".join(_tile_names(line) for line in body.lines) + "\n"
        pre.append(block)
    load_a = pre.pop()
    row_loads = [i for i in k.body if i.op == "load" and i.kind == "row"]
    if row_loads:
        raise ValueError(f"{node.op}'s prologue reads a per-row value, which the GEMM prologue does not load")
    return ROWS + consts + "".join(pre), load_a, [(reads[i], ins[b.name]) for i, b in enumerate(k.inputs)], \
        [(j, outs[b.name]) for j, b in enumerate(k.outputs[:-1])]
