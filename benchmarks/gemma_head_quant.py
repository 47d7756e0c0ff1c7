"""What quantizing Gemma 3 270M costs in accuracy, on real text read by teacher forcing (so every
build sees the same tokens): by default quant="int4-head" (the tied 262,144 x 640 head in 4-bit
groups of 32) against quant="int4" (the same int4 projections, the head bf16); with --reference
and --candidates any builds against any (`none`: no quantization), all bf16.

For each of --docs documents (license texts and standard-library docstrings on this machine, as
swa_replay.py reads them): the first --prompt tokens as the prompt, then one decode step per token
of the next --tokens tokens of the document. Reported over all those positions: top-1 agreement
(the two builds' argmax equal), the mean KL divergence of the int4 head's next-token distribution
from the bf16 head's, and each build's perplexity of the document's own next tokens.

    python benchmarks/gemma_head_quant.py [--docs 4] [--prompt 32] [--tokens 192]
    python benchmarks/gemma_head_quant.py --reference none --candidates int4,w8a8 --result gemma_quant.json
Writes benchmarks/results/gemma_head_quant.json (or --result).
"""
from __future__ import annotations

import argparse
import math

import torch
from results_file import write_result
from swa_replay import texts


def forced_logits(art, config, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """f32 [len(continuation), V]: row i predicts continuation[i] (a prefill of the prompt, then one
    decode step per token of the continuation but the last, over a fresh paged cache)."""
    from deepfuse.models.cache_groups import cache_groups
    from deepfuse.runtime.batch import SeqChunk, build_step
    from deepfuse.runtime.kv_cache import CacheConfig, KVCache

    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, torch.bfloat16,
                    CacheConfig(block_size=16, num_blocks=64), "cpu", cache_groups(config))
    seq, blocks, start, out = list(prompt), [], 0, []
    for tok in continuation:
        logits, _, _ = art(build_step([SeqChunk(seq[start:], start, blocks)], cache))
        out.append(logits[0].float().clone())
        start = len(seq)
        seq.append(tok)
    return torch.stack(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--reference", default="int4", help="the build compared against (none: no quantization)")
    ap.add_argument("--candidates", default="int4-head", help="comma-separated quant modes")
    ap.add_argument("--result", default="gemma_head_quant.json")
    args = ap.parse_args()
    import deepfuse
    from deepfuse.models import load_model

    source, tok = load_model("gemma3")
    quant = lambda q: None if q == "none" else q
    names = [args.reference] + [c for c in args.candidates.split(",") if c != args.reference]
    builds = {q: deepfuse.compile(source, target="cpu", dtype="bf16", quant=quant(q), tokenizer=tok) for q in names}
    docs = []
    for path, text in texts():
        ids = tok.encode(text)
        if len(ids) >= args.prompt + args.tokens:
            docs.append((path, ids[:args.prompt + args.tokens]))
        if len(docs) == args.docs:
            break
    cands = names[1:]
    rows, agree, kl, nll = [], dict.fromkeys(cands, 0), dict.fromkeys(cands, 0.0), dict.fromkeys(names, 0.0)
    for path, ids in docs:
        prompt, cont = ids[:args.prompt], ids[args.prompt:]
        lp = {q: torch.log_softmax(forced_logits(art, source.config, prompt, cont), -1) for q, art in builds.items()}
        ref = lp[args.reference]
        target = torch.tensor(cont)
        doc_nll = {q: float(-v[torch.arange(len(cont)), target].sum()) for q, v in lp.items()}
        row = {"document": path, "positions": len(cont),
               "perplexity": {q: math.exp(v / len(cont)) for q, v in doc_nll.items()}}
        for c in cands:
            a = int((ref.argmax(-1) == lp[c].argmax(-1)).sum())
            k = float((ref.exp() * (ref - lp[c])).sum(-1).mean())
            row[c] = {"top1_agreement": a / len(cont), "mean_kl": k}
            agree[c], kl[c] = agree[c] + a, kl[c] + k * len(cont)
        for q in nll:
            nll[q] += doc_nll[q]
        rows.append(row)
        print(f"{path}: " + "; ".join(f"{c}: top-1 agreement {row[c]['top1_agreement']:.3f}, mean KL "
                                      f"{row[c]['mean_kl']:.2e}" for c in cands)
              + "; perplexity " + ", ".join(f"{q} {v:.2f}" for q, v in row["perplexity"].items()), flush=True)
    n = sum(r["positions"] for r in rows)
    total = {"positions": n, "reference": args.reference, "perplexity": {q: math.exp(v / n) for q, v in nll.items()},
             **{c: {"top1_agreement": agree[c] / n, "mean_kl": kl[c] / n} for c in cands}}
    if len(cands) == 1:  # the single-candidate file's original keys
        total.update(total[cands[0]])
    print(f"all {n} positions, against {args.reference}: "
          + "; ".join(f"{c}: top-1 agreement {total[c]['top1_agreement']:.3f}, mean KL {total[c]['mean_kl']:.2e}"
                      for c in cands)
          + "; perplexity " + ", ".join(f"{q} {v:.2f}" for q, v in total["perplexity"].items()))
    write_result(args.result, {"model": "gemma-3-270m Q4_K_M", "dtype": "bf16", "prompt_tokens": args.prompt,
                               "forced_tokens": args.tokens, "total": total, "documents": rows})


if __name__ == "__main__":
    main()
