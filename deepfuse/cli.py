"""The `deepfuse` command: generate, serve, compile, ir, train-drafter.

Only generated text goes to stdout; progress and logs go to stderr. A DeepfuseError
(bad input) prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import os
import sys


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 (default), gemma3, a .gguf file or a HF checkpoint dir")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    p.add_argument("--quant", default=None, choices=["int4", "int4-head", "int4-head8", "int4-a8", "w8a8"],
                   help="int4: weight-only, 4-bit groups of 32 (the LM head stays dense); int4-head: the LM head int4 too; "
                        "int4-head8: the LM head int8 with int8 activations; int4-a8: int4 weights times int8 activations "
                        "per group of 32, the head as int4-head8; w8a8: int8 weights and activations")
    p.add_argument("--kv-cache-dtype", default=None, choices=["int8"],
                   help="int8: cached k and v rows as int8 with a scale each (cpu; default: the model dtype)")


def _add_invariant_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-invariant", action="store_true",
                   help="one kernel per op for every batch shape: a request's tokens never depend on its batch")


def _add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="speculative decoding with the n-gram drafter, up to K drafts per step (same output)")
    p.add_argument("--draft-head", metavar="FILE",
                   help="with --speculate: draft with this MTP head (from train-drafter) instead of n-grams")


def _build_llm(args: argparse.Namespace, **engine):
    """The LLM the model, artifact and speculation arguments ask for."""
    from .runtime.llm import LLM

    return LLM(**_llm_kwargs(args, **engine))


def _llm_kwargs(args: argparse.Namespace, **engine) -> dict:
    """LLM's arguments for the model, artifact and speculation arguments (and engine settings)."""
    from .errors import DeepfuseError
    from .runtime.spec import SpecConfig

    if args.draft_head and not args.speculate:
        raise DeepfuseError("--draft-head needs --speculate K (the most drafts verified per step)")
    method = dict(method="mtp", draft_head=args.draft_head) if args.draft_head else {}
    spec = SpecConfig(num_draft_tokens=args.speculate, **method) if args.speculate else None
    if args.artifact_digest and not args.artifact:
        raise DeepfuseError("--artifact-digest pins an artifact: give it with --artifact DIR")
    tp = getattr(args, "tp", 1)
    if tp < 1:
        raise DeepfuseError(f"--tp must be >= 1, got {tp}")
    if getattr(args, "moe_dispatch", "all_reduce") != "all_reduce":
        engine["moe_dispatch"] = args.moe_dispatch
    if args.artifact:
        return dict(artifact=args.artifact, spec=spec, batch_invariant=args.batch_invariant,
                    artifact_digest=args.artifact_digest, tensor_parallel_size=tp, **engine)
    return dict(model=args.model, dtype=args.dtype, quant=args.quant, spec=spec, batch_invariant=args.batch_invariant,
                kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=tp, **engine)


