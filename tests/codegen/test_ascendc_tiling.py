"""ascend950: the GEMM tiling struct is the AscendC kit's TCubeTiling field by field, and every
kernel's tiling travels with its launch (by value, as the kit's Ascend 950 samples pass it), so
a launch still queued on the stream never reads a later launch's tiling. Sources: Huawei's
asc-devkit at commit 0da921b91aeb2abdc6e8d74423b0bbe7040c3fd1, and the CANN runtime docs for
aclrtMemcpy / aclrtMemcpyAsync ordering."""
import ctypes
import re
import subprocess

import torch

import deepfuse
from deepfuse.codegen.ascendc import build_plan
from deepfuse.codegen.ascendc.emit_gemm import emit_matmul
from deepfuse.codegen.ascendc.emulate import EMU_DIR
from deepfuse.codegen.ascendc.kernel import evaluate, pack
from deepfuse.codegen.ascendc.runner import EmulatorRunner, LaunchArgs
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret
from tests.conftest import needs_gxx

pytestmark = needs_gxx

# include/adv_api/matmul/matmul_tilingdata.h:21-72 (BEGIN_TILING_DATA_DEF(TCubeTiling)): 50 fields,
# all int32_t, in this order; the kernel-side kernel_tiling/kernel_tiling.h is generated from it
# (impl/adv_api/cmake/scripts/gen_kernel_tiling_data_def.py) as AscendC::tiling::TCubeTiling
TCUBE_TILING = """
usedCoreNum M N Ka Kb singleCoreM singleCoreN singleCoreK baseM baseN baseK depthA1 depthB1 stepM stepN isBias
transLength iterateOrder shareMode shareL1Size shareL0CSize shareUbSize batchM batchN singleBatchM singleBatchN stepKa
stepKb depthAL1CacheUB depthBL1CacheUB dbL0A dbL0B dbL0C ALayoutInfoB ALayoutInfoS ALayoutInfoN ALayoutInfoG
ALayoutInfoD BLayoutInfoB BLayoutInfoS BLayoutInfoN BLayoutInfoG BLayoutInfoD CLayoutInfoB CLayoutInfoS1 CLayoutInfoN
CLayoutInfoG CLayoutInfoS2 BatchNum mxTypePara""".split()


def test_the_emulated_tcube_tiling_has_the_kits_layout(tmp_path):
    """emu/kernel_tiling/kernel_tiling.h, compiled: each field at 4 x its index, 200 bytes."""
    assert len(TCUBE_TILING) == 50
    prog = tmp_path / "layout.cpp"
    prog.write_text('#include <cstddef>\n#include <cstdio>\n#include "kernel_tiling/kernel_tiling.h"\nint main() {\n'
                    + "".join(f'    std::printf("%zu ", offsetof(AscendC::tiling::TCubeTiling, {f}));\n'
                              for f in TCUBE_TILING)
                    + '    std::printf("%zu", sizeof(TCubeTiling));\n}\n')
    subprocess.run(["g++", "-std=c++17", "-I", EMU_DIR, str(prog), "-o", str(tmp_path / "layout")], check=True)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True).stdout.split()
    assert [int(v) for v in out] == [4 * i for i in range(50)] + [200]


def test_gemm_tiling_fills_every_field_as_get_tiling_would():
    """deepfuse's GEMM tiling lists the 50 fields in the struct's order (the host assigns each by
    name; pack() lays them out for the emulator), with the relations the TCubeTiling doc and
    MultiCoreMatmulTiling::GetTiling keep on Ascend 950 (docs/zh/api/SIMD-API/高阶API/矩阵计算/
    Matmul-Tiling类/TCubeTiling结构体.md; impl/adv_api/tiling/matmul/matmul_tiling_algorithm.cpp,
    UpdateTiling / UpdateUsedSize / GetUsedSize): usedCoreNum = ceil(M / singleCoreM) *
    ceil(N / singleCoreN), depthA1 = stepM * stepKa * 2, depthB1 = stepN * stepKb * 2 (double
    buffered), shareL1Size = the L1 the A and B tiles take, shareL0CSize = baseM * baseN * 4,
    transLength and shareUbSize 0 (only older SoCs stage ND<->NZ in UB)."""
    k = emit_matmul("mm_fields", ["shape", 0, 0], 1536, 576, ["in", 0], ["in", 1], ["out", 0], "bf16")
    assert [f for f, _, _ in k.tiling] == TCUBE_TILING and {c for _, c, _ in k.tiling} == {"int32_t"}
    t = {f: evaluate(e, [(7, 576), (1536, 576)]) for f, _, e in k.tiling}
    assert len(pack(k.tiling, [(7, 576), (1536, 576)])) == 200
    assert t["usedCoreNum"] == -(-t["M"] // t["singleCoreM"]) * -(-t["N"] // t["singleCoreN"]) == k.block_dim
    assert t["depthA1"] == t["stepM"] * t["stepKa"] * t["dbL0A"] and t["depthB1"] == t["stepN"] * t["stepKb"] * t["dbL0B"]
    assert t["shareL1Size"] == 2 * (t["depthA1"] * t["baseM"] + t["depthB1"] * t["baseN"]) * t["baseK"]
    assert t["shareL0CSize"] == t["baseM"] * t["baseN"] * 4
    assert t["transLength"] == t["shareUbSize"] == t["shareMode"] == t["BatchNum"] == t["mxTypePara"] == 0
    assert t["baseM"] % 16 == t["baseN"] % 16 == t["baseK"] % 16 == 0


def test_kernels_take_their_tiling_by_value(tiny_model):
    """As the kit's 950 samples pass TCubeTiling (matmul_advanced_api.asc: a kernel argument),
    every kernel takes its tiling struct by value: the host code copies no tiling to the device."""
    from deepfuse.codegen.ascendc.project import project_files
    from deepfuse.codegen.targets import get_target
    from deepfuse.compiler import trace_model
    from deepfuse.passes import PassManager

    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(tiny_model))
    plan = build_plan(g)
    host = project_files(plan)["host/deepfuse_launch.cpp"].decode()
    assert "aclrtMemcpy" not in host
    for p in plan["launches"]:
        for k in p.get("kernels", []):
            want = "AscendC::tiling::TCubeTiling tiling)" if k["core"] == "aic" else f"{k['name']}_tiling tiling)"
            assert re.search(rf"void {k['name']}\([^)]*{re.escape(want)}", k["source"]), k["name"]


