"""ascend950: what CANN's AscendC toolchain would reject or run wrongly, checked without CANN.
Each rule is from Huawei's public AscendC development kit (asc-devkit, read at commit
0da921b91aeb2abdc6e8d74423b0bbe7040c3fd1; paths below are in that repository) and is enforced
by deepfuse's emulator or checked in the generated project: no host-only C++ in kernels."""

import pytest
import torch

from deepfuse.codegen.ascendc import build_plan
from deepfuse.codegen.ascendc.emulate import build, launch
from deepfuse.codegen.ascendc.kernel import AscendKernel, pack
from deepfuse.codegen.targets import get_target
from deepfuse.compiler import trace_model
from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.models import load_model
from deepfuse.passes import PassManager
from tests.conftest import needs_gxx
from tests.models.test_deepseek_moe_routing import make_block, routing, weights

pytestmark = needs_gxx

UNUSED = [["unused", "uint32_t", 0]]  # the tiling of the test kernels below: one unused field
TINY = """\
#include "kernel_operator.h"
using namespace AscendC;

struct NAME_tiling {
    uint32_t unused;
};

extern "C" __global__ __aicore__ void NAME(GM_ADDR x, GM_ADDR workspace, NAME_tiling tiling)
{
    GlobalTensor<float> xGm;
    xGm.SetGlobalBuffer((__gm__ float*)x, 8);
    float v = xGm.GetValue(0);
    xGm.SetValue(0, BODY);
}
"""


def tiny_kernel(name: str, body: str, head: str = "") -> AscendKernel:
    """A one-core vector kernel that sets x[0] = body (x: f32 [8])."""
    return AscendKernel(name, head + TINY.replace("NAME", name).replace("BODY", body), [["in", 0]], UNUSED, 1)


@pytest.mark.parametrize("body,head", [("(float)sqrt((double)v)", ""), ("-INFINITY", ""), ("sqrtf(v)", ""),
                                       ("std::sqrt(v)", "#include <cmath>\n"), ("v * 0.5", "")],
                         ids=["sqrt-double", "INFINITY", "sqrtf", "cmath", "double-literal"])
def test_kernels_see_no_host_headers(body, head):
    """The AI core has no host C library: the kit's device headers include <cmath> only under
    ASCENDC_CPU_DEBUG (impl/utils/std/cmath/sqrt.h), and the scalar sqrt the kit offers is
    AscendC::Std::sqrt on float (docs/zh/api/Utils-API/CPP标准库/数学函数/sqrt1.md). A kernel
    using sqrt(double), INFINITY, libm or double arithmetic does not compile here."""
    with pytest.raises(DeepfuseError, match="does not compile against the emulator"):
        build(tiny_kernel(f"host_cpp_{abs(hash(body)) % 10**6}", body, head))


def test_a_device_only_kernel_compiles_and_runs():
    """The same kernel with float arithmetic only (the control for the test above)."""
    x = torch.full((8,), 3.0)
    launch(tiny_kernel("device_cpp", "v * 0.5f"), [x], pack(UNUSED, []))
    assert x[0] == 1.5


def deepseek_plan() -> dict:
    cfg, m = make_block()
    w = weights(m)

    def fn(x):
        return ops.moe(x, ops.linear(x, w["router"]), w["w13"], w["w2"], w["bias"], **routing(cfg))

    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace(fn, Spec("x", "f32", ("T", 64)), weights=w))
    return build_plan(g)


def qwen3_plan(tmp_path, dtype: str) -> dict:
    from tests.models.test_moe_families import qwen3_moe

    torch.manual_seed(0)
    qwen3_moe().eval().save_pretrained(tmp_path)
    model, _ = load_model(str(tmp_path), with_tokenizer=False)
    g, _ = PassManager(get_target("ascend950").pipeline()).run(trace_model(model, dtype))
    return build_plan(g)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_emitted_kernels_keep_to_device_cpp(dtype, tmp_path):
    """Every kernel of a Qwen3-MoE step (rms_norm's rstd, the attention's per-head RMSNorm and
    online softmax, MoE routing) and of DeepSeek-V3 routing (group-limited choice): rstd on the
    vector unit (Sqrt, then the V_S handover), the lowest float for an empty maximum; each
    kernel compiles as the AI core sees it."""
    plans = [qwen3_plan(tmp_path, dtype)] + ([deepseek_plan()] if dtype == "f32" else [])
    kernels = {k["name"]: AscendKernel(**k) for plan in plans for p in plan["launches"] for k in p.get("kernels", [])}
    for k in kernels.values():
        assert not any(bad in k.source for bad in ("sqrt(", "INFINITY", "double")), k.name
        build(k)
    assert any("Sqrt(" in k.source for k in kernels.values())


