"""The `deepfuse` command: generate, compile, ir.

Only generated text goes to stdout; progress and logs go to stderr. A DeepfuseError
(bad input) prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import os
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default), a .gguf file or a HF checkpoint dir")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--quant", default=None, choices=["int4"], help="weight-only quantization (4-bit, groups of 32)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepfuse", description="compiler-driven LLM inference")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    _add_model_args(g)
    g.add_argument("prompt")
    g.add_argument("--artifact", help="a compiled artifact directory (loaded, not recompiled)")
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="speculative decoding with the n-gram drafter, up to K drafts per step (same output)")
    c = sub.add_parser("compile", help="compile a model into an artifact directory")
    _add_model_args(c)
    c.add_argument("--target", default="cpu")
    c.add_argument("-o", "--output", required=True)
    r = sub.add_parser("ir", help="print the IR, or dump it before/after every pass")
    _add_model_args(r)
    r.add_argument("--target", default="cpu")
    r.add_argument("--dump-dir", help="write NN-pass.before.ir / .after.ir here")
    r.add_argument("--stats", action="store_true", help="print kernels per step and what each pass did")
    return ap


def _generate(args: argparse.Namespace) -> None:
    from .runtime.engine import SamplingParams
    from .runtime.llm import LLM
    from .runtime.spec import SpecConfig

    spec = SpecConfig(num_draft_tokens=args.speculate) if args.speculate else None
    llm = LLM(artifact=args.artifact, spec=spec) if args.artifact else \
        LLM(args.model, dtype=args.dtype, quant=args.quant, spec=spec)
    tok = llm.tokenizer
    prompt = args.prompt if args.no_chat else tok.render_chat([{"role": "user", "content": args.prompt}])
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    generated: list[int] = []
    shown = 0

    def on_token(_: int, token: int) -> None:
        nonlocal shown
        generated.append(token)
        text = tok.decode(generated)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            sys.stdout.write(text[shown:])
            sys.stdout.flush()
            shown = len(text)

    out = llm.generate([prompt], params, on_token)[0]
    if out.error is not None:
        raise out.error
    sys.stdout.write(out.text[shown:] + "\n")
    n = len(out.token_ids)
    spec_note = f", drafts accepted {out.spec.acceptance_rate:.0%}" if out.spec is not None else ""
    print(f"[{n} tokens, {out.total_s:.2f}s, first token {out.ttft_s * 1000:.0f} ms, "
          f"finish: {out.finish_reason}{spec_note}]", file=sys.stderr)


def _compile(args: argparse.Namespace) -> None:
    from .compiler import compile

    art = compile(args.model, target=args.target, dtype=args.dtype, quant=args.quant)
    art.save(args.output)
    print(f"wrote {args.output} ({len(art.graph.nodes)} ops, {len(art.graph.params)} weights, "
          f"target {art.target})", file=sys.stderr)


def _ir(args: argparse.Namespace) -> None:
    from .codegen import get_target
    from .compiler import trace_model
    from .ir import print_graph
    from .models import load_model
    from .passes import PassManager

    target = get_target(args.target)
    model, _ = load_model(args.model, with_tokenizer=False)
    graph, reports = PassManager(target.pipeline(quant=args.quant)).run(trace_model(model, args.dtype), args.dump_dir)
    if args.stats:
        sys.stdout.write(stats_table(graph, reports))
        return
    for r in reports:
        print(f"{r.name:24s} {r.nodes_before:5d} -> {r.nodes_after:5d} nodes  {r.seconds * 1000:7.1f} ms  id {r.id}",
              file=sys.stderr)
    if args.dump_dir:
        print(f"wrote {len(os.listdir(args.dump_dir))} files to {args.dump_dir}", file=sys.stderr)
    else:
        sys.stdout.write(print_graph(graph))


def stats_table(graph, reports) -> str:
    """Per-pass node counts and rule firings, then the kernels one step launches, by op."""
    lines = [f"{'pass':24s} {'nodes':>13s} {'ms':>8s}  rules fired"]
    for r in reports:
        fired = ", ".join(f"{k} x{v}" for k, v in r.fired.items()) or "-"
        lines.append(f"{r.name:24s} {r.nodes_before:5d} -> {r.nodes_after:5d} {r.seconds * 1000:8.1f}  {fired}")
    counts = graph.op_counts()
    lines.append(f"\nkernels per step: {len(graph.nodes)}  ("
                 + ", ".join(f"{op} {n}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1])) + ")")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from .errors import DeepfuseError

    args = _parser().parse_args(argv)
    try:
        {"generate": _generate, "compile": _compile, "ir": _ir}[args.cmd](args)
    except DeepfuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
