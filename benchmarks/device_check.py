"""The sm90 device check (run by device_check.sh): every Triton kernel of a SmolLM2-shaped
and a Mixtral-shaped step on the GPU against the CPU target's torch kernels run on the same
GPU (cuBLAS GEMMs, SDPA attention), timed both ways, with % of the memory bandwidth and of the
bf16 tensor-core rate measured on this GPU at the start (a 2 GiB device-to-device copy, an
8192^3 bf16 matmul on random data), and each launch of a decode step also without the decode
sizing (benchmarks/unsized.py: template GEMM, one-pass attention); then greedy decoding from a
saved-and-loaded sm90 artifact against the CPU
build. One JSON out.

    python benchmarks/device_check.py --out results/device_check.json [--dry-run]

--dry-run: tiny shapes, f32, on the CPU in Triton's interpreter (the caller sets
TRITON_INTERPRET=1), no timing: checks that the script starts and writes its JSON.
The end-to-end run uses SmolLM2 when its GGUF is installed, else a random model of its shape.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from unsized import one_pass_attention, sizing_kernel, strip_sizing  # noqa: E402

import deepfuse  # noqa: E402
from deepfuse.codegen.cpu.kernels import make_kernel  # noqa: E402
from deepfuse.codegen.targets import get_target  # noqa: E402
from deepfuse.codegen.triton import build_plan  # noqa: E402
from deepfuse.codegen.triton.runner import TritonRunner, as_list, launched  # noqa: E402
from deepfuse.compiler import trace_model  # noqa: E402
from deepfuse.models import load_model  # noqa: E402
from deepfuse.passes import PassManager  # noqa: E402
from deepfuse.runtime.batch import SeqChunk, build_step  # noqa: E402
from deepfuse.runtime.kv_cache import CacheConfig, KVCache  # noqa: E402

CEILINGS = {"hbm_bytes_s": 4.8e12, "bf16_flops": 989e12}  # H200 datasheet until measured (main)


def measure_ceilings() -> dict:
    """This GPU's memory bandwidth (a 2 GiB device-to-device copy, bytes read plus written) and
    bf16 matmul rate (8192^3 on random data), medians of do_bench."""
    import triton.testing

    src = torch.randn(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    src = dst = None  # freed before the matmul's operands
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_ms = triton.testing.do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return {"hbm_bytes_s": 2 * 2**31 / (copy_ms * 1e-3), "bf16_flops": 2 * 8192**3 / (mm_ms * 1e-3)}


def random_model(kind: str, dry: bool):
    """A random-weight checkpoint written by transformers: SmolLM2's shape (2 layers) or a
    Mixtral-shaped MoE; tiny versions for the dry run."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "smollm2":
        cfg = tf.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                             rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
        if dry:
            cfg = tf.LlamaConfig(vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                                 tie_word_embeddings=True)
        hf = tf.LlamaForCausalLM(cfg)
    else:
        size = dict(hidden_size=64, intermediate_size=64, num_local_experts=4) if dry else \
            dict(hidden_size=1024, intermediate_size=1024, num_local_experts=16)
        hf = tf.MixtralForCausalLM(tf.MixtralConfig(vocab_size=256 if dry else 32000, num_hidden_layers=2,
                                                    num_attention_heads=8 if not dry else 4, num_key_value_heads=2,
                                                    num_experts_per_tok=2, max_position_embeddings=4096, **size))
    path = tempfile.mkdtemp(prefix=f"devcheck-{kind}-")
    hf.save_pretrained(path)
    return load_model(path, with_tokenizer=False)[0]


def step(config, dtype, device, prefill: int, decodes: int, position: int):
    """One step: a prefill chunk (if prefill > 0) and `decodes` one-token sequences at `position`."""
    blocks = 2 + (max(prefill, position) + 20) // 16
    cache = KVCache(config.num_layers, config.num_kv_heads, config.head_dim, dtype,
                    CacheConfig(block_size=16, num_blocks=blocks * (decodes + 1)))
    torch.manual_seed(1)
    for t in cache.layers:
        t.normal_()
    chunks = [SeqChunk(list(range(1, prefill + 1)), 0, list(range(blocks)))] if prefill else []
    chunks += [SeqChunk([7], position, list(range(blocks * (s + 1), blocks * (s + 2)))) for s in range(decodes)]
    inputs = build_step(chunks, cache)
    return {k: v.to(device) for k, v in inputs.items()}


