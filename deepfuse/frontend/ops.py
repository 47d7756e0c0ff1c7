"""The op namespace models are written against. Eager on tensors, recorded under trace.

Shape contracts are those of the IR ops (see deepfuse/ir/opdefs_*.py).
"""
from __future__ import annotations

from typing import Any

from .tracer import apply, constant_like


def add(a: Any, b: Any) -> Any:
    """a + b, broadcast; either may be a Python number (a constant of the other's dtype)."""
    return apply("add", *_operands(a, b))


def mul(a: Any, b: Any) -> Any:
    return apply("mul", *_operands(a, b))


def _operands(*xs: Any) -> list[Any]:
    """Python numbers among xs as 0-d constants of the first tensor operand's dtype."""
    like = next((x for x in xs if not isinstance(x, (int, float))), None)
    if like is None:
        raise TypeError("an op needs at least one tensor operand")
    return [constant_like(x, like) if isinstance(x, (int, float)) else x for x in xs]


# ---- primitives (ir/opdefs_prim.py): what decompositions are written in -------------------------


def sub(a: Any, b: Any) -> Any:
    return apply("sub", *_operands(a, b))


def div(a: Any, b: Any) -> Any:
    return apply("div", *_operands(a, b))


def maximum(a: Any, b: Any) -> Any:
    return apply("maximum", *_operands(a, b))


def minimum(a: Any, b: Any) -> Any:
    return apply("minimum", *_operands(a, b))


def lt(a: Any, b: Any) -> Any:
    return apply("lt", *_operands(a, b))


def le(a: Any, b: Any) -> Any:
    return apply("le", *_operands(a, b))


def gt(a: Any, b: Any) -> Any:
    return apply("gt", *_operands(a, b))


def ge(a: Any, b: Any) -> Any:
    return apply("ge", *_operands(a, b))


def eq(a: Any, b: Any) -> Any:
    return apply("eq", *_operands(a, b))


def ne(a: Any, b: Any) -> Any:
    return apply("ne", *_operands(a, b))


def where(cond: Any, a: Any, b: Any) -> Any:
    """a where cond, else b; a or b may be a number."""
    x, y = _operands(a, b)
    return apply("where", cond, x, y)


def neg(x: Any) -> Any:
    return apply("neg", x)


def abs(x: Any) -> Any:  # noqa: A001  (the op's name)
    return apply("abs", x)


def exp(x: Any) -> Any:
    return apply("exp", x)


def log(x: Any) -> Any:
    return apply("log", x)


def sqrt(x: Any) -> Any:
    return apply("sqrt", x)


def rsqrt(x: Any) -> Any:
    return apply("rsqrt", x)


def tanh(x: Any) -> Any:
    return apply("tanh", x)


def erf(x: Any) -> Any:
    return apply("erf", x)


def sigmoid(x: Any) -> Any:
    return apply("sigmoid", x)


def pow(x: Any, exponent: float) -> Any:  # noqa: A001
    """x ** exponent, a constant exponent."""
    return apply("pow_scalar", x, exponent=float(exponent))


def reduce_sum(x: Any, *, axis: int = -1, keepdim: bool = True) -> Any:
    return apply("reduce_sum", x, axis=axis, keepdim=keepdim)


def reduce_max(x: Any, *, axis: int = -1, keepdim: bool = True) -> Any:
    return apply("reduce_max", x, axis=axis, keepdim=keepdim)


def reduce_mean(x: Any, *, axis: int = -1, keepdim: bool = True) -> Any:
    return apply("reduce_mean", x, axis=axis, keepdim=keepdim)


def reshape(x: Any, *, shape: list) -> Any:
    """A view with `shape` (ints, or the input's symbolic dims in order)."""
    return apply("reshape", x, shape=list(shape))


def silu(x: Any) -> Any:
    return apply("silu", x)


def linear(x: Any, w: Any) -> Any:
    """x[T,K], w[N,K] -> [T,N]."""
    return apply("linear", x, w)


def add_bias(x: Any, b: Any) -> Any:
    """x[T,N] + b[N]."""
    return apply("add_bias", x, b)


def embedding(table: Any, ids: Any) -> Any:
    """table[V,D], ids[T] -> [T,D]."""
    return apply("embedding", table, ids)


def split(x: Any, *, sizes: list[int], axis: int = -1) -> Any:
    return apply("split", x, sizes=list(sizes), axis=axis)


def concat(*xs: Any, axis: int = -1) -> Any:
    return apply("concat", *xs, axis=axis)


