"""RoPE + paged KV-cache write as the attention's prologue: qkv_rope_cache and the attention
that reads its three outputs become one qkv_attention.

    q, k, v = qkv_rope_cache(qkv, pos, cache, slots); attention(q, k, v, cache, slots, ..., write_kv=False)
 -> qkv_attention(qkv, pos, cache, slots, ...)

A kernel for it attends new keys straight from qkv (rotated on the fly) and older ones from
the cache, and writes the new rows for the next step: no cache read-after-write within the
step. Runs after fuse_qkv_rope.
"""
from __future__ import annotations

from ..frontend import ops
from .pattern import Op, Rule, Var, rule_pass

qkv, pos, cache, slots, tables, lens, qlens = (Var(n) for n in ("qkv", "pos", "cache", "slots", "tables", "lens",
                                                                 "qlens"))
ROPE = Op("qkv_rope_cache", qkv, pos, cache, slots, name="rope")


ROPE_NORMED = Op("qkv_rope_cache", qkv, pos, cache, slots, Var("q_norm"), Var("k_norm"), name="rope")


def _fuse(m):
    a, r = m.attrs("att"), m.attrs("rope")
    norms = [m["q_norm"], m["k_norm"]] if "q_norm" in m.values else []
    out = ops.qkv_attention(m["qkv"], m["pos"], m["cache"], m["slots"], m["tables"], m["lens"], m["qlens"], *norms,
                            sizes=r["sizes"], head_dim=r["head_dim"], theta=r["theta"], num_heads=a["num_heads"],
                            num_kv_heads=a["num_kv_heads"], scale=a["scale"], window=a.get("window", 0),
                            qk_norm_eps=r.get("qk_norm_eps"), sinks=m.values.get("sinks"))
    return None, None, None, out  # the cache-writing op's q, k, v are read by the attention alone


def _rule(name: str, rope: Op, sinks: bool = False) -> Rule:
    tail, attrs = ([Var("sinks")], {"write_kv": False, "sinks": True}) if sinks else ([], {"write_kv": False})
    return Rule(name, Op("attention", rope, Op("qkv_rope_cache", name="rope", out=1),
                         Op("qkv_rope_cache", name="rope", out=2), cache, slots, tables, lens, qlens, *tail, name="att",
                         attrs=attrs),
                _fuse, replaces=("rope", "att"))


QKV_ATTENTION = _rule("qkv_attention", ROPE)
QKV_ATTENTION_NORMED = _rule("qkv_attention_qk_norm", ROPE_NORMED)  # Qwen3: head norms in the prologue
QKV_ATTENTION_SINKS = _rule("qkv_attention_sinks", ROPE, sinks=True)  # gpt-oss: learned sink logits
QKV_ATTENTION_NORMED_SINKS = _rule("qkv_attention_qk_norm_sinks", ROPE_NORMED, sinks=True)

fuse_qkv_attention = rule_pass("fuse_qkv_attention", [QKV_ATTENTION, QKV_ATTENTION_NORMED, QKV_ATTENTION_SINKS,
                                                       QKV_ATTENTION_NORMED_SINKS])
