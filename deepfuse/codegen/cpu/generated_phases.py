"""The entry function of a generated CPU kernel: the (r, g) loop and, inside it, one loop over c
per phase (generated.py's docstring gives the phase rule; `levels` computes it)."""
from __future__ import annotations

import re

from ...kernel.ir import Instr, Kernel
from .generated import CTYPE, PARALLEL_ELEMS, base_name, expr, index_expr

SOURCES = ("load", "const", "col")


def entry_name(k: Kernel) -> str:
    """The C symbol of k's entry: its name with anything but [A-Za-z0-9_] replaced."""
    name = re.sub(r"\W", "_", k.name)
    return name if name[:1].isalpha() else "k_" + name


def levels(k: Kernel) -> dict[int, int]:
    """Each value's level: how many phases must run before it is known (a reduction's phase is its
    operand's level; its result's level is one more)."""
    lv: dict[int, int] = {}
    for ins in k.body:
        if ins.out < 0:
            continue
        base = max((lv[a] for a in ins.args), default=0)
        lv[ins.out] = base + 1 if ins.op == "reduce" else base
    return lv


def closure(roots: list[int], by_out: dict[int, Instr]) -> set[int]:
    """The elem values roots need (themselves included), through elem arguments only."""
    need, todo = set(), list(roots)
    while todo:
        x = todo.pop()
        ins = by_out[x]
        if x in need or ins.kind != "elem":
            continue
        need.add(x)
        todo += ins.args
    return need


def accumulate(ins: Instr) -> tuple[str, str, str, str]:
    """(declarations before the loop, update inside it, simd clause, value after it) of a reduction."""
    n, x, kind = ins.out, f"v{ins.args[0]}", ins.attrs["kind"]
    if kind == "sum":
        return f"float a{n} = 0.f;", f"a{n} += {x};", f"reduction(+:a{n})", f"a{n}"
    if kind in ("max", "min"):
        op, start = (">", "-INFINITY") if kind == "max" else ("<", "INFINITY")
        return (f"float a{n} = {start}; int nan{n} = 0;", f"a{n} = {x} {op} a{n} ? {x} : a{n}; nan{n} |= {x} != {x};",
                f"reduction({kind}:a{n}) reduction(|:nan{n})", f"nan{n} ? NAN : a{n}")
    # argmax: the first maximum; a NaN counts as the largest (torch.argmax)
    return (f"float a{n} = -INFINITY; int32_t i{n} = -1;",
            f"if (i{n} < 0 || {x} > a{n} || ({x} != {x} && a{n} == a{n})) {{ a{n} = {x}; i{n} = c; }}", "", f"i{n}")


def render_body(k: Kernel) -> str:
    """k's row function (the (r, g) pairs begin..end) and its extern "C" entry (see generated.py)."""
    name, (_, groups, cols) = entry_name(k), k.space
    ins = [b for b in k.buffers if b.role == "in"]
    outs = [b for b in k.buffers if b.role == "out"]
    lines = [f"static void {name}_rows(const int64_t* __restrict__ args, int64_t begin, int64_t end) {{"]
    for i, b in enumerate(ins + outs):
        t = ("const " if b.role == "in" else "") + CTYPE[b.dtype]
        lines.append(f"    {t}* __restrict__ {b.name} = reinterpret_cast<{t}*>(args[{i}]);")
    lines += ["    for (int64_t rg = begin; rg < end; ++rg) {",
              f"        const int64_t r = rg / {groups}, g = rg % {groups};",
              "        (void)r; (void)g;"]
    lines += _row_group(k)
    n = len(ins) + len(outs)
    lines += ["    }", "}", "",
              f'extern "C" void {name}(const int64_t* args) {{',
              f"    const int64_t total = args[{n}] * {groups};",
              f"    const int threads = static_cast<int>(args[{n + 1}]);",
              f"    if (threads < 2 || total < 2 || total * {cols} < {PARALLEL_ELEMS}) {{",
              f"        {name}_rows(args, 0, total);",
              "        return;",
              "    }",
              "#pragma omp parallel num_threads(threads)",
              "    {",
              "        const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();",
              "        const int64_t begin = total * part / parts, end = total * (part + 1) / parts;",
              f"        if (begin < end) {name}_rows(args, begin, end);",
              "    }",
              "}", ""]
    return "\n".join(lines)


def _row_group(k: Kernel) -> list[str]:
    """The body of the (r, g) loop: the per-(r, g) pointers, then the phases."""
    cols = k.space[2]
    by_out = {i.out: i for i in k.body if i.out >= 0}
    lv = levels(k)
    bases = {}
    for ins in k.body:
        if ins.op in ("load", "store"):
            ix, b = ins.attrs["index"], k.buffer(ins.attrs["buf"])
            t = ("const " if b.role == "in" else "") + CTYPE[b.dtype]
            bases[base_name(ins)] = f"        {t}* __restrict__ {base_name(ins)} = {b.name} + r * {ix.row} + g * {ix.group};"
    lines = list(bases.values())
    top = max(lv.values(), default=0)
    reduces = [i for i in k.body if i.op == "reduce"]
    stores = [i for i in k.body if i.op == "store"]
    for p in range(top + 1):
        lines += [f"        {_row_value(i, by_out)}" for i in k.body
                  if i.out >= 0 and i.kind == "row" and i.op != "reduce" and lv[i.out] == p]
        red = [i for i in reduces if lv[i.args[0]] == p]
        sto = [i for i in stores if i.attrs["index"].col and lv[i.args[0]] == p]
        if red or sto:
            lines += _phase_loop(cols, red, sto, by_out)
    for s in stores:
        if not s.attrs["index"].col:
            lines.append(f"        {index_expr(s)} = v{s.args[0]};")
    return lines


def _row_value(ins: Instr, by_out: dict[int, Instr]) -> str:
    return f"const {CTYPE[ins.dtype]} v{ins.out} = {expr(ins, by_out)};"


def _phase_loop(cols: int, red: list[Instr], sto: list[Instr], by_out: dict[int, Instr]) -> list[str]:
    """One phase: the loop over c that feeds its reductions and writes its stores."""
    need = closure([i.args[0] for i in red + sto], by_out)
    acc = [accumulate(i) for i in red]
    lines = [f"        {a[0]}" for a in acc]
    simd = " ".join(a[2] for a in acc)
    if all(i.attrs["kind"] != "argmax" for i in red):
        lines.append(f"#pragma omp simd {simd}".rstrip())
    lines.append(f"        for (int64_t c = 0; c < {cols}; ++c) {{")
    lines += [f"            {_row_value(by_out[x], by_out)}" for x in sorted(need)]
    lines += [f"            {a[1]}" for a in acc]
    for s in sto:
        lines.append(f"            {index_expr(s)} = v{s.args[0]};")
    lines.append("        }")
    lines += [f"        const {CTYPE[i.dtype]} v{i.out} = {a[3]};" for i, a in zip(red, acc)]
    return lines