REDUCE = """\
#include "kernel_operator.h"
using namespace AscendC;

struct NAME_tiling {
    uint32_t unused;
};

extern "C" __global__ __aicore__ void NAME(GM_ADDR x, GM_ADDR workspace, NAME_tiling tiling)
{
    TPipe pipe;
    TBuf<QuePosition::VECCALC> srcBuf, tmpBuf, dstBuf;
    pipe.InitBuffer(srcBuf, 576 * 4);
    pipe.InitBuffer(tmpBuf, TMP_BYTES);
    pipe.InitBuffer(dstBuf, 32);
    GlobalTensor<float> xGm;
    xGm.SetGlobalBuffer((__gm__ float*)x, 576);
    LocalTensor<float> src = srcBuf.Get<float>();
    LocalTensor<float> tmp = tmpBuf.Get<float>();
    LocalTensor<float> dst = dstBuf.Get<float>();
    DataCopy(src, xGm, 576);
    SetFlag<HardEvent::MTE2_V>(0);
    WaitFlag<HardEvent::MTE2_V>(0);
    ReduceSum(DST, src, TMP, 576);
    SetFlag<HardEvent::V_S>(0);
    WaitFlag<HardEvent::V_S>(0);
    xGm.SetValue(0, DST.GetValue(0));
}
"""


def reduce_kernel(name: str, dst: str, tmp: str, tmp_bytes: int) -> AscendKernel:
    src = REDUCE.replace("NAME", name).replace("DST", dst).replace("TMP_BYTES", str(tmp_bytes)).replace("TMP", tmp)
    return AscendKernel(name, src, [["in", 0]], UNUSED, 1)


@pytest.mark.parametrize("dst,tmp,tmp_bytes,error", [
    ("dst", "src", 32, "ReduceSum: its sharedTmpBuffer overlaps its source"),
    ("src", "tmp", 64, "ReduceSum: its destination overlaps its source"),
    ("dst", "tmp", 32, r"ReduceSum of 576 float needs a sharedTmpBuffer of 16 elements \(64 bytes\), it has 8"),
    ("dst", "tmp", 64, None), ("tmp", "tmp", 64, None)],
    ids=["tmp-is-src", "dst-is-src", "tmp-too-small", "separate", "dst-in-tmp"])
def test_reduce_sum_scratch_rules(dst, tmp, tmp_bytes, error):
    """ReduceSum (include/basic_api/kernel_operator_vec_reduce_intf.h, count form): only dst and
    sharedTmpBuffer may overlap (docs/zh/api/SIMD-API/基础API/Memory矢量计算/归约计算/ReduceSum.md,
    约束说明; no other overlap is sanctioned: 通用说明和约束.md, 通用地址重叠约束); on Ascend 950
    sharedTmpBuffer holds one partial sum per 256-byte repeat, in whole 32-byte blocks (same page,
    方式二): 576 floats need 16."""
    x = torch.randn(576)
    want = x.sum()
    k = reduce_kernel(f"reduce_{dst}_{tmp}_{tmp_bytes}", dst, tmp, tmp_bytes)
    if error:
        with pytest.raises(DeepfuseError, match=error):
            launch(k, [x], pack(UNUSED, []))
    else:
        launch(k, [x], pack(UNUSED, []))
        torch.testing.assert_close(x[0], want, atol=1e-4, rtol=1e-5)


def test_emitted_reduce_sums_have_their_own_scratch(tmp_path):
    """No emitted ReduceSum passes its source as its scratch (norms, attention scores, int4 dots)."""
    import re

    kernels = [k for p in qwen3_plan(tmp_path, "f32")["launches"] for k in p.get("kernels", [])]
    calls = [re.search(r"ReduceSum\(([^,]+), ([^,]+), ([^,]+),", line) for k in kernels for line in k["source"].splitlines()
             if "ReduceSum(" in line]
    assert calls and all(c and c.group(2) != c.group(3) for c in calls)