def cast(x: Any, *, dtype: str) -> Any:
    return apply("cast", x, dtype=dtype)


def swiglu(x: Any) -> Any:
    """x[T,2I] = [gate | up] -> silu(gate) * up."""
    return apply("swiglu", x)


def rms_norm(x: Any, w: Any, *, eps: float) -> Any:
    return apply("rms_norm", x, w, eps=float(eps))


def add_rms_norm(x: Any, res: Any, w: Any, *, eps: float) -> Any:
    """(x + res, rms_norm(x + res, w)): a pre-norm block's residual add and the next norm."""
    return apply("add_rms_norm", x, res, w, eps=float(eps))


def _quant(group_size: int | None, act_group: int | None) -> dict[str, int]:
    """The projection's attrs: int4's group_size or W8A8's act_group (neither for a dense W)."""
    return {k: v for k, v in (("group_size", group_size), ("act_group", act_group)) if v is not None}


def rms_norm_linear(x: Any, w: Any, *proj: Any, eps: float, group_size: int | None = None,
                    act_group: int | None = None) -> Any:
    """proj: W[N,K], (packed, scales, mins) of linear_q4 with its group_size, or (wq, scale) of
    linear_w8a8 with its act_group."""
    return apply("rms_norm_linear", x, w, *proj, eps=float(eps), **_quant(group_size, act_group))


def add_rms_norm_linear(x: Any, res: Any, w: Any, *proj: Any, eps: float, group_size: int | None = None,
                        act_group: int | None = None) -> Any:
    return apply("add_rms_norm_linear", x, res, w, *proj, eps=float(eps), **_quant(group_size, act_group))


def swiglu_linear(x: Any, *proj: Any, group_size: int | None = None, act_group: int | None = None) -> Any:
    return apply("swiglu_linear", x, *proj, **_quant(group_size, act_group))


def linear_q4(x: Any, packed: Any, scales: Any, mins: Any, *, group_size: int) -> Any:
    """x[T,K] @ dequantize_q4(packed[N,K/2], scales, mins)^T -> [T,N]."""
    return apply("linear_q4", x, packed, scales, mins, group_size=group_size)


def linear_q4a8(x: Any, packed: Any, scales: Any, mins: Any, *, group_size: int) -> Any:
    """x[T,K] @ int4 w^T with x quantized to int8 per row and group (ir/opdefs_quant.py) -> [T,N]."""
    return apply("linear_q4a8", x, packed, scales, mins, group_size=group_size)


def linear_w8a8(x: Any, wq: Any, scale: Any, *, act_group: int) -> Any:
    """x[T,K] (quantized per row and group of act_group) @ ((wq[N,K] - 128) * scale[N])^T -> [T,N]."""
    return apply("linear_w8a8", x, wq, scale, act_group=act_group)


def qkv_rope_cache(qkv: Any, positions: Any, kv_cache: Any, slot_mapping: Any, *norms: Any, sizes: list[int],
                   head_dim: int, theta: float, qk_norm_eps: float | None = None) -> Any:
    """(rope(q), rope(k), v) from the merged projection; writes k and v into kv_cache.
    norms: (q_norm[hd], k_norm[hd]) with qk_norm_eps, each head normalised before RoPE."""
    extra = {} if qk_norm_eps is None else {"qk_norm_eps": float(qk_norm_eps)}
    return apply("qkv_rope_cache", qkv, positions, kv_cache, slot_mapping, *norms, sizes=list(sizes), head_dim=head_dim,
                 theta=float(theta), **extra)


def head_rms_norm(x: Any, w: Any, *, eps: float, head_dim: int) -> Any:
    """RMSNorm of each head of x[T,H*hd] over hd (Qwen3's q_norm / k_norm)."""
    return apply("head_rms_norm", x, w, eps=float(eps), head_dim=head_dim)


def moe(x: Any, router_logits: Any, w13: Any, w2: Any, *score_bias: Any, top_k: int, renormalize: bool,
        **routing: Any) -> Any:
    """Top-k routed SwiGLU experts: x[T,D], router_logits[T,E], w13[E,2I,D], w2[E,D,I] (, score_bias[E])
    -> [T,D]. routing: scoring ("softmax" | "sigmoid"), routed_scaling, n_group, topk_group."""
    return apply("moe", x, router_logits, w13, w2, *score_bias, top_k=top_k, renormalize=bool(renormalize), **routing)


