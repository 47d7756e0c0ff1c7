"""ascend950 (AscendC): a tensor-parallel rank's vocab_embedding kernel (the lookup of its
vocabulary slice, zeros for the other ids) against the IR interpreter in deepfuse's CPU emulator
of the AscendC API: ids inside and outside the slice and on its edges, rows that are and are not
whole 32-byte blocks, f32 and bf16. An emulator, not the hardware: see docs/targets.md."""
import pytest
import torch

from deepfuse.codegen.ascendc.emit import emit_vocab_gather
from deepfuse.codegen.ascendc.emulate import launch
from deepfuse.codegen.ascendc.kernel import pack
from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, trace
from deepfuse.frontend.tracer import apply
from deepfuse.ir import interpret
from tests.codegen.test_ascendc import broken
from tests.conftest import needs_gxx

pytestmark = needs_gxx
ROWS = 10  # the rank's slice of the vocabulary: ids start .. start + ROWS - 1
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def vocab_graph(dtype: str, d: int, start: int, ids_dtype: str = "i32"):
    """vocab_embedding(table[ROWS, d], ids[T]) {start}."""
    return trace(lambda t, i: apply("vocab_embedding", t, i, start=start), Spec("table", dtype, (ROWS, d)),
                 Spec("ids", ids_dtype, ("T",)))


def edge_ids(start: int, dtype: torch.dtype) -> torch.Tensor:
    """The slice's first and last id, the ids just outside it, ids well inside / outside, repeats."""
    ids = [start, start + ROWS - 1, start - 1, start + ROWS, start + 3, 0, 5 * ROWS + 7, start, start + ROWS - 1]
    return torch.tensor([i for i in ids if i >= 0], dtype=dtype)


def run_vocab(g, kernel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel's y, interpreter's y) for a random table; y starts as garbage the kernel must overwrite."""
    table = torch.randn(ROWS, g.inputs[0].type.shape[1]).to(DTYPES[g.inputs[0].type.dtype])
    y = torch.full((ids.shape[0], table.shape[1]), 7.0, dtype=table.dtype)
    launch(kernel, [table, ids, y], pack(kernel.tiling, [tuple(table.shape), tuple(ids.shape)]))
    return y, interpret(g, {"table": table, "ids": ids})[0]


@pytest.mark.parametrize("start", [0, 13], ids=["rank0", "rank1"])
@pytest.mark.parametrize("d", [64, 40], ids=["DataCopy", "DataCopyPad"])  # 40: 160 / 80 bytes, not whole blocks
@pytest.mark.parametrize("dtype,ids_dtype", [("f32", "i32"), ("bf16", "i32"), ("bf16", "i64")])
def test_vocab_embedding_kernel_matches_the_interpreter(dtype, ids_dtype, d, start):
    g = vocab_graph(dtype, d, start, ids_dtype)
    kernel = emit_vocab_gather(g.nodes[0], f"vocab_{dtype}_{ids_dtype}_{d}_{start}")
    ids = edge_ids(start, {"i32": torch.int32, "i64": torch.int64}[ids_dtype])
    got, want = run_vocab(g, kernel, ids)
    outside = (ids < start) | (ids >= start + ROWS)
    assert outside.any() and (~outside).any()
    assert torch.equal(got, want)
    assert not got[outside].any()


def test_the_comparison_fails_when_other_ids_are_not_zeroed():
    """A kernel that skips the rows of ids outside its slice leaves them as they were: the
    comparison above fails, so it can."""
    g = vocab_graph("f32", 40, 13)
    k = emit_vocab_gather(g.nodes[0], "vocab_no_zero")
    k = broken(k, "                ZeroOut(row);\n", "", "vocab_no_zero2")
    got, want = run_vocab(g, k, edge_ids(13, torch.int32))
    assert not torch.equal(got, want)


def test_emulator_reports_copying_out_the_zero_row_before_the_vector_unit_wrote_it():
    """The zero row is a TBuf the vector unit fills: its copy-out must wait for V_MTE3."""
    g = vocab_graph("bf16", 40, 13)
    k = emit_vocab_gather(g.nodes[0], "vocab_no_wait")
    k = broken(k, "        WaitPipe<HardEvent::V_MTE3>();\n", "", "vocab_no_wait2")
    with pytest.raises(DeepfuseError, match="V_MTE3"):
        run_vocab(g, k, edge_ids(13, torch.int32))
