import functools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import IRSyntaxError, Node, TensorType, Value, VerifyError, interpret, parse_graph, print_graph, verify


def small_graph():
    w = torch.randn(8, 4)
    norm = torch.ones(4)

    def fn(x):
        h = ops.rms_norm(x, norm, eps=1e-6)
        a, b = ops.split(ops.linear(h, w), sizes=[3, 5])
        return ops.add(ops.silu(a), ops.split(b, sizes=[3, 2])[0])

    return trace(fn, Spec("x", "f32", ("T", 4)), weights={"w": w, "norm": norm}, name="small")


def test_round_trip_small():
    g = small_graph()
    text = print_graph(g)
    assert "split" in text and "{eps=1e-06}" in text
    g2 = parse_graph(text)
    assert print_graph(g2) == text
    verify(g2)


def test_parsed_graph_runs_like_original():
    g = small_graph()
    g2 = parse_graph(print_graph(g))
    g2.weights = g.weights
    x = torch.randn(5, 4)
    torch.testing.assert_close(interpret(g2, {"x": x})[0], interpret(g, {"x": x})[0])


def test_round_trip_smollm2(smollm2):
    from deepfuse.compiler import trace_model

    g = trace_model(smollm2[0])
    text = print_graph(g)
    assert print_graph(parse_graph(text)) == text
    assert text.count(" = attention(") == 30


def test_verifier_names_bad_node_type():
    g = small_graph()
    bad = g.nodes[1]  # the linear
    bad.outputs[0].type = TensorType("f32", ("T", 9))
    with pytest.raises(VerifyError, match=r"node 1 .*linear"):
        verify(g)


def test_verifier_rejects_use_before_def_and_unknown_op():
    g = small_graph()
    g.nodes[0], g.nodes[1] = g.nodes[1], g.nodes[0]
    with pytest.raises(VerifyError, match="before it is defined"):
        verify(g)
    g = small_graph()
    g.nodes.append(Node("frobnicate", [g.inputs[0]], [Value("z", g.inputs[0].type)]))
    with pytest.raises(VerifyError, match="unknown op 'frobnicate'"):
        verify(g)


def test_parser_errors_name_the_line():
    text = print_graph(small_graph()).replace("rms_norm(%x", "rms_norm(%nope")
    with pytest.raises(ValueError, match=r"line \d+: use of undefined value %nope"):
        parse_graph(text)


def test_interpret_checks_inputs():
    g = small_graph()
    with pytest.raises(ValueError, match="missing graph input %x"):
        interpret(g, {})
    with pytest.raises(ValueError, match="wants f32"):
        interpret(g, {"x": torch.randn(3, 5)})


# ---- malformed text: one clear error naming the line, never a Python error from inside the parser