def _add_moe_dispatch_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moe-dispatch", choices=("all_reduce", "all_to_all"), default="all_reduce",
                   help="with --tp: each rank's experts on every token, summed by all_reduce; or each rank's share "
                        "of the tokens sent to their experts' ranks and back by all_to_all (cpu)")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="deepfuse", description="compiler-driven LLM inference")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text from a prompt (streams to stdout)")
    _add_model_args(g)
    _add_invariant_arg(g)
    g.add_argument("prompt")
    g.add_argument("--artifact", help="a compiled artifact directory (loaded, not recompiled)")
    g.add_argument("--artifact-digest", help="sha256:... as `deepfuse compile` printed it: refuse any other artifact")
    g.add_argument("--tp", type=int, default=1, metavar="N", help="tensor parallel over N processes (cpu, gloo); a "
                   "tensor-parallel artifact runs on its ranks without it (sm90/sm100: NCCL, one GPU a rank)")
    _add_moe_dispatch_arg(g)
    g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest's probability")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="end at this text (repeatable)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="vLLM's; 1 = off")
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--min-tokens", type=int, default=0, help="no end of text before this many tokens")
    g.add_argument("--decode-steps", type=int, default=None, metavar="K",
                   help="decode steps run before their tokens are taken and printed (the same text, printed K "
                        "tokens at a time; default 8 in one process, 1 with --tp)")
    _add_spec_args(g)
    v = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)")
    _add_model_args(v)
    _add_invariant_arg(v)
    _add_spec_args(v)
    v.add_argument("--artifact", help="a compiled artifact directory (loaded, not recompiled)")
    v.add_argument("--artifact-digest", help="sha256:... as `deepfuse compile` printed it: refuse any other artifact")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes")
    v.add_argument("--served-model-name", help="the model name clients give (default: --model, or the artifact's directory)")
    v.add_argument("--num-blocks", type=int, default=1024, help="KV cache blocks (of 16 tokens)")
    v.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one step")
    v.add_argument("--max-num-tokens", type=int, default=512, help="token budget of one step")
    v.add_argument("--max-request-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    v.add_argument("--kv-store", metavar="DIR", help="keep prefix-cache blocks on disk in DIR too (found again "
                   "after eviction or a restart)")
    v.add_argument("--kv-store-gb", type=float, default=4.0, help="the disk store's size (GiB)")
    v.add_argument("--replicas", type=int, default=1, help="engine replicas, each a Ray actor with its own KV cache "
                   "(default 1: one engine in this process; docs/distributed.md)")
    v.add_argument("--routing", default="prefix", choices=["prefix", "round_robin"], help="with --replicas: send a "
                   "request to the replica caching the longest prefix of it (default), or to each in turn")
    v.add_argument("--swa-replay-tokens", type=int, default=0, help="bounded replay for models that mix sliding-window "
                   "and full-attention layers (0: off; docs/hybrid-attention.md)")
    v.add_argument("--decode-steps", type=int, default=1, metavar="K",
                   help="decode steps run before their tokens are taken (the same text, streamed K tokens at a time; "
                        "a step bursts only while no request waits to be admitted; default 1)")
    t = sub.add_parser("train-drafter", help="train an MTP draft head on the model's own outputs (CPU, minutes)")
    _add_model_args(t)
    t.add_argument("-o", "--output", required=True, help="the head file to write (.safetensors)")
    t.add_argument("--prompts", metavar="FILE.jsonl", help='one prompt per line: "text", {"prompt": "text"} or '
                   '{"prompt_token_ids": [...]} (default: prompts built from the Python standard library)')
    t.add_argument("--no-chat", action="store_true", help="do not apply the chat template to text prompts")
    t.add_argument("--num-prompts", type=int, default=256, help="prompts built when --prompts is not given")
    t.add_argument("--max-tokens", type=int, default=96, help="greedy continuation per prompt")
    t.add_argument("--minutes", type=float, default=4.0, help="training time (after the data is generated)")
    t.add_argument("--steps", type=int, default=100_000, help="at most this many training batches")
    t.add_argument("--depth", type=int, default=3, help="chained draft steps trained per example")
    c = sub.add_parser("compile", help="compile a model into an artifact directory")
    _add_model_args(c)
    _add_invariant_arg(c)
    c.add_argument("--target", default="cpu")
    c.add_argument("--tp", type=int, default=1, metavar="N",
                   help="one artifact of N tensor-parallel ranks: per-rank plans and weight shards "
                        "(cpu, sm90, sm100, ascend950; f32/bf16)")
    _add_moe_dispatch_arg(c)
    c.add_argument("-o", "--output", required=True)
    r = sub.add_parser("ir", help="print the IR, or dump it before/after every pass")
    _add_model_args(r)
    r.add_argument("--target", default="cpu")
    r.add_argument("--dump-dir", help="write NN-pass.before.ir / .after.ir here")
    r.add_argument("--stats", action="store_true", help="print kernels per step and what each pass did")
    return ap


def _generate(args: argparse.Namespace) -> None:
    from .runtime.detokenize import IncrementalText, find_stop
    from .runtime.engine import SamplingParams

    steps = args.decode_steps
    if steps is None:  # bursts where the engine runs in one process
        from .runtime.loader import tensor_parallel_size

        ranks = args.tp if args.tp != 1 else tensor_parallel_size(args.artifact or args.model)
        steps = 8 if ranks == 1 else 1
    llm = _build_llm(args, decode_steps=steps)
    tok = llm.tokenizer
    prompt = args.prompt if args.no_chat else tok.render_chat([{"role": "user", "content": args.prompt}])
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
                            repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens)
    generated: list[int] = []
    text = IncrementalText(tok.decode)  # the text so far ("" added while a character is incomplete)
    # the last characters wait while they could start a stop string: what is printed never
    # reaches past where a stop string (not printed) begins
    held = max((len(s) for s in args.stop), default=1) - 1
    printed = 0

    def on_token(_: int, token: int) -> None:
        nonlocal printed
        generated.append(token)
        if not text.add(generated):
            return
        stop_at = find_stop(text.text, args.stop, printed)  # the token that ends the request is shown too
        end = stop_at if stop_at >= 0 else len(text.text) - held
        if end > printed:
            sys.stdout.write(text.text[printed:end])
            sys.stdout.flush()
            printed = end

    sharded = llm.model is None  # ranks in other processes: the text comes at the end
    out = llm.generate([prompt], params, None if sharded else on_token)[0]
    if out.error is not None:
        raise out.error
    done, m = out.outputs[0], out.metrics
    sys.stdout.write(done.text[printed:] + "\n")
    spec_note = f", drafts accepted {m.spec.acceptance_rate:.0%}" if m.spec is not None else ""
    print(f"[{len(done.token_ids)} tokens, {m.total_s:.2f}s, first token {m.ttft_s * 1000:.0f} ms, "
          f"finish: {done.finish_reason}{spec_note}]", file=sys.stderr)


