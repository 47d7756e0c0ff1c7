"""Expert-parallel MoE over 2 gloo ranks, dispatched two ways, against one process and HF.

  ep2-all_reduce   every rank routes every token and runs its experts on the tokens that chose
                   them (moe_experts, grouped GEMMs); the partial sums are all-reduced
  ep2-all_to_all   each rank routes its own rows of the step and sends them to their experts'
                   ranks and back (ir/opdefs_ep.py; moe_local_experts in grouped GEMMs, the
                   dispatch and combine as torch host steps); the rows are all-gathered
  one-process      Engine over deepfuse.compile of the same model (its fused_moe kernel)
  hf               transformers' batched generate on the same weights (the peer)

The model is a Qwen3-MoE of random weights (no checkpoint of this shape ships with the
project): hidden --hidden, --experts experts of which --top-k per token, --layers layers, f32.
Each rank has one torch thread (2 ranks on this machine's 2 cores); one-process and HF have 2.
The workload: --prompts prompts of --prompt-tokens random ids, --tokens greedy output tokens each
(EOS ignored), all added at once. --runs runs alternate the engines after one warm-up; medians
of output tok/s. The tokens of the deepfuse engines are compared with one another. Writes
benchmarks/results/ep_dispatch.json.

    python benchmarks/ep_dispatch.py [--runs 3] [--prompts 16] [--prompt-tokens 128] [--tokens 16]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from results_file import write_result


def make_model(path: str, a: argparse.Namespace) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=4096, hidden_size=a.hidden, intermediate_size=2 * a.hidden, moe_intermediate_size=a.hidden // 2,
        num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4, head_dim=a.hidden // 8,
        num_experts=a.experts, num_experts_per_tok=a.top_k, norm_topk_prob=True,
        max_position_embeddings=1024)).eval().save_pretrained(path)


def timed(generate, prompts, params) -> tuple[float, list[list[int]]]:
    t = time.perf_counter()
    outs = generate(prompts, params)
    wall = time.perf_counter() - t
    bad = [o for o in outs if o.error is not None]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed: {bad[0].error}")
    return wall, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--result", default="ep_dispatch.json")
    a = ap.parse_args()

    import deepfuse
    from deepfuse.models import load_model
    from deepfuse.runtime.distributed import RankOptions, ShardedEngine
    from deepfuse.runtime.engine import Engine
    from deepfuse.runtime.kv_cache import CacheConfig
    from deepfuse.runtime.request import SamplingParams

    path = tempfile.mkdtemp(prefix="ep-bench-")
    make_model(path, a)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 4096, (a.prompt_tokens,), generator=gen).tolist() for _ in range(a.prompts)]
    warm = [torch.randint(0, 4096, (a.prompt_tokens,), generator=gen).tolist() for _ in range(a.prompts)]
    params = [SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)] * a.prompts
    n_out = a.prompts * a.tokens
    cache = dict(block_size=16, num_blocks=1024, max_num_tokens=512, max_num_seqs=64)

    torch.set_num_threads(2)
    model, _ = load_model(path, with_tokenizer=False)
    one = Engine(deepfuse.compile(model), CacheConfig(16, 1024, enable_prefix_caching=False), 512, 64)
    options = RankOptions(with_tokenizer=False, enable_prefix_caching=False, threads=1, **cache)
    ranks = {m: ShardedEngine(path, 2, RankOptions(**{**vars(options), "moe_dispatch": m}))
             for m in ("all_reduce", "all_to_all")}

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def hf_generate(ps, _params):
        with torch.no_grad():
            out = hf.generate(torch.tensor(ps), max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False,
                              attention_mask=torch.ones(len(ps), len(ps[0]), dtype=torch.long), pad_token_id=0)

        class Out:  # RequestOutput's fields timed() reads
            def __init__(self, ids):
                self.error, self.outputs = None, [type("C", (), {"token_ids": ids})()]
        return [Out(row[len(ps[0]):].tolist()) for row in out]

    engines = {"ep2-all_reduce": ranks["all_reduce"].generate, "ep2-all_to_all": ranks["all_to_all"].generate,
               "one-process": one.generate, "hf": hf_generate}
    try:
        for gen_fn in engines.values():
            timed(gen_fn, warm, params)
        walls: dict[str, list[float]] = {k: [] for k in engines}
        tokens: dict[str, list[list[int]]] = {}
        for r in range(a.runs):
            for name, gen_fn in engines.items():
                wall, toks = timed(gen_fn, prompts, params)
                walls[name].append(wall)
                tokens[name] = toks
                print(f"run {r + 1} {name:15s} {n_out / wall:8.1f} out tok/s ({wall:.2f} s)", flush=True)
    finally:
        for e in ranks.values():
            e.close()
    rows = {k: {"output_tps": n_out / statistics.median(w), "wall_s_median": statistics.median(w), "walls": w}
            for k, w in walls.items()}
    same = {k: tokens[k] == tokens["one-process"] for k in engines if k != "one-process"}
    for k, row in rows.items():
        print(f"{k:15s} {row['output_tps']:8.1f} out tok/s   vs hf {row['output_tps'] / rows['hf']['output_tps']:.2f}x"
              f"   vs ep2-all_reduce {row['output_tps'] / rows['ep2-all_reduce']['output_tps']:.2f}x")
    print("same tokens as one-process:", same)
    path_out = write_result(a.result, {"config": vars(a), "engines": rows, "same_tokens_as_one_process": same})
    print("wrote", path_out)


if __name__ == "__main__":
    main()