@functools.cache
def tiny_llama_texts() -> list[str]:
    """A one-layer Llama's step graph as the printer writes it (graph.ir), traced and fused."""
    from deepfuse.compiler import trace_model
    from deepfuse.models import Llama, LlamaConfig
    from deepfuse.passes import PassManager, cleanup_passes, fusion_passes

    c = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=1, num_heads=2, num_kv_heads=1,
                    head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position=64, tie_embeddings=False)
    q, kv, h, i = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size, c.intermediate_size
    shapes = {"embed_tokens": (c.vocab_size, h), "lm_head": (c.vocab_size, h), "q_proj": (q, h), "k_proj": (kv, h),
              "v_proj": (kv, h), "o_proj": (h, q), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    gen = torch.Generator().manual_seed(0)
    names = Llama.weight_names(None, c)  # of config c; needs no instance
    weights = {n: torch.randn(next((s for k, s in shapes.items() if k in n), (h,)), generator=gen) for n in names}
    g = trace_model(Llama(c, weights))
    traced = print_graph(g)  # before the passes, which rewrite g in place
    fused, _ = PassManager(cleanup_passes() + fusion_passes()).run(g)
    return [traced, print_graph(fused)]


def check_parse_verify(text: str) -> str:
    """Parses and verifies `text`; any refusal must be IRSyntaxError naming a line or VerifyError naming
    what is wrong (both DeepfuseErrors). Returns which of 'syntax', 'verify', 'ok' happened."""
    try:
        g = parse_graph(text)
    except IRSyntaxError as e:
        assert isinstance(e, DeepfuseError)
        assert re.match(r"line \d+: \S", str(e)), str(e)
        return "syntax"
    printed = print_graph(g)  # whatever parses prints as text that parses back to the same text
    assert print_graph(parse_graph(printed)) == printed
    try:
        verify(g)
    except VerifyError as e:
        assert isinstance(e, DeepfuseError)
        assert re.match(r"node \d+ \(.*\): \S|graph output %\S+ is never defined", str(e)), str(e)
        return "verify"
    return "ok"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("return %18,", "return %99,"), r"line 36: use of undefined value %99"),
    (lambda t: t.replace("return %18, %20, %21", "return %18, %20, %21,"), r"line 36: expected '%name'"),
    (lambda t: t.replace("%0: f32[T,16] = embedding(%model.embed_tokens.weight, %tokens)",
                         "%0: f32[T,16] = embedding(%model.embed_tokens.weight %tokens)"), r"line 14: expected ', %name'"),
    (lambda t: t.replace("%2: f32[T,16] = linear", "%1: f32[T,16] = linear"), r"line 16: %1 is already defined on line 15"),
    (lambda t: t.replace("param %model.norm.weight: f32[16]", "param %model.norm.weight"), r"line 12: want 'param"),
    (lambda t: t.replace("param %model.norm.weight: f32[16]", "param %model.norm.weight: f33[16]"),
     r"line 12: unknown dtype 'f33'"),
    (lambda t: t.replace("%12: f32[T,24] = silu", "%12: f32[T,2\u00b2] = silu"), r"line 26: expected '%name: dtype"),
    (lambda t: t.replace("{eps=1e-05}", "{eps=1e-05,}", 1), r"line 15: expected 'key=value'"),
    (lambda t: t.replace("{eps=1e-05}", "{eps=1e-05 eps=2}", 1), r"line 15: expected ', key=value'"),
    (lambda t: t.replace("{eps=1e-05}", "{eps=1e-05, eps=2}", 1), r"line 15: attribute 'eps' given twice"),
    (lambda t: t.replace("{eps=1e-05}", "{eps=1e-0x}", 1), r"line 15: expected ', key=value'"),
    (lambda t: t.replace("{eps=1e-05}", "{eps=}", 1), r"line 15: attribute 'eps' is not a JSON value"),
    (lambda t: t.replace("{eps=1e-05}", "{eps=1e-05", 1), r"line 15: attributes must be"),
    (lambda t: t.replace("  %21", "  %21 = take_rows(%17)\n  %21"), r"line 35: expected '%name: dtype"),
    (lambda t: t.replace("  return", "  %22: f32[1] = silu(%21)\n  return"), None),  # parses; %22's type is wrong
    (lambda t: t.replace("  return %18, %20, %21\n", ""), r"line 36: the graph has no 'return'"),
    (lambda t: t.replace("  return %18, %20, %21\n", "  return %18\n  return %20\n"), r"line 37: nothing may follow"),
    (lambda t: t[:t.index("  %5")], r"line 18: the graph must end with a line '}'"),
    (lambda t: "\n\n" + t[:t.index("  %5")], r"line 20: the graph must end"),  # numbers count blank lines
    (lambda t: t.replace("graph llama(", "graph llama ("), r"line 1: want 'graph NAME"),
    (lambda t: t.replace("%tokens: i64[T], ", "%tokens i64[T], "), r"line 1: expected '%name: dtype"),
    (lambda t: "", r"line 1: empty IR text"),
    (lambda t: t.replace("%0: f32[T,16] = embedding", "%0: f32[T,16] = ; embedding"), r"line 14: want 'param"),
])
def test_parser_errors_name_the_line_and_the_problem(edit, message):
    text = edit(tiny_llama_texts()[0])
    assert text != tiny_llama_texts()[0]
    if message is None:
        assert check_parse_verify(text) == "verify"  # the verifier's to refuse, not the parser's
        return
    with pytest.raises(IRSyntaxError, match=message):
        parse_graph(text)
    check_parse_verify(text)


