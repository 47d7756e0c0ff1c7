"""AscendC (ascend950) kernels against the IR interpreter in deepfuse's CPU emulator of the
AscendC API (g++), and the emulator's strictness: misaligned copies, unified-buffer overflow,
DeQue before EnQue. An emulator, not the hardware: see docs/targets.md."""
import dataclasses
import shutil

import pytest
import torch

from deepfuse.codegen.ascendc.emit import emit_rms_norm, emit_swiglu
from deepfuse.codegen.ascendc.emulate import rms_norm_tiling, rows_tiling, run
from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the AscendC emulator needs g++")


def norm_graph(d: int, add: bool):
    torch.manual_seed(d)
    w = torch.randn(d)
    if add:
        return trace(lambda x, r: ops.add_rms_norm(x, r, w, eps=1e-5), Spec("x", "f32", ("T", d)),
                     Spec("r", "f32", ("T", d)))
    return trace(lambda x: ops.rms_norm(x, w, eps=1e-5), Spec("x", "f32", ("T", d)))


def launch(g, kernel, rows: int, cores: int, ub_bytes: int = 248 * 1024):
    node = g.nodes[0]
    ins = {"x": torch.randn(rows, node.inputs[0].type.shape[1])}
    if len(node.inputs) == 3:
        ins["r"] = torch.randn_like(ins["x"])
    args = [ins[v.name] if v.name in ins else g.weights[v.name] for v in node.inputs]
    outs = run(kernel, args, [tuple(ins["x"].shape)] * len(node.outputs), rms_norm_tiling(rows, cores, 1e-5), ub_bytes)
    return outs, interpret(g, ins)


@pytest.mark.parametrize("add", [False, True], ids=["rms_norm", "add_rms_norm"])
@pytest.mark.parametrize("d", [576, 100], ids=["DataCopy", "DataCopyPad"])  # 100 floats: 400 bytes, a padded tail
def test_norm_kernels_match_the_interpreter(d, add):
    g = norm_graph(d, add)
    kernel = dataclasses.replace(emit_rms_norm(g.nodes[0], f"norm_{d}_{int(add)}"), block_dim=4)
    assert ("DataCopyPad" in kernel.source) == (d == 100)
    got, want = launch(g, kernel, rows=7, cores=4)  # 7 rows over 4 cores: the last core gets one
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_generated_source_has_the_public_kernel_structure():
    src = emit_rms_norm(norm_graph(576, True).nodes[0], "add_rms_norm_576").source
    for part in ('extern "C" __global__ __aicore__ void add_rms_norm_576(GM_ADDR x', "TPipe pipe;",
                 "TQue<QuePosition::VECIN, BUFFER_NUM>", "TQue<QuePosition::VECOUT, BUFFER_NUM>",
                 "TBuf<QuePosition::VECCALC>", "CopyIn(row);", "Compute();", "CopyOut(row);", "GetBlockIdx()",
                 ".EnQue(", ".DeQue<float>()", ".FreeTensor(", "ReduceSum(", "struct add_rms_norm_576_tiling"):
        assert part in src, part


def broken(kernel, old: str, new: str):
    assert old in kernel.source
    return dataclasses.replace(kernel, name=kernel.name, source=kernel.source.replace(old, new, 1), block_dim=2)


def test_emulator_reports_a_copy_that_is_not_whole_32_byte_blocks():
    g = norm_graph(100, False)
    k = emit_rms_norm(g.nodes[0], "norm_misaligned")
    k = broken(k, "DataCopyPad(xLocal, xGm[(uint64_t)row * 100], DataCopyExtParams{1, 400, 0, 0, 0}, "
                  "DataCopyPadExtParams<float>{false, 0, 0, 0});", "DataCopy(xLocal, xGm[(uint64_t)row * 100], 100);")
    with pytest.raises(DeepfuseError, match="not whole 32-byte blocks.*DataCopyPad"):
        launch(g, k, rows=3, cores=2)


def test_emulator_reports_unified_buffer_overflow():
    g = norm_graph(576, True)
    k = dataclasses.replace(emit_rms_norm(g.nodes[0], "norm_overflow"), block_dim=2)
    with pytest.raises(DeepfuseError, match="unified buffer overflow"):
        launch(g, k, rows=3, cores=2, ub_bytes=8 * 1024)


def test_emulator_reports_dequeue_before_enqueue():
    g = norm_graph(576, False)
    k = broken(emit_rms_norm(g.nodes[0], "norm_no_enque"), "        inQueueX.EnQue(xLocal);\n", "")
    with pytest.raises(DeepfuseError, match="DeQue before EnQue"):
        launch(g, k, rows=3, cores=2)


def test_a_kernel_that_does_not_compile_is_named():
    g = norm_graph(576, False)
    k = broken(emit_rms_norm(g.nodes[0], "norm_typo"), "ReduceSum(sum, work, work, 576);", "ReduceSum(sum, wrk, 576);")
    with pytest.raises(DeepfuseError, match="AscendC kernel norm_typo does not compile against the emulator"):
        launch(g, k, rows=3, cores=2)


@pytest.mark.parametrize("i", [1536, 100], ids=["DataCopy", "DataCopyPad"])
def test_swiglu_kernel_matches_the_interpreter(i):
    g = trace(lambda x: ops.swiglu(x), Spec("x", "f32", ("T", 2 * i)))
    kernel = dataclasses.replace(emit_swiglu(g.nodes[0], f"swiglu_{i}"), block_dim=3)
    x = torch.randn(5, 2 * i)
    got = run(kernel, [x], [(5, i)], rows_tiling(5, 3))
    torch.testing.assert_close(got[0], interpret(g, {"x": x})[0], atol=1e-5, rtol=1e-5)
