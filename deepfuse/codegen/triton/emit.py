"""Triton emitters: IR node + tile table -> kernel specs (source, signature, grid, arguments).

A spec is data (JSON): the runner binds its `args` to the launch's tensors and the AOT step
compiles its `source` for sm90/sm100. Argument forms:
    ["in", i] / ["out", j] / ["tmp", j]    a node input / output / per-launch scratch tensor
    ["shape", i, axis] / ["stride", i, axis] / ["half_numel", i]   ints read off input i
    ["index", i, j]                         input i's j-th slice (the cache's v half, cache[1])
    ["tmp_shape", j, axis]                  an int read off scratch tensor j
    ["min", a, b] / ["mul", a, b]          sizes (a, b: ints or forms)
Grid entries: an int, an argument form above, or ["cdiv", form, block].
`when`: [op, form, form] (op: le, gt, ne): the runner launches the kernel only when it holds for
the step's shapes (GEMMs: the decode tiles up to DECODE_ROWS rows, splitk.py; attention: the
one-pass kernel unless every sequence has one query, split_kv.py; fused_moe: its 16-row-block
set up to DECODE_ROWS tokens). `scratch` (emit-time only):
the kernel's scratch tensors, which build_plan collects into the launch's `tmps` in kernel
order, each with a symbolic `shape` or `dims` of forms.
`requires`: [input, axis, n, what]: the kernel was built for input.shape[axis] == n (or <= n
for "at most"); the runner refuses a step that breaks it, naming `what`.
Ops without an emitter run their torch reference on the device (the plan says which).
"""
from __future__ import annotations

import math
from string import Template

from ...ir import Node
from ...ir.opdefs_fused import is_q4a8
from ..device_epilogue import split_epilogue
from . import sample
from . import templates as T
from .epilogue import emit_with_epilogue
from .generated import emit_kernel, renderable, with_helpers
from .moe_align import emit_route_align
from .prologue import PROLOGUES
from .prologue import render as render_prologue
from .split_kv import emit_split_kv, sizing
from .splitk import emit_decode
from .tiles import DECODE_ROWS, pow2, tiles_for

PTR = {"f32": "*fp32", "bf16": "*bf16", "f16": "*fp16", "i32": "*i32", "i64": "*i64", "u8": "*u8"}
SMAX = 256  # most sequences a step may hold (logits, attention read query_lens whole)


def _source(name: str, body: str, **subs) -> str:
    return T.HEADER + Template(Template(body).safe_substitute(NAME=name, **subs)).safe_substitute(**subs)


def _spec(name, source, params: list[tuple[str, str, list]], consts: dict, grid: list, tiles: dict) -> dict:
    """params: (arg name, signature type, argument form) in kernel order."""
    return {"name": name, "source": source, "signature": {p: t for p, t, _ in params} | {c: "constexpr" for c in consts},
            "args": [form for _, _, form in params], "constexprs": consts, "grid": grid,
            "num_warps": tiles.get("num_warps", 4), "num_stages": tiles.get("num_stages", 2)}


def _ptr(node: Node, kind: str, i: int) -> str:
    v = node.inputs[i] if kind == "in" else node.outputs[i]
    return PTR[v.type.dtype]


def emit_embedding(node: Node, name: str, arch: str) -> list[dict]:
    d = node.inputs[0].type.shape[1]
    tiles = tiles_for(arch, "row", node)
    params = [("table_ptr", _ptr(node, "in", 0), ["in", 0]), ("ids_ptr", _ptr(node, "in", 1), ["in", 1]),
              ("y_ptr", _ptr(node, "out", 0), ["out", 0])]
    return [_spec(name, _source(name, T.EMBEDDING, D=d), params, {"BD": pow2(d)}, [["shape", 1, 0], 1, 1], tiles)]