def test_undefined_value_in_return_is_a_syntax_error_not_a_key_error():
    """Was a bare KeyError: `return` looked its values up without a check."""
    text = print_graph(small_graph())
    bad = text.replace("  return %", "  return %nope, %")
    with pytest.raises(IRSyntaxError, match=r"line \d+: use of undefined value %nope"):
        parse_graph(bad)


def test_printer_skips_node_numbers_that_name_inputs():
    g = small_graph()
    g.inputs[0].name = "1"
    text = print_graph(g)
    assert "(%1: f32[T,4])" in text and "%0: f32[T,4] = rms_norm(%1," in text and "  %1:" not in text
    assert "  %2: f32[T,8] = linear(%0, %w)" in text
    assert print_graph(parse_graph(text)) == text


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace("%2: f32[T,16] = linear", "%2: f32[T,17] = linear"),
     r"node 2 \(%2 = linear\(.*\)\): output types f32\[T,17\] but linear gives f32\[T,16\]"),
    (lambda t: t.replace("param %model.layers.0.self_attn.k_proj.weight: f32[8,16]",
                         "param %model.layers.0.self_attn.k_proj.weight: bf16[8,16]"), r"node 3 .*linear dtype mismatch"),
    (lambda t: t.replace("param %model.layers.0.self_attn.k_proj.weight: f32[8,16]",
                         "param %model.layers.0.self_attn.k_proj.weight: f32[8,15]"), r"node 3 .*linear K mismatch"),
    (lambda t: t.replace("%tokens: i64[T]", "%tokens: f32[T]"), r"node 0 .*embedding ids must be integer"),
    (lambda t: t.replace("{head_dim=8, theta=10000.0}", "{head_dim=0, theta=10000.0}", 1), r"node 4 .*modulo by zero"),
    (lambda t: t.replace("{head_dim=8, theta=10000.0}", "{theta=10000.0}", 1), r"node 4 .*'head_dim'"),
    (lambda t: t.replace(" = silu(", " = frobnicate("), r"node 12 .*unknown op 'frobnicate'"),
    (lambda t: t.replace("linear(%1, %model.layers.0.self_attn.k_proj.weight)", "linear(%1)"), r"node 3 .*linear"),
])
def test_verifier_names_the_node_of_a_parsed_graph_with_wrong_types(edit, message):
    text = edit(tiny_llama_texts()[0])
    assert text != tiny_llama_texts()[0]
    g = parse_graph(text)
    with pytest.raises(VerifyError, match=message) as e:
        verify(g)
    assert isinstance(e.value, DeepfuseError)


_NAMES = ["%0", "%7", "%99", "%tokens", "%positions", "%model.norm.weight", "%x", "%", "%%", "%-1", "%a b"]
_CHARS = st.sampled_from(list("%:,=(){}[]\" .-_0123456789eTxfi") + ["\n", "\t", "\u00b2", "\u00e9", "\x0c", "\u2028"])
_JSON = st.sampled_from(["0", "-1", "2", "1e308", "1e999", "NaN", "Infinity", "true", "null", '"x"', '"f32"', "[]",
                         "[1, 2]", '["a"]', "{}", '{"a": 1}', "[[1]]", "99999999999999999999", "1.5", '"}"', '")"'])
