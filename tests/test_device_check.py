"""benchmarks/device_check.sh --dry-run: the GPU check's script starts, runs every kernel kind
in Triton's interpreter against the CPU kernels, and writes its JSON."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_device_check_dry_run_writes_its_json(tmp_path):
    out = tmp_path / "device_check.json"
    r = subprocess.run([os.path.join(ROOT, "benchmarks", "device_check.sh"), "--dry-run", "--out", str(out)],
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["complete"] and result["end_to_end"]["equal"]
    assert result["end_to_end"]["kernel_source"] == "interpret"
    ops = {(k["model"], k["op"]) for k in result["kernels"]}
    assert ("smollm2", "qkv_attention") in ops and ("mixtral", "fused_moe") in ops
    assert all(k["max_rel_err"] < 1e-4 for k in result["kernels"])
    # the decode step's sized launches (split-K GEMMs, split-KV attention) also ran without the sizing
    unsized = {(k["model"], k["op"]) for k in result["kernels"] if "unsized_rel_err" in k}
    assert ("smollm2", "qkv_attention") in unsized and ("smollm2", "logits") in unsized, unsized
    assert all(k["unsized_rel_err"] < 1e-4 for k in result["kernels"] if "unsized_rel_err" in k)
    steps = {(k["model"], k["step"]) for k in result["kernels"]}
    assert ("smollm2", "decode x2 at 40") in steps and ("mixtral", "prefill 80") in steps


def test_device_check_refuses_unknown_arguments():
    r = subprocess.run([os.path.join(ROOT, "benchmarks", "device_check.sh"), "--fast"], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "unknown argument: --fast" in r.stderr


def test_gpu_throughput_dry_run_writes_both_engines(tmp_path):
    """benchmarks/gpu_throughput.py --dry-run: the sm90 build through Engine (Triton's interpreter)
    and HF's generate, 4 requests of 8 tokens, each engine's every token counted."""
    out = tmp_path / "gpu_throughput.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_throughput.py"), "--dry-run", "--out",
                        str(out)], capture_output=True, text=True, timeout=400, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["kernel_source"] == "interpret" and result["complete"] and \
        set(result["results"]) == {"deepfuse sm90 f32", "deepfuse sm90 overlap", "HF f32 batched"}
    assert all(e["output_tokens"] == 4 * 8 and e["output_tps"] > 0 for e in result["results"].values())


def test_gpu_kernel_times_dry_run_lists_every_launch_kind(tmp_path):
    """benchmarks/gpu_kernel_times.py --dry-run: a 2-layer step's launches, grouped by kernel, in the interpreter."""
    out = tmp_path / "times.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_kernel_times.py"), "--dry-run", "--out",
                        str(out)], capture_output=True, text=True, timeout=400, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert result["complete"] and len(steps) == 2
    for rows in steps.values():
        ops = {key.split()[0] for key in rows}
        assert {"qkv_attention", "add_rms_norm_linear", "swiglu_linear", "logits", "sample"} <= ops
        assert sum(r["launches_per_step"] for k, r in rows.items() if k.startswith("qkv_attention")) == 2  # 2 layers


def test_gpu_graphs_dry_run_compares_the_padded_buckets_with_eager_steps(tmp_path):
    """benchmarks/gpu_graphs.py --dry-run: decode steps of 1 and 3 sequences (bucket 4) through an
    eager, a bucketed and a bucketed overlapped engine (no capture without a GPU), the same tokens
    in all three; and a bucketed engine without the decode sizing."""
    out = tmp_path / "gpu_graphs.json"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "gpu_graphs.py"), "--dry-run", "--out",
                        str(out)], capture_output=True, text=True, timeout=400, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["complete"] and result["captured_buckets"] == [] and "skipped" in result["sync_check"]
    assert {n: (b["bucket"], b["tokens_equal"], b["decode_steps"]) for n, b in result["batches"].items()} == \
        {"1": (1, True, 3), "3": (4, True, 3)}
    assert all(b["overlapped_ms"] > 0 and b["unsized_graphed_ms"] > 0 and b["invariant_graphed_ms"] > 0
               for b in result["batches"].values())
    assert result["unsized_kernels_dropped"] > 0


def test_gpu_checks_dry_run_runs_every_check_and_logs_with_times(tmp_path):
    """benchmarks/gpu_checks.sh OUTDIR --dry-run: the four GPU scripts' dry runs in one call, their
    JSON and one time-stamped log in OUTDIR; bad arguments exit 2 before anything runs."""
    script = os.path.join(ROOT, "benchmarks", "gpu_checks.sh")
    r = subprocess.run([script, str(tmp_path), "--dry-run"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:]
    assert {p.name for p in tmp_path.iterdir()} == {"device_check.json", "gpu_graphs.json", "gpu_kernel_times.json",
                                                     "gpu_throughput.json", "checks.log"}
    log = (tmp_path / "checks.log").read_text().splitlines()
    assert [line.split(" ", 1)[1] for line in log if "== " in line] == ["== device check", "== cuda graphs",
                                                                         "== throughput", "== kernel times",
                                                                         "== done, exit 0"]
    assert all(line[2] == ":" and line[5] == ":" for line in log)
    for args in ([], ["--fast"], [str(tmp_path), "--fast"]):
        r = subprocess.run([script, *args], capture_output=True, text=True)
        assert r.returncode == 2 and ("usage" in r.stderr or "unknown argument: --fast" in r.stderr)
