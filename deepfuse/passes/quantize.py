"""Quantization passes over linear(x, W) with W a param (see ir/opdefs_quant.py for the formats).

quantize_int4: weight-only 4-bit, -> linear_q4(x, packed, scales, mins). Groups of `group_size`
along K, each with its own scale and minimum (GGUF's Q4_1 layout). Weights that came from a
Q4_1 GGUF and were traced in f32 are reproduced exactly; others are rounded to 16 levels per group.

quantize_w8a8: 8-bit weights (one scale per output row) and 8-bit activations (quantized as the
op runs, per row and group of `act_group`), -> linear_w8a8(x, wq, scale), and the LM head ->
logits_w8a8. On SmolLM2 with Q4_1 weights, perplexity rises about 1% over the weight-only int4
model (docs/quantization.md).

quantize_int4(head=True) also quantizes the LM head: logits(x, W, rows) ->
cast(linear_q4(take_rows(x, rows), packed, scales, mins), f32) (logits' own decomposition with the
projection quantized, so every target runs it with the kernels it has for int4 projections); a
tied head keeps W for the embedding, which reads rows of it. This is quant="int4-head": for a
model whose head is most of its weights (Gemma 3 270M: 262,144 x 640 of 268M parameters) the
head dominates what a decode step reads.

quantize_int4_a8: int4 weights as quantize_int4 makes them, -> linear_q4a8(x, packed, scales, mins):
the activations quantized to int8 per row and group of 32 as the op runs (llama.cpp's Q4_1 x Q8_1
product; on the CPU, AVX512-VNNI integer dot products). With quantize_head_w8a8 after it this is
quant="int4-a8".

Linears whose K is not a multiple of the group size, or whose weight is computed, stay dense.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from ..ir import Graph, Node
from ..ir.opdefs_quant import quantize_q4, quantize_w8


def _quantize_linears(op: str, group: int, attrs: dict,
                      encode: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]) -> Callable[[Graph], Graph]:
    """A pass rewriting linear(x, W) -> op(x, *params) for each param W whose K is a multiple of
    `group`; encode(W's name, W) gives the new params by name, in the op's input order."""
    def quantize(g: Graph) -> Graph:
        params = set(g.params)
        for i, n in enumerate(g.nodes):
            if n.op != "linear":
                continue
            x, w = n.inputs
            if w not in params or w.name not in g.weights or w.type.shape[1] % group:
                continue
            ins = [g.add_param(name, t) for name, t in encode(w.name, g.weights[w.name]).items()]
            params.update(ins)
            g.nodes[i] = Node(op, [x, *ins], n.outputs, dict(attrs))
        g.drop_unused_params()
        return g

    return quantize


def quantize_int4(group_size: int = 32, head: bool = False) -> Callable[[Graph], Graph]:
    """Every linear over a param as linear_q4; head: the LM head too (see the module's doc)."""
    def encode(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scales, mins = quantize_q4(w, group_size)
        return {f"{name}.q4": packed, f"{name}.scales": scales, f"{name}.mins": mins}

    linears = _quantize_linears("linear_q4", group_size, {"group_size": group_size}, encode)
    if not head:
        return linears

    def q4_logits(x, packed, scales, mins, rows):
        from ..frontend import ops

        return ops.cast(ops.linear_q4(ops.take_rows(x, rows), packed, scales, mins, group_size=group_size), dtype="f32")

    def quantize(g: Graph) -> Graph:
        from ..frontend import trace_into

        g = linears(g)
        params, out = set(g.params), []
        for n in g.nodes:
            x, w, rows = n.inputs if n.op == "logits" else (None, None, None)
            if n.op != "logits" or w not in params or w.name not in g.weights or w.type.shape[1] % group_size:
                out.append(n)
                continue
            ins = [g.add_param(name, t) for name, t in encode(w.name, g.weights[w.name]).items()]
            nodes, (y,) = trace_into(g, q4_logits, [x, *ins, rows], {})
            nodes[-1].outputs = [n.outputs[0] if o is y else o for o in nodes[-1].outputs]
            out.extend(nodes)
        g.nodes = out
        g.drop_unused_params()
        return g

    return quantize


def quantize_int4_a8(group_size: int = 32) -> Callable[[Graph], Graph]:
    """Every linear over a param as linear_q4a8 (int4 weights, int8 activations per group)."""
    def encode(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        packed, scales, mins = quantize_q4(w, group_size)
        return {f"{name}.q4": packed, f"{name}.scales": scales, f"{name}.mins": mins}

    return _quantize_linears("linear_q4a8", group_size, {"group_size": group_size}, encode)


def _encode_w8(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    wq, scale = quantize_w8(w)
    return {f"{name}.w8": wq, f"{name}.w8_scale": scale}


def quantize_w8a8(act_group: int = 64) -> Callable[[Graph], Graph]:
    """Every linear as above, and the LM head (quantize_head_w8a8)."""
    linears = _quantize_linears("linear_w8a8", act_group, {"act_group": act_group}, _encode_w8)
    head = quantize_head_w8a8(act_group)
    return lambda g: head(linears(g))


def quantize_head_w8a8(act_group: int = 64) -> Callable[[Graph], Graph]:
    """The LM head alone: logits(x, W, rows) -> logits_w8a8(x, wq, scale, rows) (f32 logits; a
    tied head keeps W for the embedding, which reads rows of it). After quantize_int4 this is
    quant="int4-head8": int4 projections, an int8 head with int8 activations (llama.cpp's Q4 files
    carry a Q8_0 head, dotted against Q8 activations, the same bytes)."""
    def quantize(g: Graph) -> Graph:
        params = set(g.params)
        for i, n in enumerate(g.nodes):
            if n.op != "logits":
                continue
            x, w, rows = n.inputs
            if w not in params or w.name not in g.weights or w.type.shape[1] % act_group:
                continue
            ins = [g.add_param(name, t) for name, t in _encode_w8(w.name, g.weights[w.name]).items()]
            g.nodes[i] = Node("logits_w8a8", [x, *ins, rows], n.outputs, {"act_group": act_group})
        g.drop_unused_params()
        return g

    return quantize
