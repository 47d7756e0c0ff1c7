"""IR text: `print_graph` and `parse_graph` round-trip (print(parse(print(g))) == print(g)).

    graph llama(%tokens: i32[T], ...) {
      param %model.norm.weight: f32[576]
      %0: f32[T,576] = embedding(%model.embed_tokens.weight, %tokens)
      %1: f32[T,576] = rms_norm(%0, %model.layers.0.input_layernorm.weight) {eps=1e-05}
      return %30, %31
    }

Node outputs are renumbered %0, %1, ... in order; inputs and params keep their names.
Attribute values are JSON.
"""
from __future__ import annotations

import json
import re

from .graph import Graph, Node, Value
from .types import parse_type


def print_graph(g: Graph) -> str:
    names: dict[Value, str] = {v: v.name for v in g.inputs + g.params}
    counter = 0
    body = []
    for n in g.nodes:
        for v in n.outputs:
            names[v] = str(counter)
            counter += 1
        outs = ", ".join(f"%{names[v]}: {v.type}" for v in n.outputs)
        ins = ", ".join(f"%{names[v]}" for v in n.inputs)
        attrs = ""
        if n.attrs:
            attrs = " {" + ", ".join(f"{k}={json.dumps(n.attrs[k])}" for k in sorted(n.attrs)) + "}"
        body.append(f"  {outs} = {n.op}({ins}){attrs}")
    head = ", ".join(f"%{v.name}: {v.type}" for v in g.inputs)
    lines = [f"graph {g.name}({head}) {{"]
    lines += [f"  param %{p.name}: {p.type}" for p in g.params]
    lines += body
    lines.append("  return " + ", ".join(f"%{names[v]}" for v in g.outputs))
    lines.append("}")
    return "\n".join(lines) + "\n"


_DECL = re.compile(r"%([\w.]+):\s*(\w+\[[\w,]*\])")
_NODE = re.compile(r"^(?P<outs>.+?) = (?P<op>\w+)\((?P<ins>[^)]*)\)(?P<attrs>.*)$")


def _parse_attrs(text: str, where: str) -> dict:
    text = text.strip()
    if not text:
        return {}
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"{where}: bad attributes {text!r}")
    attrs, pos, body = {}, 0, text[1:-1]
    dec = json.JSONDecoder()
    while pos < len(body):
        eq = body.index("=", pos)
        key = body[pos:eq].strip().lstrip(",").strip()
        value, end = dec.raw_decode(body, eq + 1)
        attrs[key] = value
        pos = end
        while pos < len(body) and body[pos] in ", ":
            pos += 1
    return attrs


def parse_graph(text: str) -> Graph:
    """Parses print_graph's format. Raises ValueError naming the line on bad input."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    m = re.match(r"^graph ([\w.-]+)\((.*)\) \{$", lines[0]) if lines else None
    if not m or lines[-1] != "}":
        raise ValueError("IR text must start with 'graph NAME(...) {' and end with '}'")
    env: dict[str, Value] = {}
    inputs = [Value(n, parse_type(t)) for n, t in _DECL.findall(m.group(2))]
    env.update({v.name: v for v in inputs})
    g = Graph(m.group(1), inputs, [], [], [])
    for i, line in enumerate(lines[1:-1], start=2):
        where = f"line {i}"
        if line.startswith("param "):
            (name, t), = _DECL.findall(line)
            env[name] = Value(name, parse_type(t))
            g.params.append(env[name])
        elif line.startswith("return"):
            g.outputs = [env[n.strip().lstrip("%")] for n in line[len("return"):].split(",") if n.strip()]
        else:
            nm = _NODE.match(line)
            if not nm:
                raise ValueError(f"{where}: cannot parse {line!r}")
            try:
                ins = [env[a.strip().lstrip("%")] for a in nm.group("ins").split(",") if a.strip()]
            except KeyError as e:
                raise ValueError(f"{where}: use of undefined value %{e.args[0]}") from None
            outs = [Value(n, parse_type(t)) for n, t in _DECL.findall(nm.group("outs"))]
            env.update({v.name: v for v in outs})
            g.nodes.append(Node(nm.group("op"), ins, outs, _parse_attrs(nm.group("attrs"), where)))
    return g