def emit_gemm(node: Node, name: str, arch: str, invariant: bool = False) -> list[dict]:
    """linear, linear_q4, linear_w8a8, logits, logits_w8a8, rms_norm_linear, add_rms_norm_linear,
    swiglu_linear; the projection dense, int4 (attr group_size: packed, scales, mins in place of W)
    or W8A8 (attr act_group: wq, scale; the K tile is one activation group, templates.DOT_W8A8).
    invariant: one kernel form at every row count, splitk.py's fixed split (W8A8: the template)."""
    op, ins = node.op, node.inputs
    x = ins[0].type
    first_w = {"linear": 1, "linear_q4": 1, "linear_w8a8": 1, "logits": 1, "logits_w8a8": 1, "rms_norm_linear": 2,
               "add_rms_norm_linear": 3, "swiglu_linear": 1}[op]
    q4, w8 = "group_size" in node.attrs, "act_group" in node.attrs
    n = ins[first_w].type.shape[0]
    k = ins[first_w].type.shape[1] * (2 if q4 else 1)
    xw = x.shape[1]
    tiles = tiles_for(arch, "gemm", node)
    consts = {k_: tiles[k_] for k_ in ("BM", "BN", "BK")}
    if w8:
        consts["BK"] = node.attrs["act_group"]  # a K tile holds exactly one group
    params = [("x_ptr", PTR[x.dtype], ["in", 0])]
    rows, pre, load, m = T.ROWS_PLAIN, "", T.LOAD_PLAIN, ["shape", 0, 0]
    if q4:
        weight = [("packed_ptr", "*u8", ["in", first_w]), ("scales_ptr", "*fp32", ["in", first_w + 1]),
                  ("mins_ptr", "*fp32", ["in", first_w + 2])]
    elif w8:
        weight = [("wq_ptr", "*u8", ["in", first_w]), ("wscale_ptr", "*fp32", ["in", first_w + 1])]
    else:
        weight = [("w_ptr", PTR[ins[first_w].type.dtype], ["in", first_w])]
    requires = []
    if op in ("logits", "logits_w8a8"):
        r = 1 + len(weight)  # the sample rows follow the weight's operands
        params += weight + [("rows_ptr", _ptr(node, "in", r), ["in", r])]
        rows, m = T.ROWS_TAKE, ["shape", r, 0]
    elif op in PROLOGUES:  # the A operand is a generated prologue (prologue.py)
        pre, load, reads, writes = render_prologue(node)
        params = [(p, PTR[ins[i].type.dtype], ["in", i]) for i, p in reads] + weight
        params += [(p, PTR[node.outputs[j].type.dtype], ["out", j]) for j, p in writes]
    else:
        params += weight
    sig = ", ".join(p for p, _, _ in params)
    parts = dict(PARAMS=sig, ROWS=rows, PRE=pre, LOAD_A=load, LOAD_B=T.LOAD_B_Q4 if q4 else T.LOAD_B_W8 if w8 else
                 T.LOAD_B_DENSE, DOT=T.DOT_W8A8 if w8 else T.DOT, FINISH=T.FINISH_W8A8 if w8 else "",
                 K=k, N=n, XW=xw, G=node.attrs.get("group_size", 1),
                 EXTRA=", SMAX: tl.constexpr" if "SMAX" in consts else "")
    src = with_helpers(_source(name, T.GEMM, STORE=T.GEMM_STORE, **parts))
    out = len(node.outputs) - 1
    params.append(("y_ptr", _ptr(node, "out", out), ["out", out]))
    # up to DECODE_ROWS rows, splitk.py's kernels; W8A8 keeps this one (its sums' order is the reference's)
    decode = [] if w8 else emit_decode(name, parts, params, m, tiles_for(arch, "gemm_decode", node), arch, _source,
                                       _spec)
    params.append(("M", "i32", m))
    grid = [["cdiv", m, consts["BM"]], ["cdiv", ["const", n], consts["BN"]], 1]
    spec = _spec(name, src, params, consts, grid, tiles)
    spec["requires"] = requires
    if decode and invariant:  # a row's sums in one order whatever the step's rows: the decode form at every M
        return [{k_: v for k_, v in s.items() if k_ != "when"} for s in decode]
    if decode:
        spec["when"] = ["gt", m, DECODE_ROWS]
    if w8:
        spec["fp_fusion"] = False  # acc + dot * d rounds twice, as the reference's (no fma)
    return [spec, *decode]