def fused_moe(x: Any, router_w: Any, w13: Any, w2: Any, *score_bias: Any, top_k: int, renormalize: bool,
              **routing: Any) -> Any:
    """moe with the router matmul inside: router_w[E,D]."""
    return apply("fused_moe", x, router_w, w13, w2, *score_bias, top_k=top_k, renormalize=bool(renormalize), **routing)


def moe_routing(router_logits: Any, *score_bias: Any, top_k: int, renormalize: bool, dtype: str, **routing: Any) -> Any:
    return apply("moe_routing", router_logits, *score_bias, top_k=top_k, renormalize=bool(renormalize), dtype=dtype,
                 **routing)


def append_experts(w13: Any, w2: Any, s13: Any, s2: Any) -> Any:
    """(w13', w2'): a shared SwiGLU MLP appended as always-on experts (see ir/opdefs_moe.py)."""
    return apply("append_experts", w13, w2, s13, s2)


def expert_weight(w: Any, *, index: int) -> Any:
    return apply("expert_weight", w, index=index)


def scale_by_column(y: Any, weights: Any, *, index: int) -> Any:
    return apply("scale_by_column", y, weights, index=index)


def rope(x: Any, positions: Any, *, head_dim: int, theta: float) -> Any:
    """Rotate-half rotary embedding on each head of x[T,H*hd]."""
    return apply("rope", x, positions, head_dim=head_dim, theta=float(theta))


def attention(q: Any, k: Any, v: Any, kv_cache: Any, slot_mapping: Any, block_tables: Any,
              seq_lens: Any, query_lens: Any, *, num_heads: int, num_kv_heads: int,
              head_dim: int, scale: float, window: int = 0, write_kv: bool = True, sinks: Any = None) -> Any:
    """Paged-KV causal GQA attention; writes k/v into kv_cache[2,N,BS,Hkv,hd] first
    (write_kv=False: an earlier op of the step wrote them). sinks: f32[H] learned sink logits."""
    extra = ({} if write_kv else {"write_kv": False}) | ({} if sinks is None else {"sinks": True})
    return apply("attention", q, k, v, kv_cache, slot_mapping, block_tables, seq_lens, query_lens,
                 *([] if sinks is None else [sinks]), num_heads=num_heads, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, scale=float(scale), window=window, **extra)


def qkv_attention(qkv: Any, positions: Any, kv_cache: Any, slot_mapping: Any, block_tables: Any, seq_lens: Any,
                  query_lens: Any, *norms: Any, sizes: list[int], head_dim: int, theta: float, num_heads: int,
                  num_kv_heads: int, scale: float, window: int = 0, qk_norm_eps: float | None = None,
                  sinks: Any = None) -> Any:
    """attention over qkv_rope_cache's outputs, as one op: qkv[T,Q+K+V] -> [T,H*hd]."""
    extra = ({} if qk_norm_eps is None else {"qk_norm_eps": float(qk_norm_eps)}) | \
        ({} if sinks is None else {"sinks": True})
    return apply("qkv_attention", qkv, positions, kv_cache, slot_mapping, block_tables, seq_lens, query_lens, *norms,
                 *([] if sinks is None else [sinks]), sizes=list(sizes), head_dim=head_dim, theta=float(theta),
                 num_heads=num_heads, num_kv_heads=num_kv_heads, scale=float(scale), window=window, **extra)


def take_rows(x: Any, rows: Any) -> Any:
    """x[T,D], rows[R] -> [R,D]."""
    return apply("take_rows", x, rows)


def logits(x: Any, w: Any, sample_rows: Any) -> Any:
    """fp32 [R,V] logits of x's sample_rows."""
    return apply("logits", x, w, sample_rows)


def sample(logits: Any, temperature: Any, top_k: Any, top_p: Any, seeds: Any) -> Any:
    """[S] i64 next tokens; greedy where temperature == 0."""
    return apply("sample", logits, temperature, top_k, top_p, seeds)


def spec_verify(tokens: Any, draft_tokens: Any) -> Any:
    """[R] i64: tokens, -1 after each sequence's first rejected draft."""
    return apply("spec_verify", tokens, draft_tokens)


def gelu_tanh(x: Any) -> Any:
    """GELU with the tanh approximation."""
    return apply("gelu_tanh", x)


def softmax(x: Any) -> Any:
    """Softmax along the last axis (in f32)."""
    return apply("softmax", x)


def softcap(x: Any, *, cap: float) -> Any:
    """cap * tanh(x / cap)."""
    return apply("softcap", x, cap=float(cap))
