"""Quantization passes over linear(x, W) with W a param (see ir/opdefs_quant.py for the formats).

quantize_int4: weight-only 4-bit, -> linear_q4(x, packed, scales, mins). Groups of `group_size`
along K, each with its own scale and minimum (GGUF's Q4_1 layout). Weights that came from a
Q4_1 GGUF and were traced in f32 are reproduced exactly; others are rounded to 16 levels per group.

quantize_w8a8: 8-bit weights (one scale per output row) and 8-bit activations (quantized as the
op runs, per row and group of `act_group`), -> linear_w8a8(x, wq, scale). On SmolLM2 with
Q4_1 weights, perplexity rises about 1% over the weight-only int4 model (docs/quantization.md).

Linears whose K is not a multiple of the group size, or whose weight is computed, stay dense.
"""
from __future__ import annotations

from collections.abc import Callable

from ..ir import Graph, Node
from ..ir.opdefs_quant import quantize_q4, quantize_w8


def quantize_int4(group_size: int = 32) -> Callable[[Graph], Graph]:
    def quantize(g: Graph) -> Graph:
        params = set(g.params)
        for i, n in enumerate(g.nodes):
            if n.op != "linear":
                continue
            x, w = n.inputs
            if w not in params or w.name not in g.weights or w.type.shape[1] % group_size:
                continue
            packed, scales, mins = quantize_q4(g.weights[w.name], group_size)
            ins = [g.add_param(f"{w.name}.q4", packed), g.add_param(f"{w.name}.scales", scales),
                   g.add_param(f"{w.name}.mins", mins)]
            params.update(ins)
            g.nodes[i] = Node("linear_q4", [x, *ins], n.outputs, {"group_size": group_size})
        g.drop_unused_params()
        return g

    return quantize


def quantize_w8a8(act_group: int = 64) -> Callable[[Graph], Graph]:
    def quantize(g: Graph) -> Graph:
        params = set(g.params)
        for i, n in enumerate(g.nodes):
            if n.op != "linear":
                continue
            x, w = n.inputs
            if w not in params or w.name not in g.weights or w.type.shape[1] % act_group:
                continue
            wq, scale = quantize_w8(g.weights[w.name])
            ins = [g.add_param(f"{w.name}.w8", wq), g.add_param(f"{w.name}.w8_scale", scale)]
            params.update(ins)
            g.nodes[i] = Node("linear_w8a8", [x, *ins], n.outputs, {"act_group": act_group})
        g.drop_unused_params()
        return g

    return quantize