def emit_qkv_attention(node: Node, name: str, arch: str, invariant: bool = False) -> list[dict]:
    """Split + RoPE + cache write into a scratch q, then paged attention: the one-pass kernel,
    and split_kv.py's kernels for sequences of a few queries. invariant: the one-pass kernel for
    every sequence (a prompt's rows then never depend on how it was chunked)."""
    a = node.attrs
    h, hkv, hd = a["num_heads"], a["num_kv_heads"], a["head_dim"]
    qkv, pos, cache, slots, tables, lens, qlens = (v.type for v in node.inputs[:7])
    # the cache's block size is a step dim (BS); the kernel's tiles need it fixed at compile time
    bs = cache.shape[2] if isinstance(cache.shape[2], int) else tiles_for(arch, "attention", node)["block_size"]
    qw, kw = a["sizes"][0], a["sizes"][1]
    rope_tiles = tiles_for(arch, "row", node)
    normed = "qk_norm_eps" in a  # Qwen3's q_norm, k_norm after the seven attention inputs
    sinks = a.get("sinks", False)  # then gpt-oss's sink logits [H]
    norm = lambda w: Template(T.HEAD_NORM).safe_substitute(W=w, EPS=repr(float(a["qk_norm_eps"]))) if normed else ""
    rope = _source(name + "_rope", T.ROPE_CACHE, HALF=hd // 2, HD=hd, LOG2_THETA=repr(math.log2(a["theta"])),
                   W=qkv.shape[1], H=h, HKV=hkv, QW=qw, KW=kw, NORM_PARAMS="qn_ptr, kn_ptr, " if normed else "",
                   QNORM=norm("qn_ptr"), KNORM=norm("kn_ptr"))
    rope_params = [("qkv_ptr", PTR[qkv.dtype], ["in", 0]), ("pos_ptr", PTR[pos.dtype], ["in", 1]),
                   ("cache_ptr", PTR[cache.dtype], ["in", 2]), ("slots_ptr", PTR[slots.dtype], ["in", 3])]
    if normed:
        rope_params += [("qn_ptr", _ptr(node, "in", 7), ["in", 7]), ("kn_ptr", _ptr(node, "in", 8), ["in", 8])]
    rope_params += [("q_ptr", PTR[qkv.dtype], ["tmp", 0]), ("v_off", "i64", ["half_numel", 2])]
    g = h // hkv
    att_tiles = tiles_for(arch, "attention", node)
    gp = pow2(g)
    bq = max(1, att_tiles["rows"] // gp)
    qsplit = 0 if invariant else sizing(node, arch)["QSPLIT"]  # sequences of at most this many queries: split_kv.py's
    att = _source(name, T.PAGED_ATTENTION, G=g, HD=hd, QW=qw, HKV=hkv, BS=bs, SCALE=repr(float(a["scale"])), QSPLIT=qsplit,
                  WINDOW=a.get("window", 0), SINK_PARAM="sinks_ptr, " if sinks else "",
                  SOFTMAX_INIT=T.SOFTMAX_SINK if sinks else T.SOFTMAX_EMPTY)
    att_params = [("q_ptr", PTR[qkv.dtype], ["tmp", 0]), ("cache_ptr", PTR[cache.dtype], ["in", 2]),
                  ("v_ptr", PTR[cache.dtype], ["index", 2, 1]), ("tables_ptr", PTR[tables.dtype], ["in", 4]),
                  ("lens_ptr", PTR[lens.dtype], ["in", 5]), ("qlens_ptr", PTR[qlens.dtype], ["in", 6]),
                  ("out_ptr", _ptr(node, "out", 0), ["out", 0])]
    if sinks:
        last = len(node.inputs) - 1
        att_params.append(("sinks_ptr", _ptr(node, "in", last), ["in", last]))
    att_params += [("S", "i32", ["shape", 6, 0]), ("table_stride", "i32", ["stride", 4, 0])]
    att_spec = _spec(name, att, att_params, {"BQ": bq, "GP": gp, "SMAX": SMAX},
                     [["shape", 6, 0], hkv, ["cdiv", ["shape", 0, 0], bq]], att_tiles)
    att_spec["requires"] = [[2, 2, bs, "KV-cache block size"], [6, 0, SMAX, "sequences per step (at most)"]]
    rope_spec = _spec(name + "_rope", rope, rope_params, {}, [["shape", 0, 0], 1, 1], rope_tiles)
    rope_spec["scratch"] = [{"shape": [qkv.shape[0], qw], "dtype": qkv.dtype}]
    if invariant:
        return [rope_spec, att_spec]
    att_spec["when"] = ["ne", ["shape", 0, 0], ["shape", 6, 0]]  # T == S: one query each, all split_kv's
    split = emit_split_kv(node, name, arch, _source, _spec, lambda kind, i: _ptr(node, kind, i), bs, SMAX)
    return [rope_spec, att_spec, *split]


def emit_fused_moe(node: Node, name: str, arch: str, invariant: bool = False) -> list[dict]:
    """Two sets of five kernels, the step's token count choosing one (`when`): up to DECODE_ROWS
    tokens the `moe_decode` tiles (blocks of 16 rows: a decode step gives each expert a few
    pairs, which a 64- or 128-row block would mostly pad; named ..._small), else the `gemm`
    tiles. Each set: routing and the sort by expert into its own scratch (moe_align.py; the
    small set's tmps 0-6, the other's 7-13), the grouped gate/up GEMM with SwiGLU, the grouped
    down GEMM scaled by the routing weight, and the per-token combine.
    invariant: the `gemm` set at every token count (a row's sums in one order whatever its step)."""
    row_tiles = tiles_for(arch, "row", node)
    large = _moe_set(node, name, "", tiles_for(arch, "gemm", node), row_tiles)
    if invariant:
        return large
    small = _moe_set(node, name, "_small", tiles_for(arch, "moe_decode", node), row_tiles)
    tokens = ["shape", 0, 0]
    for spec in small:
        spec["when"] = ["le", tokens, DECODE_ROWS]
    for spec in large:
        spec["when"] = ["gt", tokens, DECODE_ROWS]
    first = sum(len(spec.get("scratch", [])) for spec in small)  # the other set's scratch follows the small set's
    return small + [_with_tmps_from(spec, first) for spec in large]


def _moe_set(node: Node, name: str, suffix: str, tiles: dict, row_tiles: dict) -> list[dict]:
    """One set of fused_moe's five kernels with `tiles`' BM/BN/BK, its kernel names ending in
    `suffix` (the combine's: name + suffix), its scratch tmps 0-6."""
    x, w13 = node.inputs[0].type, node.inputs[2].type
    d, i = x.shape[1], w13.shape[1] // 2
    kt = node.attrs["top_k"] + node.attrs.get("num_shared", 0)
    consts = {k: tiles[k] for k in ("BM", "BN", "BK")}
    dt = PTR[x.dtype]
    pairs = ["tmp_shape", 2, 0]  # T * KT (the sentinel row id)
    blocks = ["cdiv", ["tmp_shape", 0, 0], consts["BM"]]
    up_name, down_name = f"{name}_up{suffix}", f"{name}_down{suffix}"
    up = _spec(up_name, _source(up_name, T.MOE_UP, MOE_ROWS=T.MOE_ROWS, KT=kt, I=i, D=d),
               [("x_ptr", dt, ["in", 0]), ("w13_ptr", dt, ["in", 2]), ("rows_ptr", "*i32", ["tmp", 0]),
                ("block_expert_ptr", "*i32", ["tmp", 1]), ("h_ptr", dt, ["tmp", 4]), ("M", "i32", pairs)],
               consts, [blocks, ["cdiv", ["const", i], consts["BN"]], 1], tiles)
    down = _spec(down_name, _source(down_name, T.MOE_DOWN, MOE_ROWS=T.MOE_ROWS, I=i, D=d),
                 [("h_ptr", dt, ["tmp", 4]), ("w2_ptr", dt, ["in", 3]), ("rows_ptr", "*i32", ["tmp", 0]),
                  ("block_expert_ptr", "*i32", ["tmp", 1]), ("weights_ptr", "*fp32", ["tmp", 3]),
                  ("ys_ptr", dt, ["tmp", 5]), ("M", "i32", pairs)],
                 consts, [blocks, ["cdiv", ["const", d], consts["BN"]], 1], tiles)
    combine = _spec(name + suffix, _source(name + suffix, T.MOE_COMBINE, KT=kt, D=d),
                    [("ys_ptr", dt, ["tmp", 5]), ("pos_ptr", "*i32", ["tmp", 2]), ("y_ptr", dt, ["out", 0])],
                    {"BD": pow2(d)}, [["shape", 0, 0], 1, 1], row_tiles)
    return [*emit_route_align(node, name, suffix, consts["BM"], _source, _spec, lambda kind, i: _ptr(node, kind, i),
                                row_tiles), up, down, combine]


def _with_tmps_from(spec: dict, first: int) -> dict:
    """spec with its scratch references (["tmp", j], ["tmp_shape", j, axis], in any of its forms:
    arguments, grid, when, requires) moved to tmps first + j: a second set of kernels with scratch
    of its own in one launch."""
    def moved(form):
        if isinstance(form, list) and form and form[0] in ("tmp", "tmp_shape"):
            return [form[0], form[1] + first, *form[2:]]
        return [moved(f) for f in form] if isinstance(form, list) else form

    return {k: v if k in ("name", "source", "signature", "constexprs", "scratch") else moved(v)
            for k, v in spec.items()}


def emit_sample(node: Node, name: str, arch: str) -> list[dict]:
    """Greedy and sampled rows alike (sample.py)."""
    return sample.emit_sample(node, name, arch, _spec, _source)


def emit_spec_verify(node: Node, name: str, arch: str) -> list[dict]:
    """One program over the R sample rows (a sequential scan: R is at most a step's tokens)."""
    params = [("tokens_ptr", "*i64", ["in", 0]), ("drafts_ptr", "*i64", ["in", 1]), ("y_ptr", "*i64", ["out", 0]),
              ("R", "i32", ["shape", 0, 0])]
    return [_spec(name, _source(name, T.SPEC_VERIFY), params, {}, [1, 1, 1], tiles_for(arch, "row", node))]


EMITTERS = {
    "embedding": emit_embedding,
    "take_rows": emit_embedding,  # x[rows]: the same gather
    "linear": emit_gemm,
    "linear_q4": emit_gemm,
    "linear_w8a8": emit_gemm,
    "logits": emit_gemm,
    "logits_w8a8": emit_gemm,
    "rms_norm_linear": emit_gemm,
    "add_rms_norm_linear": emit_gemm,
    "swiglu_linear": emit_gemm,
    "qkv_attention": emit_qkv_attention,
    "fused_moe": emit_fused_moe,
    "sample": emit_sample,
    "spec_verify": emit_spec_verify,
    "kernel": emit_kernel,  # a generated kernel: its kernel IR rendered (generated.py)
}


EPILOGUE_HOSTS = ("linear", "linear_q4", "rms_norm_linear", "swiglu_linear")  # emit_gemm's, one output
EMITTERS["with_epilogue"] = lambda node, name, arch, **kw: emit_with_epilogue(node, name, arch, **kw)
# emitters that take invariant=True (one kernel form per op at every batch shape); the others' kernels are already
INVARIANT_AWARE = frozenset(op for op, f in EMITTERS.items() if f is emit_gemm) | {"qkv_attention", "with_epilogue",
                                                                                   "fused_moe"}


def emittable(node: Node) -> bool:
    """Shapes the templates do not cover go to the reference."""
    if node.op not in EMITTERS or is_q4a8(node.attrs):  # int4-a8 fused forms: their decomposition
        return False
    if "act_group" in node.attrs:  # W8A8: the K tile is one group: tl.arange wants a power of two, int8 tl.dot
        g = node.attrs["act_group"]  # at least 32; at most 256 keeps the int8 tiles in shared memory
        return g == pow2(g) and 32 <= g <= 256
    if node.op == "qkv_attention":
        hd = node.attrs["head_dim"]
        return hd == pow2(hd) and hd >= 16
    if node.op == "kernel":
        return renderable(node)
    if node.op == "with_epilogue":
        inner, epi, _ = split_epilogue(node)
        return inner.op in EPILOGUE_HOSTS and emittable(inner) and renderable(epi)
    return True