def host_args(runner, ins, outs) -> LaunchArgs:
    a = LaunchArgs()
    for j, t in enumerate(ins):
        a.in_[j] = t.data_ptr()
        for d, n in enumerate(t.shape):
            a.in_shape[j][d] = n
    for j, t in enumerate(outs):
        a.out[j] = t.data_ptr()
    a.workspace = runner.workspace.data_ptr()
    return a


def test_a_queued_launch_keeps_its_own_tiling():
    """The host code queues a launch and returns; CANN's aclrtMemcpy copies at once, unordered
    with the stream ("不会进行隐式的device同步或流同步", aclrtMemcpy in the CANN runtime API). Two
    steps of one launch queued before the stream is synchronised (7 rows, then 3) must each run
    with their own tiling: the first writes all 7 of its rows."""
    w = torch.randn(576)
    g = trace(lambda x: ops.rms_norm(x, w, eps=1e-5), Spec("x", "f32", ("T", 576)))
    f = deepfuse.compile(g, target="ascend950")  # one generated kernel, reading x and w
    assert [p["kind"] for p in f.launches] == ["generated"] and f.graph.nodes[0].inputs[0].name == "x"
    runner = EmulatorRunner(f.plan, f.graph.weights, via_host=True)
    x1, x2 = torch.randn(7, 576), torch.randn(3, 576)
    y1, y2 = torch.zeros(7, 576), torch.zeros(3, 576)
    a1, a2 = host_args(runner, [x1, w], [y1]), host_args(runner, [x2, w], [y2])
    assert runner.host.deepfuse_launch(0, None, ctypes.byref(a1)) == 0
    assert runner.host.deepfuse_launch(0, None, ctypes.byref(a2)) == 0
    assert runner.host.aclrtSynchronizeStream(None) == 0
    torch.testing.assert_close(y1, interpret(g, {"x": x1})[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y2, interpret(g, {"x": x2})[0], atol=1e-5, rtol=1e-5)


def test_emulated_copies_follow_the_stream_rules():
    """The emulated aclrt (emu/host/acl/acl.h) orders as CANN documents: aclrtMemcpyAsync from
    pinned memory (aclrtMallocHost) is queued and happens at synchronisation, from pageable
    memory it is done before it returns; aclrtMemcpy is done at once."""
    lib = ctypes.CDLL(runtime_library())
    dst = (ctypes.c_int32 * 4)()
    pinned = ctypes.c_void_p()
    assert lib.aclrtMallocHost(ctypes.byref(pinned), 16) == 0
    ctypes.memmove(pinned, (ctypes.c_int32 * 4)(1, 2, 3, 4), 16)
    h2d = 1  # ACL_MEMCPY_HOST_TO_DEVICE
    assert lib.aclrtMemcpyAsync(dst, 16, pinned, 16, h2d, None) == 0
    assert list(dst) == [0, 0, 0, 0]
    assert lib.aclrtSynchronizeStream(None) == 0 and list(dst) == [1, 2, 3, 4]
    pageable = (ctypes.c_int32 * 4)(5, 6, 7, 8)
    assert lib.aclrtMemcpyAsync(dst, 16, pageable, 16, h2d, None) == 0 and list(dst) == [5, 6, 7, 8]
    assert lib.aclrtMemcpy(dst, 16, pinned, 16, h2d) == 0 and list(dst) == [1, 2, 3, 4]
    assert lib.aclrtFreeHost(pinned) == 0


def runtime_library() -> str:
    from deepfuse.codegen.ascendc.emulate import _cached, _gxx, _runtime_object

    obj = _runtime_object()
    return _cached(obj, "runtime.so", lambda out, tmp: _gxx(["-shared", obj, "-o", tmp], "the emulator runtime"))