def read_prompts(path: str, tokenizer, chat: bool) -> list[list[int]]:
    """A JSONL prompts file -> token ids; a bad line raises DeepfuseError naming it."""
    import json

    from .errors import DeepfuseError

    out = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DeepfuseError(f"cannot read prompts file {path}: {e}") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise DeepfuseError(f"{path} line {i}: not JSON ({e.msg})") from None
        if isinstance(item, dict) and "prompt_token_ids" in item:
            ids = item["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(t, int) for t in ids):
                raise DeepfuseError(f"{path} line {i}: prompt_token_ids must be a non-empty list of integers")
            out.append(ids)
            continue
        text = item.get("prompt") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise DeepfuseError(f'{path} line {i}: want "text", {{"prompt": "text"}} or {{"prompt_token_ids": [...]}}')
        if tokenizer is None:
            raise DeepfuseError(f"{path} line {i}: a text prompt, but the model has no tokenizer")
        out.append(tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": text}]) if chat else text))
    if not out:
        raise DeepfuseError(f"{path} has no prompts")
    return out


def _train_drafter(args: argparse.Namespace) -> None:
    import json

    from .compiler import compile
    from .errors import DeepfuseError
    from .models import load_model
    from .runtime.train_drafter import TrainConfig, train_drafter

    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir) or not os.access(out_dir, os.W_OK):  # say so before minutes of training
        raise DeepfuseError(f"cannot write {args.output}: {out_dir} is not a writable directory")
    try:
        model, tok = load_model(args.model)
    except DeepfuseError:  # no tokenizer: token-id prompts still work
        if not args.prompts:
            raise
        model, tok = load_model(args.model, with_tokenizer=False)
    prompts = read_prompts(args.prompts, tok, not args.no_chat) if args.prompts else None
    config = TrainConfig(num_prompts=args.num_prompts, max_tokens=args.max_tokens, seconds=args.minutes * 60,
                         steps=args.steps, depth=args.depth)
    art = compile(model, dtype=args.dtype, quant=args.quant, tokenizer=tok, kv_cache_dtype=args.kv_cache_dtype)
    log = lambda msg: print(msg, file=sys.stderr)
    m = train_drafter(art, args.output, config, prompts=prompts, log=log)
    held = m["heldout"]
    log(f"wrote {args.output}: {m['steps']} steps in {m['train_seconds']} s on {m['train_positions']} positions "
        f"(data {m['data_seconds']} s)")
    if held:
        log(f"held-out drafting, {held['drafts']} drafts at {held['positions']} positions: acceptance "
            f"{held['acceptance_rate']:.1%}, mean accepted length {held['mean_accepted_length']:.2f}, first draft "
            f"right {held['first_draft_accuracy']:.1%} (confidence {held['first_draft_mean_confidence']:.2f})")
    print(json.dumps({k: m[k] for k in ("steps", "train_positions", "heldout")}))


def _compile(args: argparse.Namespace) -> None:
    from .codegen.artifact import artifact_digest
    from .compiler import compile
    from .errors import DeepfuseError

    if args.tp == 1 and args.moe_dispatch != "all_reduce":
        raise DeepfuseError("--moe-dispatch places expert-parallel MoE layers over ranks: give --tp N (N > 1)")
    if args.tp != 1:
        _compile_sharded(args)
    else:
        art = compile(args.model, target=args.target, dtype=args.dtype, quant=args.quant,
                      batch_invariant=args.batch_invariant, kv_cache_dtype=args.kv_cache_dtype)
        art.save(args.output)
        print(f"wrote {args.output} ({len(art.graph.nodes)} ops, {len(art.graph.params)} weights, "
              f"target {art.target})", file=sys.stderr)
    print(f"artifact digest: {artifact_digest(args.output)}  (pin it: deepfuse generate --artifact {args.output} "
          f"--artifact-digest ...)")


def _compile_sharded(args: argparse.Namespace) -> None:
    from .errors import DeepfuseError
    from .models import load_model
    from .sharded_compile import compile_sharded

    if args.tp < 2:
        raise DeepfuseError(f"--tp must be >= 1, got {args.tp}")
    given = [f for f, v in (("--quant", args.quant), ("--kv-cache-dtype", args.kv_cache_dtype),
                            ("--batch-invariant", args.batch_invariant)) if v]
    if given:
        raise DeepfuseError(f"--tp does not take {', '.join(given)} yet")
    try:
        model, tok = load_model(args.model)
    except DeepfuseError as e:  # a checkpoint without a tokenizer still runs on token ids
        if "tokenizer" not in str(e):
            raise
        model, tok = load_model(args.model, with_tokenizer=False)
        print(f"note: {args.model} has no tokenizer; the artifact takes token ids only", file=sys.stderr)
    compile_sharded(model, args.tp, args.output, args.target, args.dtype, tok, args.moe_dispatch)
    print(f"wrote {args.output} ({args.tp} ranks, target {args.target})", file=sys.stderr)


def _ir(args: argparse.Namespace) -> None:
    from .codegen import get_target
    from .compiler import trace_model
    from .ir import print_graph
    from .models import load_model
    from .passes import PassManager

    target = get_target(args.target)
    model, _ = load_model(args.model, with_tokenizer=False)
    graph, reports = PassManager(target.pipeline(quant=args.quant)).run(trace_model(model, args.dtype, args.kv_cache_dtype),
                                                                            args.dump_dir)
    if args.stats:
        sys.stdout.write(stats_table(graph, reports))
        return
    for r in reports:
        print(f"{r.name:24s} {r.nodes_before:5d} -> {r.nodes_after:5d} nodes  {r.seconds * 1000:7.1f} ms  id {r.id}",
              file=sys.stderr)
    if args.dump_dir:
        with open(os.path.join(args.dump_dir, "kernels.txt"), "w") as f:
            f.write(kernels_text(graph))
        print(f"wrote {len(os.listdir(args.dump_dir))} files to {args.dump_dir}", file=sys.stderr)
    else:
        sys.stdout.write(print_graph(graph))


def kernels_text(graph) -> str:
    """Every generated kernel of the graph as kernel IR text, with the scheduler's reasons."""
    from .kernel.ir import Kernel

    return "\n".join(Kernel.from_json(n.attrs["kernel"]).text() for n in graph.nodes if n.op == "kernel")


def fusion_lines(graph) -> list[str]:
    """One line per distinct generated kernel: the ops it fuses, its index space, how often a
    step runs it, and the scheduler's reasons (why it was formed, why neighbours were left out)."""
    seen: dict[str, list] = {}
    for n in graph.nodes:
        if n.op == "kernel":
            k = n.attrs["kernel"]
            key = "+".join(n.attrs["ops"]) + str(k["space"])
            seen.setdefault(key, [n.attrs["ops"], k["space"], 0, k["notes"]])[2] += 1
    lines = []
    for ops, space, count, notes in seen.values():
        lines.append(f"  x{count:<3d} [{', '.join(map(str, space))}]  {' -> '.join(ops)}")
        lines += [f"        {note}" for note in notes if note.startswith("not fused")]
    return lines


def stats_table(graph, reports) -> str:
    """Per-pass node counts and rule firings, then the kernels one step launches, by op, and the
    generated kernels with the fusion scheduler's reasons."""
    lines = [f"{'pass':24s} {'nodes':>13s} {'ms':>8s}  rules fired"]
    for r in reports:
        fired = ", ".join(f"{k} x{v}" for k, v in r.fired.items()) or "-"
        lines.append(f"{r.name:24s} {r.nodes_before:5d} -> {r.nodes_after:5d} {r.seconds * 1000:8.1f}  {fired}")
    counts = graph.op_counts()
    lines.append(f"\nkernels per step: {len(graph.nodes)}  ("
                 + ", ".join(f"{op} {n}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1])) + ")")
    fused = fusion_lines(graph)
    if fused:
        lines.append("\ngenerated kernels (fused ops; groups not merged, and why):")
        lines += fused
    return "\n".join(lines) + "\n"


def _serve(args: argparse.Namespace) -> None:
    from .errors import DeepfuseError

    try:
        from .serve import serve
    except ImportError as e:
        raise DeepfuseError(f"`deepfuse serve` needs the server packages ({e.name} is missing): "
                            "pip install -e '.[serve]'") from None
    for name in ("port", "num_blocks", "max_num_seqs", "max_num_tokens", "max_request_bytes", "replicas", "decode_steps"):
        if getattr(args, name) < 1:
            raise DeepfuseError(f"--{name.replace('_', '-')} must be >= 1")
    if args.kv_store is None and args.kv_store_gb != 4.0:
        raise DeepfuseError("--kv-store-gb sizes the disk store: give it with --kv-store DIR")
    if args.replicas > 1 and args.kv_store:
        raise DeepfuseError("--kv-store with --replicas: the replicas would share one disk store; give one or the other")
    kwargs = _llm_kwargs(args, num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                         max_num_tokens=args.max_num_tokens, kv_store=args.kv_store, kv_store_gb=args.kv_store_gb,
                         swa_replay_tokens=args.swa_replay_tokens, decode_steps=args.decode_steps)
    if args.replicas > 1:
        from .runtime.replicas import Replicas

        llm = Replicas(args.replicas, routing=args.routing, **kwargs)
    else:
        from .runtime.async_llm import AsyncLLM

        llm = AsyncLLM(kwargs.pop("model", "smollm2"), **kwargs)  # its LLM built on its engine thread
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.artifact)) if args.artifact else args.model)
    serve(llm, name, host=args.host, port=args.port, api_key=args.api_key, max_body_bytes=args.max_request_bytes)


def main(argv: list[str] | None = None) -> int:
    from .errors import DeepfuseError

    args = _parser().parse_args(argv)
    try:
        commands = {"generate": _generate, "serve": _serve, "compile": _compile, "ir": _ir, "train-drafter": _train_drafter}
        commands[args.cmd](args)
    except DeepfuseError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