def bench(fn, dry: bool) -> float | None:
    if dry:
        return None
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1000  # us


def cost(p: dict, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> tuple[int, int]:
    """(bytes read and written, GEMM flops) of one launch; attention reads only each
    sequence's cached rows, not the whole cache, and an embedding only the rows it gathers."""
    size = lambda t: t.numel() * t.element_size()
    if p["op"] == "qkv_attention":
        qkv, cache, seq_lens = ins[0], ins[2], ins[5]
        row = 2 * cache.shape[3] * cache.shape[4] * cache.element_size()
        return size(qkv) + int(seq_lens.sum()) * row + sum(size(o) for o in outs), 0
    if p["op"] == "embedding":  # the gathered rows, not the whole table
        return 2 * size(outs[0]) + size(ins[1]), 0
    nbytes = sum(size(t) for t in ins + outs if isinstance(t, torch.Tensor))
    flops = 0
    if p["op"] in ("linear", "logits", "rms_norm_linear", "add_rms_norm_linear", "swiglu_linear"):
        w = ins[{"add_rms_norm_linear": 3, "rms_norm_linear": 2}.get(p["op"], 1)]
        flops = 2 * outs[-1].shape[0] * w.shape[0] * w.shape[1]
    elif p["op"] == "fused_moe":
        w13, w2, top = ins[2], ins[3], p["attrs"]["top_k"] + p["attrs"].get("num_shared", 0)
        flops = 2 * ins[0].shape[0] * top * (w13.shape[1] * w13.shape[2] + w2.shape[1] * w2.shape[2])
    return nbytes, flops


def on(device, xs):
    return [x.to(device) if isinstance(x, torch.Tensor) else x for x in xs]


def failure(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:400]


def run_peer(peer, ins: list, device) -> tuple[list, str | None]:
    """The CPU target's kernel on the GPU's tensors; where it fails there, on CPU copies (the
    error is kept: its timing is then missing, not the comparison)."""
    try:
        return as_list(peer(*ins)), None
    except Exception as e:
        return on(device, as_list(peer(*on("cpu", ins)))), failure(e)


def check_kernels(model, dtype: str, device, dry: bool, steps: dict) -> list[dict]:
    """One row per distinct (step, op, kernels): the Triton launch against the CPU target's kernel
    on the same inputs. A launch that raises is a row with its error (the step goes on with the
    peer's outputs), so one run reports every kernel."""
    g, _ = PassManager(get_target("sm90").pipeline()).run(trace_model(model, dtype))
    arch = "interpret" if dry else "sm90"
    runner = TritonRunner(build_plan(g, arch), g.weights)
    with one_pass_attention():
        unsized = TritonRunner(build_plan(g, arch), g.weights)
    strip_sizing(unsized)
    plan = runner.plan
    rows, seen = [], set()
    for step_name, inputs in steps.items():
        env = list(runner.base)
        for name, s in plan["inputs"].items():
            env[s] = inputs[name]
        for (p, kernels, _), (_, kernels_u, _) in zip(runner.launches, unsized.launches):
            ins = [env[i] for i in p["in"]]
            peer = make_kernel(p["op"], p["attrs"])
            want, peer_error = run_peer(peer, ins, device)
            outs = want
            names = [spec["name"] for spec, _ in kernels]
            key = (step_name, p["op"], tuple(names))
            if kernels and key not in seen:
                seen.add(key)
                row = {"step": step_name, "op": p["op"], "kernels": names, "peer_error": peer_error}
                try:
                    got = runner._run(p, kernels, ins)
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                except Exception as e:
                    rows.append({**row, "error": failure(e), "max_rel_err": float("inf")})
                    continue
                if p["op"] in ("sample", "spec_verify"):  # integer outputs: the fraction that differ
                    err = float((got[0] != want[0]).float().mean())
                else:
                    err = max(float((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-6))
                              for a, b in zip(got, want) if a.is_floating_point())
                t_tri = bench(lambda p=p, kernels=kernels, ins=ins: runner._run(p, kernels, ins), dry)
                t_peer = None if peer_error else bench(lambda peer=peer, ins=ins: peer(*ins), dry)
                nbytes, flops = cost(p, ins, got)
                if any(sizing_kernel(spec) and launched(spec, ins) for spec, _ in kernels):  # time it without the sizing
                    try:
                        got_u = unsized._run(p, kernels_u, ins)
                        row["unsized_rel_err"] = max(float((a.float() - b.float()).abs().max() / (b.float().abs().max()
                                                     + 1e-6)) for a, b in zip(got_u, want) if a.is_floating_point())
                        row["unsized_us"] = bench(lambda p=p, k=kernels_u, ins=ins: unsized._run(p, k, ins), dry)
                    except Exception as e:
                        row["unsized_error"] = failure(e)
                rows.append({**row, "max_rel_err": err, "triton_us": t_tri, "torch_us": t_peer,
                             "speedup_vs_torch": t_peer / t_tri if t_tri and t_peer else None,
                             "pct_hbm": 100 * nbytes / (t_tri * 1e-6) / CEILINGS["hbm_bytes_s"] if t_tri else None,
                             "pct_bf16_tc": 100 * flops / (t_tri * 1e-6) / CEILINGS["bf16_flops"] if t_tri and flops
                             else None})
                outs = got
            for s, t in zip(p["out"], outs):
                env[s] = t
    return rows


def end_to_end(dry: bool, device) -> dict:
    from deepfuse.models import smollm2_gguf_path
    from tests.helpers import greedy_with

    try:
        if dry:  # the interpreter runs 30 layers of the real model far too slowly
            raise FileNotFoundError
        smollm2_gguf_path()
        model, which = load_model("smollm2", with_tokenizer=False)[0], "SmolLM2-135M-Instruct (GGUF)"
    except Exception:
        model, which = random_model("smollm2", dry), "random weights, SmolLM2 shape, 2 layers"
    dtype = "f32"
    cpu = deepfuse.compile(model, dtype=dtype)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        art = deepfuse.compile(model, target="sm90", dtype=dtype)
        compile_s = time.perf_counter() - t
        loaded = deepfuse.load(art.save(d))
    prompt = [t % model.config.vocab_size for t in (1, 504, 3458, 282, 4649, 314, 4760, 30)]
    n = 4 if dry else 32
    want, first_cpu = greedy_with(cpu, model.config, prompt, n, block_size=16)
    got, first_gpu = greedy_with(loaded, model.config, prompt, n, block_size=16)
    first_diff = float((first_gpu.float().cpu() - first_cpu.float()).abs().max() / first_cpu.float().abs().max())
    # "cubin" on an sm_90 GPU: the artifact's own binaries; "interpret" in the dry run
    result = {"model": which, "dtype": dtype, "tokens": n, "sm90_compile_s": compile_s, "cpu_tokens": want,
              "sm90_tokens": got, "first_logits_rel_diff": first_diff, "equal": got == want,
              "kernel_source": loaded.runner.kernel_source, "cache_device": str(loaded.device)}
    try:  # the runtime's engine: several requests batched, continuous batching over the artifact
        result["engine"] = engine_check(cpu, loaded, model.config.vocab_size, dry)
    except Exception as e:
        traceback.print_exc()
        result["engine"] = {"equal": False, "error": failure(e)}
    return result


def engine_check(cpu, loaded, vocab: int, dry: bool) -> dict:
    """The same greedy requests through Engine on the CPU build and on the loaded artifact."""
    from deepfuse import SamplingParams
    from deepfuse.runtime.engine import Engine

    n = 3 if dry else 6
    prompts = [[(7 * i + 13 * j + 1) % vocab for j in range(5 + 9 * i)] for i in range(n)]
    params = [SamplingParams(max_tokens=4 if dry else 12, temperature=0, ignore_eos=True)] * n
    outs = {}
    for name, m in (("cpu", cpu), ("sm90", loaded)):
        t = time.perf_counter()
        res = Engine(m, CacheConfig(block_size=16, num_blocks=128), max_num_tokens=64, max_num_seqs=4).generate(
            prompts, params, use_tqdm=False)
        outs[name] = ([r.outputs[0].token_ids for r in res], time.perf_counter() - t)
    return {"requests": n, "equal": outs["cpu"][0] == outs["sm90"][0], "cpu_tokens": outs["cpu"][0],
            "sm90_tokens": outs["sm90"][0], "cpu_s": outs["cpu"][1], "sm90_s": outs["sm90"][1]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results/device_check.json")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    dry = args.dry_run
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("--dry-run needs TRITON_INTERPRET=1 (device_check.sh sets it)")
    device = torch.device("cpu" if dry else "cuda")
    if not dry and not torch.cuda.is_available():
        sys.exit("no CUDA device visible: run with --dry-run on a CPU machine")
    t0 = time.perf_counter()
    dtype = "f32" if dry else "bf16"
    tdt = torch.float32 if dry else torch.bfloat16
    result = {"device": "cpu (Triton interpreter, dry run)" if dry else torch.cuda.get_device_name(),
              "torch": torch.__version__, "dtype": dtype, "kernels": [], "complete": False}
    import triton

    result["triton"] = triton.__version__
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)

    def save():  # after every stage: a run stopped by its time limit still leaves what it measured
        result["seconds"] = time.perf_counter() - t0
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["errors"] = []
    if not dry:
        CEILINGS.update(measure_ceilings())
    result["ceilings"] = dict(CEILINGS, measured=not dry)
    print(f"ceilings: {CEILINGS['hbm_bytes_s'] / 1e12:.2f} TB/s copy, {CEILINGS['bf16_flops'] / 1e12:.0f} TFLOP/s "
          f"bf16 matmul{' (measured)' if not dry else ''}", flush=True)
    for kind in ("smollm2", "mixtral"):
        try:
            model = random_model(kind, dry)
            pos, decodes, prefill, mixed, far = (20, 2, 20, 1, 40) if dry else (200, 64, 512, 8, 2048)
            steps = {f"decode x{decodes}": step(model.config, tdt, device, 0, decodes, pos),
                     f"prefill {prefill} + decode x{mixed}": step(model.config, tdt, device, prefill, mixed, pos)}
            if kind == "smollm2":  # decode attention at 2k keys (the bandwidth goal's context)
                steps[f"decode x{decodes} at {far}"] = step(model.config, tdt, device, 0, decodes, far)
            else:  # the grouped MoE GEMMs at 4k tokens (the tensor-core goal's size)
                steps[f"prefill {far * 2}"] = step(model.config, tdt, device, far * 2, 0, 0)
            result["kernels"] += [{"model": kind, **r} for r in check_kernels(model, dtype, device, dry, steps)]
        except Exception as e:
            traceback.print_exc()
            result["errors"].append(f"{kind} kernels: {failure(e)}")
        save()
    try:
        result["end_to_end"] = end_to_end(dry, device)
    except Exception as e:
        traceback.print_exc()
        result["errors"].append(f"end to end: {failure(e)}")
        result["end_to_end"] = {"equal": False, "error": failure(e)}
    bad = [r for r in result["kernels"] if r["max_rel_err"] > (1e-4 if dry else 3e-2)]
    result["ok"] = not bad and not result["errors"] and result["end_to_end"]["equal"] \
        and result["end_to_end"].get("engine", {}).get("equal", False)
    result["complete"] = True
    save()
    print(f"{'model':8s} {'step':24s} {'op':20s} {'rel err':>9s} {'triton us':>10s} {'torch us':>9s} "
          f"{'x torch':>8s} {'%HBM':>6s} {'%TC':>6s} {'unsized us':>10s}")
    for r in result["kernels"]:
        f = lambda v, spec: "-" if v is None else format(v, spec)
        for what in ("error", "peer_error"):
            if r.get(what):
                print(f"{r['model']:8s} {r['step']:24s} {r['op']:20s} {what}: {r[what]}")
        print(f"{r['model']:8s} {r['step']:24s} {r['op']:20s} {r['max_rel_err']:9.2e} {f(r.get('triton_us'), '10.1f')} "
              f"{f(r.get('torch_us'), '9.1f')} {f(r.get('speedup_vs_torch'), '8.2f')} {f(r.get('pct_hbm'), '6.1f')} "
              f"{f(r.get('pct_bf16_tc'), '6.1f')} {f(r.get('unsized_us'), '10.1f')}")
    for line in result["errors"]:
        print("error:", line)
    e = result["end_to_end"]
    if "error" in e:
        sys.exit(1)
    g = e["engine"]
    print(f"engine, {g.get('requests')} greedy requests batched: sm90 artifact "
          f"{'equal to' if g['equal'] else 'DIFFER from'} the CPU build {g.get('error', '')}")
    print(f"end to end ({e['model']}, {e['dtype']}, kernels: {e['kernel_source']}): sm90 artifact greedy "
          f"{e['tokens']} tokens "
          f"{'equal to' if e['equal'] else 'DIFFER from'} the CPU build; {result['seconds']:.0f} s; wrote {args.out}")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
