"""IR text: `print_graph` and `parse_graph` round-trip (print(parse(print(g))) == print(g)).

    graph llama(%tokens: i32[T], ...) {
      param %model.norm.weight: f32[576]
      %0: f32[T,576] = embedding(%model.embed_tokens.weight, %tokens)
      %1: f32[T,576] = rms_norm(%0, %model.layers.0.input_layernorm.weight) {eps=1e-05}
      return %30, %31
    }

Node outputs are renumbered %0, %1, ... in order (skipping numbers that name an input or
param); inputs and params keep their names.
Attribute values are JSON. A graph file is user input: any text that is not this format
gets one IRSyntaxError naming the line (the verifier, not the parser, checks op types).
"""
from __future__ import annotations

import json
import re

from ..errors import DeepfuseError
from .graph import Graph, Node, Value
from .types import DTYPES, TensorType


class IRSyntaxError(DeepfuseError):
    """IR text that does not parse; the message starts with `line N:`."""


def print_graph(g: Graph) -> str:
    names: dict[Value, str] = {v: v.name for v in g.inputs + g.params}
    taken = set(names.values())  # an input or param named "3" keeps its name; node values skip it
    counter = 0
    body = []
    for n in g.nodes:
        for v in n.outputs:
            while str(counter) in taken:
                counter += 1
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


# The tokens of the format. Each is matched whole (fullmatch) or at a position (match).
_NAME = r"[\w.]+"
_DIM = r"(?:[0-9]+|[A-Za-z_]\w*)"
_TYPE = rf"(?P<dtype>\w+)\[(?P<dims>(?:{_DIM}(?:,{_DIM})*)?)\]"
_DECL = re.compile(rf"%(?P<name>{_NAME}):\s*{_TYPE}")
_REF = re.compile(rf"%(?P<name>{_NAME})")
_SEP = re.compile(r"\s*,\s*")  # between list items
_HEAD = re.compile(r"graph (?P<name>[\w.-]+)\((?P<decls>.*)\) \{")
_PARAM = re.compile(r"param\s+(?P<decl>.*)")
_RETURN = re.compile(r"return(?:\s+(?P<refs>.*))?")
_NODE = re.compile(r"(?P<outs>.+?) = (?P<op>\w+)\((?P<ins>[^)]*)\)(?P<attrs>.*)")
_KEY = re.compile(r"\s*(?P<key>\w+)\s*=\s*")


class _Line:
    """One non-blank line of the text, stripped, with its 1-based number in the text (blank lines count)."""

    def __init__(self, number: int, text: str):
        self.number, self.text = number, text

    def error(self, msg: str) -> IRSyntaxError:
        shown = self.text if len(self.text) <= 120 else self.text[:117] + "..."
        return IRSyntaxError(f"line {self.number}: {msg}: {shown!r}")


def _items(text: str, item: re.Pattern, line: _Line, what: str) -> list[re.Match]:
    """A comma-separated list of `item`s (possibly empty) filling all of `text`; `what` shows the form."""
    found: list[re.Match] = []
    pos, text = 0, text.strip()
    while pos < len(text):
        if found:
            sep = _SEP.match(text, pos)
            if not sep:
                raise line.error(f"expected ', {what}' at {text[pos:pos + 20]!r}")
            pos = sep.end()
        m = item.match(text, pos)
        if not m:
            raise line.error(f"expected '{what}' at {text[pos:pos + 20]!r}")
        found.append(m)
        pos = m.end()
    return found


def _type(m: re.Match, line: _Line) -> TensorType:
    if m["dtype"] not in DTYPES:
        raise line.error(f"unknown dtype {m['dtype']!r} (known: {', '.join(DTYPES)})")
    dims = m["dims"].split(",") if m["dims"] else []
    return TensorType(m["dtype"], tuple(int(d) if d.isdigit() else d for d in dims))


def _parse_attrs(text: str, line: _Line) -> dict:
    text = text.strip()
    if not text:
        return {}
    if not (text.startswith("{") and text.endswith("}")):
        raise line.error("attributes must be {key=value, ...}")
    attrs: dict = {}
    body, pos = text[1:-1].strip(), 0
    dec = json.JSONDecoder()
    while pos < len(body):
        if attrs:
            sep = _SEP.match(body, pos)
            if not sep:
                raise line.error(f"expected ', key=value' at {body[pos:pos + 20]!r}")
            pos = sep.end()
        km = _KEY.match(body, pos)
        if not km:
            raise line.error(f"expected 'key=value' at {body[pos:pos + 20]!r}")
        key = km["key"]
        if key in attrs:
            raise line.error(f"attribute {key!r} given twice")
        try:
            attrs[key], pos = dec.raw_decode(body, km.end())
        except json.JSONDecodeError as e:
            raise line.error(f"attribute {key!r} is not a JSON value ({e.msg})") from None
    return attrs


def parse_graph(text: str) -> Graph:
    """Parses print_graph's format. Raises IRSyntaxError (a DeepfuseError, so a ValueError)
    naming the line on any text that is not that format."""
    lines = [_Line(i, ln.strip()) for i, ln in enumerate(text.split("\n"), start=1) if ln.strip()]
    if not lines:
        raise IRSyntaxError("line 1: empty IR text; want 'graph NAME(...) {' ... '}'")
    first, last = lines[0], lines[-1]
    head = _HEAD.fullmatch(first.text)
    if not head:
        raise first.error("want 'graph NAME(%input: type, ...) {'")
    if last is first or last.text != "}":
        raise last.error("the graph must end with a line '}' (is the text cut short?)")

    env: dict[str, tuple[Value, int]] = {}  # name -> (value, line that defines it)

    def define(m: re.Match, line: _Line) -> Value:
        name = m["name"]
        if name in env:
            raise line.error(f"%{name} is already defined on line {env[name][1]}")
        v = Value(name, _type(m, line))
        env[name] = (v, line.number)
        return v

    def use(m: re.Match, line: _Line) -> Value:
        name = m["name"]
        if name not in env:
            raise line.error(f"use of undefined value %{name}")
        return env[name][0]

    inputs = [define(m, first) for m in _items(head["decls"], _DECL, first, "%name: dtype[dims]")]
    g = Graph(head["name"], inputs, [], [], [])
    returned: _Line | None = None
    for line in lines[1:-1]:
        if returned is not None:
            raise line.error(f"nothing may follow the return on line {returned.number}")
        if pm := _PARAM.fullmatch(line.text):
            decl = _DECL.fullmatch(pm["decl"].strip())
            if not decl:
                raise line.error("want 'param %name: dtype[dims]'")
            g.params.append(define(decl, line))
        elif rm := _RETURN.fullmatch(line.text):
            g.outputs = [use(m, line) for m in _items(rm["refs"] or "", _REF, line, "%name")]
            returned = line
        elif nm := _NODE.fullmatch(line.text):
            ins = [use(m, line) for m in _items(nm["ins"], _REF, line, "%name")]
            attrs = _parse_attrs(nm["attrs"], line)
            out_decls = _items(nm["outs"], _DECL, line, "%name: dtype[dims]")
            if not out_decls:
                raise line.error("a node must define at least one value")
            outs = [define(m, line) for m in out_decls]
            g.nodes.append(Node(nm["op"], ins, outs, attrs))
        else:
            raise line.error("want 'param %name: dtype[dims]', '%out: dtype[dims], ... = op(%in, ...) {attrs}' "
                             "or 'return %v, ...'")
    if returned is None:
        raise last.error("the graph has no 'return' line before its closing '}'")
    return g
