"""The `sample` op on sm90/sm100: one program per row of logits[S,V], looping over V in tiles of
BV. Greedy rows (temperature 0): the first maximum. Sampled rows: ir/sampling.py's draw, the
top-k threshold bisected over the 32 bits of the order-preserving key (a count per step), the
top-p threshold over 31 bits of p's f32 bits (a masked sum per step), then Gumbel-max with the
counter-based u32 hash."""
from __future__ import annotations

from ...ir import Node
from .tiles import tiles_for

# z = x / t (correctly rounded); key(z) as i64 in [0, 2^32): the signed order of the bits + 2^31
LOAD_Z = """x = tl.load(base + v0 + v, mask=ok, other=float("-inf"))
z = tl.math.div_rn(x, t)
b = z.to(tl.int32, bitcast=True)
key = tl.where(b < 0, b ^ 0x7FFFFFFF, b).to(tl.int64) + 2147483648"""

# murmur3's fmix32 over u32 h, in place
FMIX = """{h} = {h} ^ ({h} >> 16)
{h} = {h} * 0x85EBCA6B
{h} = {h} ^ ({h} >> 13)
{h} = {h} * 0xC2B2AE35
{h} = {h} ^ ({h} >> 16)"""

SAMPLE = """
@triton.jit
def $NAME(logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, seeds_ptr, y_ptr, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    v = tl.arange(0, BV)
    base = logits_ptr + row * $V
    t = tl.load(temp_ptr + row)
    best = tl.full((BV,), float("-inf"), dtype=tl.float32)
    where = tl.zeros((BV,), dtype=tl.int64)
    if t > 0:
        k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        seed = tl.load(seeds_ptr + row)
        zero = k * 0
        tk = zero  # the top-k threshold on key (0: every token)
        if (k > 0) & (k < $V):
            step = zero + 2147483648
            for _ in range(32):
                c = tk + step
                count = zero
                for v0 in range(0, $V, BV):
                    ok = v0 + v < $V
                    $LOAD_Z
                    count += tl.sum((ok & (key >= c)).to(tl.int64), axis=0)
                tk = tl.where(count >= k, c, tk)
                step = step // 2
        m = tl.full((), float("-inf"), dtype=tl.float32)
        for v0 in range(0, $V, BV):
            ok = v0 + v < $V
            x = tl.load(base + v0 + v, mask=ok, other=float("-inf"))
            m = tl.maximum(m, tl.max(tl.math.div_rn(x, t), axis=0))
        tp = zero  # the top-p threshold on p's bits (0: every kept token)
        if top_p < 1.0:
            total = tl.zeros((), dtype=tl.float32)
            for v0 in range(0, $V, BV):
                ok = v0 + v < $V
                $LOAD_Z
                total += tl.sum(tl.where(ok & (key >= tk), tl.exp(z - m), 0.0), axis=0)
            target = top_p * total
            step = zero + 1073741824
            for _ in range(31):
                c = tp + step
                mass = tl.zeros((), dtype=tl.float32)
                for v0 in range(0, $V, BV):
                    ok = v0 + v < $V
                    $LOAD_Z
                    p = tl.where(ok & (key >= tk), tl.exp(z - m), 0.0)
                    mass += tl.sum(tl.where(p.to(tl.int32, bitcast=True).to(tl.int64) >= c, p, 0.0), axis=0)
                tp = tl.where((mass > 0) & (mass >= target), c, tp)
                step = step // 2
        h = (seed & 0xFFFFFFFF).to(tl.uint32)
        $FMIX_H
        h = h ^ ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        $FMIX_H
        for v0 in range(0, $V, BV):
            ok = v0 + v < $V
            $LOAD_Z
            p = tl.exp(z - m)
            keep = ok & (key >= tk) & (p.to(tl.int32, bitcast=True).to(tl.int64) >= tp)
            hv = h ^ ((v0 + v).to(tl.uint32) * 0x9E3779B1)
            $FMIX_HV
            u = (((hv >> 9) << 1) | 1).to(tl.float32) * 5.9604644775390625e-08
            s = tl.where(keep, z - tl.log(-tl.log(u)), float("-inf"))
            better = s > best
            best = tl.where(better, s, best)
            where = tl.where(better, v0 + v, where)
    else:
        for v0 in range(0, $V, BV):
            x = tl.load(base + v0 + v, mask=v0 + v < $V, other=float("-inf"))
            better = x > best
            best = tl.where(better, x, best)
            where = tl.where(better, v0 + v, where)
    top = tl.max(best, axis=0)
    tl.store(y_ptr + row, tl.min(tl.where(best == top, where, $V), axis=0))
"""


def inline(src: str, slot: str, block: str) -> str:
    """src with each line that is `slot` alone replaced by block's lines at that line's indent."""
    out = []
    for line in src.split("\n"):
        pad = line[:len(line) - len(line.lstrip())]
        out.extend(pad + b for b in block.split("\n")) if line.strip() == slot else out.append(line)
    return "\n".join(out)


def sample_source(v: int) -> str:
    """The kernel body for vocabulary v, $NAME left to the caller."""
    src = inline(SAMPLE, "$LOAD_Z", LOAD_Z)
    src = inline(inline(src, "$FMIX_HV", FMIX.format(h="hv")), "$FMIX_H", FMIX.format(h="h"))
    return src.replace("$V", str(v))


def emit_sample(node: Node, name: str, arch: str, spec, source) -> list[dict]:
    """sample(logits[S,V] f32, temperature[S], top_k[S], top_p[S], seeds[S]) -> y i64[S]: one
    program per row, greedy and sampled rows alike."""
    v = node.inputs[0].type.shape[1]
    params = [("logits_ptr", "*fp32", ["in", 0]), ("temp_ptr", "*fp32", ["in", 1]), ("top_k_ptr", "*i64", ["in", 2]),
              ("top_p_ptr", "*fp32", ["in", 3]), ("seeds_ptr", "*i64", ["in", 4]), ("y_ptr", "*i64", ["out", 0])]
    return [spec(name, source(name, sample_source(v)), params, {"BV": 1024}, [["shape", 0, 0], 1, 1],
                 tiles_for(arch, "row", node))]
