"""What the fusion pipeline buys on CPU, one run: kernels per decode step and decode-step time
with fusion on vs off, for SmolLM2 and a random-weight Qwen3-MoE (built from transformers'
config class); the MoE model's step with fused_moe vs with moe's dense decomposition;
SmolLM2's cold compile time and artifact load time. Writes benchmarks/results/fusion.json.

    python benchmarks/fusion.py [--tokens 32] [--runs 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from results_file import write_result


def moe_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from deepfuse.models import load_model

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                         num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                         num_experts=16, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=2048)
    path = tempfile.mkdtemp(prefix="qwen3moe-")
    Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return load_model(path, with_tokenizer=False)[0]


def compile_variant(model, variant: str):
    """on: full pipeline; off: cleanup only; decomposed: full pipeline, moe ops decomposed (dense)."""
    import deepfuse
    from deepfuse.codegen.artifact import CompiledModel
    from deepfuse.codegen.targets import get_target
    from deepfuse.compiler import trace_model
    from deepfuse.ir import OPS
    from deepfuse.passes import Pass, PassManager
    from deepfuse.passes.decompose import decompose_unsupported

    if variant in ("on", "off"):
        return deepfuse.compile(model, fuse=variant == "on")
    tgt = get_target("cpu")
    passes = tgt.pipeline(True)[:-1] + [Pass("decompose_moe", decompose_unsupported(set(OPS) - {"moe", "fused_moe"}))]
    graph, _ = PassManager(passes).run(trace_model(model))
    plan = tgt.build(graph)
    return CompiledModel(graph, plan, "cpu", "f32", model.config, None, tgt.runner(plan, graph.weights))


def decode_step_ms(art, tokens: int, runs: int) -> float:
    from deepfuse.runtime.engine import Engine, SamplingParams

    eng = Engine(art)
    prompt = list(range(10, 74))
    p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    eng.generate([prompt], [SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)])
    times = []
    for _ in range(runs):
        out = eng.generate([prompt], [p])[0]
        times.append((out.outputs[0].token_times[-1] - out.outputs[0].token_times[0]) / (tokens - 1) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    import deepfuse
    from deepfuse.models import load_model

    results: dict = {}
    t = time.perf_counter()
    smol, tok = load_model("smollm2")
    load_weights_s = time.perf_counter() - t
    t = time.perf_counter()
    art = deepfuse.compile(smol, tokenizer=tok)
    compile_s = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as d:
        art.save(d)
        t = time.perf_counter()
        deepfuse.load(d)
        load_s = time.perf_counter() - t
    results["smollm2 compile"] = {"gguf_read_s": load_weights_s, "compile_s": compile_s, "artifact_load_s": load_s}
    models = {"smollm2": smol, "qwen3-moe (random, 8 layers, 16 experts, top-2)": moe_model()}
    for name, model in models.items():
        row = {}
        for variant in ("off", "on") + (("decomposed",) if model.config.num_experts else ()):
            a = compile_variant(model, variant)
            row[variant] = {"kernels_per_step": len(a.plan["launches"]),
                            "decode_step_ms": decode_step_ms(a, args.tokens, args.runs)}
        results[name] = row
    c = results["smollm2 compile"]
    print(f"\nSmolLM2 cold compile (trace + passes + CPU codegen): {c['compile_s']:.2f} s; artifact load: "
          f"{c['artifact_load_s']:.2f} s; GGUF read + dequantize: {c['gguf_read_s']:.2f} s")
    print(f"\n{'model':48s} {'variant':11s} {'kernels/step':>12s} {'decode step':>12s}")
    for name, row in results.items():
        if name == "smollm2 compile":
            continue
        for variant, r in row.items():
            print(f"{name:48s} {variant:11s} {r['kernels_per_step']:12d} {r['decode_step_ms']:10.2f}ms")
        on, off = row["on"], row["off"]
        print(f"{'':48s} fusion: kernels {off['kernels_per_step'] / on['kernels_per_step']:.2f}x fewer, "
              f"step {off['decode_step_ms'] / on['decode_step_ms']:.2f}x faster")
        if "decomposed" in row:
            print(f"{'':48s} fused_moe vs dense decomposition: "
                  f"{row['decomposed']['decode_step_ms'] / on['decode_step_ms']:.2f}x faster")
    write_result("fusion.json", {"tokens": args.tokens, "runs": args.runs, "results": results})


if __name__ == "__main__":
    main()