_TYPES = st.sampled_from(["f32[T,16]", "bf16[T,16]", "f32[T,8]", "f32[16]", "f32[]", "i64[T]", "i64[R]", "f32[R,32]",
                          "f32[2,N,BS,1,8]", "u8[T,16]", "f32[T,T]"])
_EDITS = st.one_of(
    st.tuples(st.just("delete_line"), st.integers(0, 999)),
    st.tuples(st.just("duplicate_line"), st.integers(0, 999), st.integers(0, 999)),
    st.tuples(st.just("swap_lines"), st.integers(0, 999), st.integers(0, 999)),
    st.tuples(st.just("replace_char"), st.integers(0, 99999), _CHARS),
    st.tuples(st.just("insert_char"), st.integers(0, 99999), _CHARS),
    st.tuples(st.just("delete_char"), st.integers(0, 99999)),
    st.tuples(st.just("truncate"), st.integers(0, 99999)),
    st.tuples(st.just("rename"), st.integers(0, 999), st.sampled_from(_NAMES)),
    st.tuples(st.just("renumber"), st.integers(0, 999), st.sampled_from(["0", "1", "7", "16", "99", "00", "123456789"])),
    st.tuples(st.just("attr_value"), st.integers(0, 999), _JSON),
    st.tuples(st.just("retype"), st.integers(0, 999), _TYPES),
)


def apply_edit(text: str, edit: tuple) -> str:
    kind, i, *arg = edit
    lines = text.split("\n")
    if kind == "delete_line":
        del lines[i % len(lines)]
    elif kind == "duplicate_line":
        lines.insert(arg[0] % (len(lines) + 1), lines[i % len(lines)])
    elif kind == "swap_lines":
        a, b = i % len(lines), arg[0] % len(lines)
        lines[a], lines[b] = lines[b], lines[a]
    elif not text:
        return text
    elif kind in ("replace_char", "insert_char", "delete_char", "truncate"):
        p = i % len(text)
        return {"replace_char": lambda: text[:p] + arg[0] + text[p + 1:], "insert_char": lambda: text[:p] + arg[0] + text[p:],
                "delete_char": lambda: text[:p] + text[p + 1:], "truncate": lambda: text[:p]}[kind]()
    else:
        pattern = {"rename": r"%[\w.]+", "renumber": r"\d+", "attr_value": r"(?<==)[^,}]+", "retype": r"\w+\[[\w,]*\]"}[kind]
        found = list(re.finditer(pattern, text))
        if not found:
            return text
        m = found[i % len(found)]
        return text[:m.start()] + arg[0] + text[m.end():]
    return "\n".join(lines)


@functools.cache
def _fuzz_bases() -> list[str]:
    return tiny_llama_texts() + [print_graph(small_graph())]


@given(base=st.integers(0, 2), edits=st.lists(_EDITS, min_size=1, max_size=4))
@settings(max_examples=500, deadline=None, derandomize=True, database=None)
def test_fuzzed_graph_text_parses_or_names_the_line(base, edits):
    """Random edits of a real graph.ir: parse + verify succeed or refuse with the project's error."""
    text = _fuzz_bases()[base]
    for e in edits:
        text = apply_edit(text, e)
    check_parse_verify(text)



def test_elementwise_ops_check_their_operand_count():
    text = print_graph(small_graph())
    silu = next(ln for ln in text.splitlines() if "= silu(" in ln)
    add = next(ln for ln in text.splitlines() if "= add(" in ln)
    operand = silu[silu.index("(") + 1:silu.index(")")]
    with pytest.raises(VerifyError, match="wants 1 operand, got 2"):
        verify(parse_graph(text.replace(silu, silu.replace(f"({operand})", f"({operand}, {operand})"))))
    with pytest.raises(VerifyError, match="wants 2 operands, got 1"):
        verify(parse_graph(text.replace(add, add[:add.index("(") + 1] + add[add.index("(") + 1:].split(",")[0] + ")")))