def test_gemm_kernels_run_on_the_cube_cores_alone():
    """The GEMM is pure cube: ASCENDC_CUBE_ONLY before lib/matmul_intf.h and a __cube__ entry
    (docs/zh/guide/编程指南/语言扩展层/SIMD-BuiltIn关键字.md; examples/01_simd_cpp_api/00_introduction/
    02_matrix/matmul_advanced_api). Without them Matmul is the mixed mode's vector-side client
    (include/adv_api/matmul/matmul_intf.h), GetBlockIdx on the vector side ranges over twice the
    blocks (docs/zh/api/SIMD-API/基础API/工具接口/系统资源与变量/GetBlockIdx.md) and the
    GetBlockIdx() * singleCoreN split leaves half the cube cores idle."""
    from deepfuse.codegen.ascendc.emit_gemm import emit_matmul

    k = emit_matmul("mm_modes", ["shape", 0, 0], 512, 64, ["in", 0], ["in", 1], ["out", 0])
    a, b, c = torch.randn(5, 64), torch.randn(512, 64), torch.zeros(5, 512)
    ran = launch(k, [a, b, c], pack(k.tiling, [(5, 64), (512, 64)]))
    torch.testing.assert_close(c, a @ b.T, atol=1e-4, rtol=1e-5)
    assert k.block_dim == 32 and ran == {"blocks": 32, "busy_cubes": 32}
    assert k.source.index("#define ASCENDC_CUBE_ONLY") < k.source.index('#include "lib/matmul_intf.h"')


def test_every_kernel_declares_the_cores_it_runs_on(tmp_path):
    """__vector__ for the vector kernels, __cube__ for the Matmul ones: on Ascend 950 (separate
    AIC and AIV cores, NPU架构版本3510.md) __aicore__ alone does not say which."""
    from deepfuse.codegen.ascendc.emulate import QUALIFIERS, qualifier

    kernels = {k["name"]: AscendKernel(**k) for p in qwen3_plan(tmp_path, "f32")["launches"] for k in p.get("kernels", [])}
    want = {"aiv": QUALIFIERS["__vector__"], "aic": QUALIFIERS["__cube__"]}
    assert {k.core for k in kernels.values()} == {"aiv", "aic"}
    assert all(qualifier(k) == want[k.core] for k in kernels.values())


MODES = """\
#include "kernel_operator.h"
HEAD
using namespace AscendC;

struct NAME_tiling {
    uint32_t unused;
};

extern "C" __global__ QUALIFIER void NAME(GM_ADDR x, GM_ADDR workspace, NAME_tiling tiling)
{
    GlobalTensor<float> xGm;
    xGm.SetGlobalBuffer((__gm__ float*)x, 16);
    BODY
    xGm.SetValue(GetBlockIdx(), (float)(GetBlockNum() * 100 + GetSubBlockIdx() * 10 + GetTaskRatio()));
}
"""


@pytest.mark.parametrize("qualifier,head,body,want", [
    ("__vector__", "", "", [301, 301, 301, 0, 0, 0]),
    ("__cube__", "", "", [301, 301, 301, 0, 0, 0]),
    ("__mix__(1, 2)", "", "", [302, 312, 302, 312, 302, 312]),
    ("__cube__", "", "TPipe pipe; TBuf<QuePosition::VECCALC> buf; pipe.InitBuffer(buf, 32);",
     "a unified-buffer TQue / TBuf on a cube"),
    ("__cube__", '#include "lib/matmul_intf.h"', "", "__cube__ kernel whose Matmul is the mixed-mode"),
    ("__vector__", '#define ASCENDC_CUBE_ONLY\n#include "lib/matmul_intf.h"', "", "__vector__ kernel with a Matmul"),
], ids=["vector", "cube", "mix-1-2", "cube-with-ub", "cube-with-mix-matmul", "vector-with-matmul"])
def test_kernel_modes_and_block_indices(qualifier, head, body, want):
    """Per mode, the cores a launch of 3 blocks starts and what GetBlockIdx / GetBlockNum /
    GetSubBlockIdx / GetTaskRatio return there (GetBlockIdx.md, GetBlockNum.md,
    GetSubBlockIdx.md, GetTaskRatio.md); a pure-cube kernel has no vector logic (设置Kernel类型.md,
    KERNEL_TYPE_AIC_ONLY), a __cube__ Matmul needs ASCENDC_CUBE_ONLY."""
    name = f"modes_{abs(hash((qualifier, head, body))) % 10**6}"
    src = MODES.replace("NAME", name).replace("QUALIFIER", qualifier).replace("HEAD", head).replace("BODY", body)
    k = AscendKernel(name, src, [["in", 0]], UNUSED, 3)
    x = torch.zeros(16)
    if isinstance(want, str):
        with pytest.raises(DeepfuseError, match=want):
            launch(k, [x], pack(UNUSED, []))
    else:
        launch(k, [x], pack(UNUSED, []))
        assert x[:6].tolist() == want
