"""Decode kernels sized for their shapes, checked without a GPU (benchmarks/kernel_sizing.py):
SmolLM2's and the device check's Mixtral shape compiled for sm90 and sm100; the new kernels
use the tensor cores, spill nothing (ptxas -v) and read every operand in 16-byte vectors, and
at 64 sequences each decode GEMM, the split-KV attention and the MoE GEMMs of 16-row blocks
start at least one CTA per SM."""
import json
import os
import subprocess
import sys

import pytest

from deepfuse.codegen.triton.occupancy import ptx_loads, scalar_loads

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MMA = {"sm90": "wgmma", "sm100": "tcgen05"}


def new_kernel(name: str) -> bool:
    return name.endswith(("_decode", "_split", "_small")) or name.startswith("reduce_")


def moe_part(name: str) -> str | None:
    """fused_moe's decode-set kernel kind (route, align, up, down; the combine: None)."""
    part = name.rsplit("_", 2)[-2]
    return part if name.endswith("_small") and part in ("route", "align", "up", "down") else None


def expected_mma(name: str, arch: str) -> str | None:
    """The MoE decode set's GEMMs (and the router's) take 16-row tiles, an mma.sync shape;
    its sort and combine, and the reduces, have no dot."""
    if name.endswith("_small"):
        return "mma.sync" if moe_part(name) in ("route", "up", "down") else None
    return None if name.startswith("reduce_") else MMA[arch]


@pytest.fixture(scope="module")
def sizing(tmp_path_factory):
    out = tmp_path_factory.mktemp("sizing") / "kernel_sizing.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it compiles for the GPUs
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "kernel_sizing.py"), "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| qkv_attention |" in r.stdout and "spill st/ld" in r.stdout  # the tables are printed
    return json.loads(out.read_text())


def test_the_load_census_sees_scalar_and_vector_loads():
    ptx = """ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p1 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
    ld.global.nc.b8 { %rs2 }, [ %rd2 + 0 ];
    ld.global.b64 { %rd5 }, [ %rd3 + 0 ];
    cp.async.cg.shared.global [ %r15 + 0 ], [ %rd7 + 0 ], 0x10, %r16;
    cp.async.ca.shared.global [ %r17 + 0 ], [ %rd8 + 0 ], 4, %r18;
    wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"""
    found = ptx_loads(ptx)
    assert found["mma"] == "wgmma"
    assert found["loads"] == {"ld.global.v4.b32": 1, "ld.global.b16": 1, "ld.global.b8": 1, "ld.global.b64": 1,
                              "cp.async.16": 1, "cp.async.4": 1}
    assert scalar_loads(found["loads"]) == 2


def test_new_kernels_use_the_tensor_cores_and_spill_nothing(sizing):
    for arch, models in sizing["results"].items():
        for r in models.values():
            new = {n: k for n, k in r["kernels"].items() if new_kernel(n)}
            assert sum(n.endswith("_decode") for n in new) >= 3 and any(n.endswith("_split") for n in new)
            for name, k in new.items():
                assert k["spill_stores"] == k["spill_loads"] == k["stack"] == 0, (arch, name, k)
                assert k["registers"] <= 255, (arch, name, k)
                assert k["mma"] == expected_mma(name, arch), (arch, name, k["mma"])


def test_new_kernels_read_every_operand_in_vectors(sizing):
    """Element data (bf16 tiles, f32 partials) arrives in 16-byte loads or 16-byte async copies;
    the only scalar loads left are 64-bit indices (lengths, block-table entries, sampled rows),
    in the attention reduce each row's f32 max and sum, and in the MoE decode set 32-bit ids and
    routing weights (its sort reads nothing else)."""
    for arch, models in sizing["results"].items():
        for r in models.values():
            for name, k in r["kernels"].items():
                if not new_kernel(name):
                    continue
                loads = k["loads"]
                vector = {i for i in loads if i.startswith(("ld.global.v4", "ld.global.v2")) or i == "cp.async.16"}
                assert vector or moe_part(name) == "align", (arch, name, loads)  # (the sort reads only ids)
                scalar = set(loads) - vector - {"ld.global.b64"}
                # the attention reduce's row max and sum; the MoE kernels' i32 row and expert ids
                # and f32 routing weights (one per row, gathered)
                allowed = {"ld.global.b32"} if name.startswith("reduce_qkv_attention") or name.endswith("_small") \
                    else set()
                assert scalar <= allowed, (arch, name, loads)
            # the one-pass (prefill) attention reads V through its own pointer too: no element loads
            (one_pass,) = [k for n, k in r["kernels"].items() if n.startswith("qkv_attention_") and n.count("_") == 2]
            assert scalar_loads(one_pass["loads"]) == 0 and one_pass["mma"] == MMA[arch], one_pass


def test_decode_gemms_and_attention_fill_the_sms_at_64_sequences(sizing):
    for arch, models in sizing["results"].items():
        sms = sizing["sms"][arch]
        for kind, r in models.items():
            rows = r["launches"]["64"]
            gemms = [x for x in rows if x["op"] in sizing["gemm_ops"] and x["kernel"].endswith("_decode")]
            assert len(gemms) >= 3, (arch, kind)
            for x in gemms:
                assert x["ctas"] >= sms, (arch, kind, x)
            (split,) = [x for x in rows if x["kernel"].endswith("_split")]
            assert split["working"] >= sms, (arch, kind, split)  # partitions with keys at the context
            # the step's shape alone chose them: the one-pass attention and prefill GEMMs did not launch
            assert not [x for x in rows if x["op"] in sizing["gemm_ops"] + ["qkv_attention"]
                        and not new_kernel(x["kernel"]) and not x["kernel"].endswith("_rope")]
            assert not [x for x in rows if x["op"] == "fused_moe" and not x["kernel"].endswith("_small")]
            moe = [x for x in rows if moe_part(x["kernel"]) in ("up", "down")]
            assert len(moe) == (2 if kind == "mixtral" else 0), (arch, kind, moe)
            for x in moe:  # 128 (token, expert) pairs in blocks of 16 (some only padding, which return at once)
                assert x["ctas"] >= sms, (arch, kind, x)
            one = r["launches"]["1"]  # fixed per build: a decode GEMM's grid does not shrink with the batch
            assert {x["kernel"]: x["ctas"] for x in one if x["kernel"].endswith("_decode")} == \
                {x["kernel"]: x["ctas"] for x in gemms}
