"""Decode steps as CUDA graphs on one NVIDIA GPU: the engine's decode step time at 1, 16 and 64
sequences, on random weights of SmolLM2-135M's shape (bf16, the sm90/sm100 build for the GPU):
  eager        no graphs
  graphed      runtime/graphed_decode.py
  overlapped   graphed, Engine(overlap=True) (runtime/overlap.py: each step() launches the next
               decode step before reading the last one's tokens)
  unsized      graphed, without the decode kernels' sizing (benchmarks/unsized.py: template GEMMs
               and one-pass attention at every batch)
  invariant    graphed, compile(batch_invariant=True) (split-K GEMMs and one-pass attention at
               every batch)
It checks itself and raises where it fails: each batch's tokens (half greedy, half seeded
sampled requests) must be the same in the first three, and one graphed and one eager decode
step must run under torch.cuda.set_sync_debug_mode("error") (no host wait inside a step).

    python benchmarks/gpu_graphs.py [--steps 32] [--out FILE] [--dry-run]

--dry-run: a 2-layer toy in Triton's CPU interpreter (start it with TRITON_INTERPRET=1), batches
of 1 and 3 (bucket 4: padded), 3 decode steps each; the graphed engine runs its padded buckets
without capture (no GPU), and the sync check is skipped. Checks that the script runs (CI does).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from gpu_throughput import refuse_wrong_machine, smollm2_shaped  # noqa: E402
from unsized import one_pass_attention, strip_sizing  # noqa: E402


def requests(n: int, vocab: int, steps: int, seed: int):
    """n prompts of 16 tokens; even requests greedy, odd ones seeded sampled; steps + 1 tokens each."""
    from deepfuse import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(16)] for _ in range(n)]
    params = [SamplingParams(max_tokens=steps + 1, ignore_eos=True, **(dict(temperature=0.0) if i % 2 == 0 else
                                                                       dict(temperature=0.8, top_p=0.95, seed=seed + i)))
              for i in range(n)]
    return prompts, params


def decode_run(engine, n: int, steps: int, seed: int) -> tuple[list[float], list[list[int]]]:
    """(seconds of each decode step, every request's tokens): n requests prefilled in one step,
    then `steps` steps in which all n decode."""
    prompts, params = requests(n, engine.model.config.vocab_size, steps, seed)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done, times = {}, []
    for out in engine.step():  # the prefill (and first token)
        done[out.request_id] = out
    while engine.has_unfinished():
        t = time.perf_counter()
        finished = engine.step()
        times.append(time.perf_counter() - t)
        done.update((o.request_id, o) for o in finished)
    return times, [done[i].outputs[0].token_ids for i in ids]


@contextlib.contextmanager
def sync_errors(enabled: bool):
    """torch.cuda.set_sync_debug_mode("error") inside (a no-op without a GPU)."""
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def sync_check(engines: dict, on_gpu: bool) -> dict:
    """One graphed and one eager decode step of 4 sequences with every host wait an error: the
    model call only (the engine's own read of the tokens comes after it)."""
    if not on_gpu:
        return {"skipped": "no GPU (the tests trap host reads in the interpreter instead)"}
    from deepfuse.runtime.batch import SeqChunk

    out = {}
    for name, eng in engines.items():
        seqs = [eng.kv.new_seq([]) for _ in range(4)]
        for s in seqs:
            eng.kv.allocate(s, [], 9)
        chunks = [SeqChunk([5 + i], 8, s.table, temperature=0.8 * (i % 2), seed=i) for i, s in enumerate(seqs)]
        try:
            torch.cuda.synchronize()
            with sync_errors(True):
                eng.forward(chunks)  # graphed: a replay; eager: the staged inputs and every launch
            torch.cuda.synchronize()
            out[name] = "ok"
        except RuntimeError as e:
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            for s in seqs:
                eng.kv.free(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "gpu_graphs.json"))
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dry = args.dry_run
    refuse_wrong_machine(dry)
    import deepfuse
    from deepfuse.codegen.triton.runner import gpu_arch
    from deepfuse.models import load_model
    from deepfuse.runtime.engine import Engine
    from deepfuse.runtime.kv_cache import CacheConfig

    target = "sm90" if dry else gpu_arch()
    if target is None:
        sys.exit(f"{torch.cuda.get_device_name()} is neither sm_90 nor sm_100")
    dtype = "f32" if dry else "bf16"
    batches, steps, max_seqs = ([1, 3], 3, 4) if dry else ([1, 16, 64], args.steps, 64)
    with tempfile.TemporaryDirectory() as path:
        smollm2_shaped(path, dry)
        model = load_model(path, with_tokenizer=False)[0]
    art = deepfuse.compile(model, target=target, dtype=dtype)
    with one_pass_attention():  # the same model without the decode sizing, for its A/B
        unsized = deepfuse.compile(model, target=target, dtype=dtype)
    dropped = strip_sizing(unsized.runner)
    invariant = deepfuse.compile(model, target=target, dtype=dtype, batch_invariant=True)
    engines, build_s = {}, {}
    for name, graphs, overlap, a in (("eager", False, False, art), ("graphed", True, False, art),
                                     ("overlapped", True, True, art), ("unsized", True, False, unsized),
                                     ("invariant", True, False, invariant)):
        t = time.perf_counter()
        engines[name] = Engine(a, CacheConfig(num_blocks=1024, enable_prefix_caching=False), max_num_tokens=1024,
                               max_num_seqs=max_seqs, cuda_graphs=graphs, overlap=overlap)
        build_s[name] = time.perf_counter() - t  # the graphed engine's includes warm-up and capture
        decode_run(engines[name], 2, 2, seed=99)  # untimed: first launches
    captured = sorted(engines["graphed"].graphed.graphs)
    results, ok = {}, True
    device = "cpu (Triton interpreter, dry run)" if dry else torch.cuda.get_device_name()

    def save(**more) -> None:
        """The figures so far (complete: false until the last batch and the sync check are in), so a
        run stopped by its time limit still leaves what it measured."""
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"device": device, "torch": torch.__version__, "target": target, "dtype": dtype,
                       "kernel_source": art.runner.kernel_source, "captured_buckets": captured,
                       "engine_build_s": build_s, "unsized_kernels_dropped": dropped, "batches": results,
                       "complete": False, **more}, f, indent=1)

    save()
    for n in batches:
        runs = {name: decode_run(eng, n, steps, seed=n) for name, eng in engines.items()}
        (eager_t, eager_tok), (graph_t, graph_tok), (over_t, over_tok), (un_t, un_tok), (inv_t, _) = \
            (runs[k] for k in engines)
        equal = eager_tok == graph_tok == over_tok
        ok &= equal
        e_ms, g_ms, o_ms, u_ms, i_ms = (statistics.median(t) * 1000 for t in (eager_t, graph_t, over_t, un_t, inv_t))
        results[str(n)] = {"eager_ms": e_ms, "graphed_ms": g_ms, "speedup": e_ms / g_ms, "overlapped_ms": o_ms,
                           "overlap_speedup": g_ms / o_ms, "unsized_graphed_ms": u_ms, "sizing_speedup": u_ms / g_ms,
                           "invariant_graphed_ms": i_ms, "invariant_cost": i_ms / g_ms,
                           "decode_steps": len(graph_t), "bucket": engines["graphed"].graphed.bucket(n),
                           "tokens_equal": equal, "unsized_tokens_equal": un_tok == graph_tok}
        print(f"{n:3d} sequences: decode step {e_ms:8.2f} ms eager, {g_ms:8.2f} ms graphed ({e_ms / g_ms:.2f}x), "
              f"{o_ms:8.2f} ms graphed and overlapped ({g_ms / o_ms:.2f}x), tokens {'equal' if equal else 'DIFFER'}; "
              f"without the decode sizing {u_ms:8.2f} ms graphed (sizing {u_ms / g_ms:.2f}x, tokens "
              f"{'equal' if un_tok == graph_tok else 'differ'}); batch-invariant build {i_ms:8.2f} ms graphed "
              f"({i_ms / g_ms:.2f}x the sized)", flush=True)
        save()
    ok &= engines["overlapped"].stats.ahead_steps > 0
    syncs = sync_check({k: engines[k] for k in ("eager", "graphed")}, not dry)
    ok &= all(v == "ok" for v in syncs.values()) if "skipped" not in syncs else True
    print(f"{device}, {target} {dtype}, {model.config.num_layers} layers; graphs captured for {captured or 'none'} "
          f"(engine built in {build_s['graphed']:.1f} s with them, {build_s['eager']:.1f} s without); sync check: {syncs}")
    save(complete=True, sync_check=syncs, ok=ok)
    if not ok:
        sys.exit("gpu_graphs: the graphed or overlapped steps' tokens differ from the eager ones, no step went "
                 "ahead, or a step waited for the GPU")


if __name__ == "__main__":
    main()
