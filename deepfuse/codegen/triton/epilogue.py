"""A GEMM template with a generated epilogue (a with_epilogue node): the kernel IR of the
epilogue is rendered in place of the template's store, over the [BM, BN] accumulator tile, so
the GEMM's result never goes to memory. The template is untouched: its `$STORE` slot is the
one hook every GEMM has.

The tile's rows and columns play the kernel IR's r and c (index space (T, 1, N)); the loads of
the epilogue's input that the GEMM feeds read the accumulator, rounded to the result's dtype
as the template's store would round it; every other load and store is the renderer's own.
"""
from __future__ import annotations

from string import Template

from ...ir import Node
from ...kernel.ir import Kernel
from ..device_epilogue import split_epilogue
from . import templates as T
from .generated import PTR, _Body, with_helpers

TILE = """    rb = rm[:, None].to(tl.int64)
    rm = row_ok[:, None]
    cols = rn[None, :]
    cm = cols < $N
    g = 0
"""


def emit_with_epilogue(node: Node, name: str, arch: str, invariant: bool = False) -> list[dict]:
    from .emit import EMITTERS

    inner, epi, y = split_epilogue(node)
    specs = EMITTERS[inner.op](inner, name, arch, invariant=True) if invariant else EMITTERS[inner.op](inner, name, arch)
    k = Kernel.from_json(node.attrs["kernel"])
    feeds, n_inner = node.attrs["feeds"], node.attrs["n_inner"]
    n = y.type.shape[1]
    fed = k.inputs[feeds].name
    body = _Body(k, {b.name: f"e{i}" for i, b in enumerate(k.buffers) if b.name != fed})
    for ins in k.body:
        if ins.op == "load" and ins.attrs["buf"] == fed:
            acc = "acc" if y.type.dtype == "f32" else \
                ("_rne_bf16(acc).to(tl.bfloat16)" if y.type.dtype == "bf16" else "acc.to(tl.float16)")
            body.put(f"v{ins.out} = {acc}", 1)
        else:
            body.instr(ins, 1)
    code = Template(TILE).substitute(N=n) + "\n".join(body.lines) + "\n"
    store = Template(T.GEMM_STORE).substitute(N=n)
    if not any(store in spec["source"] for spec in specs):
        raise ValueError(f"{inner.op}'s template has no store slot for an epilogue")
    return [with_epilogue(spec, store, code, k, feeds, n_inner) if store in spec["source"] else spec
            for spec in specs]


def with_epilogue(spec: dict, store: str, code: str, k: Kernel, feeds: int, n_inner: int) -> dict:
    """One GEMM kernel (the template, or splitk.py's decode GEMM or reduce) with the epilogue's
    code in place of its y store."""
    fed = k.inputs[feeds].name
    params = {b.name: f"e{i}" for i, b in enumerate(k.buffers) if b.name != fed}
    src = spec["source"].replace(store, code)
    src = src.replace("y_ptr, M,", "y_ptr, " + "".join(f"{p}, " for p in params.values()) + "M,", 1)
    src = with_helpers(src)
    ins_of = {b.name: i for i, b in enumerate(k.inputs)}
    outs_of = {b.name: j for j, b in enumerate(k.outputs)}

    def form(b) -> list:
        if b.role == "out":
            return ["out", outs_of[b.name]]
        i = ins_of[b.name]
        return ["in", n_inner + (i if i < feeds else i - 1)]

    sig, args = {}, []
    for (p, t), a in zip([(p, t) for p, t in spec["signature"].items() if t != "constexpr"], spec["args"]):
        sig[p], args = t, args + [["out", 0] if p == "y_ptr" else a]
        if p == "y_ptr":
            for b in k.buffers:
                if b.name != fed:
                    sig[params[b.name]] = PTR[b.dtype]
                    args.append(form(b))
    sig |= {c: "constexpr" for c in spec["constexprs"]}
    return {**spec, "source": src, "signature": sig, "args": args}
