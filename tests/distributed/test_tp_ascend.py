"""Tensor parallelism on ascend950 in 2 rank processes: each rank's step runs through its generated
host code in the AscendC emulator, whose all_reduce / all_gather are HcclAllReduce / HcclAllGather
calls that the emulated HCCL hands to gloo. Greedy tokens of the 1-process ascend950 build (and
of the CPU build); a rank whose all_reduce does nothing gives other tokens. An emulator, not CANN."""
import os

import pytest

import deepfuse
from deepfuse.cli import main
from deepfuse.codegen.artifact import artifact_digest
from deepfuse.codegen.ascendc.hccl import GlooTransport
from deepfuse.models import load_model
from deepfuse.runtime import distributed
from deepfuse.runtime.distributed import RankOptions, ShardedEngine
from deepfuse.runtime.engine import Engine
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.request import SamplingParams
from tests.conftest import needs_gxx

pytestmark = needs_gxx
PROMPTS = [[5, 17, 99, 3, 42, 7, 64, 1], [9, 9, 2]]
PARAMS = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)] * 2
OPTIONS = RankOptions(target="ascend950", with_tokenizer=False, block_size=16, num_blocks=32, max_num_tokens=32,
                      max_num_seqs=4)


@pytest.fixture(scope="module")
def want(tiny_dir) -> list[list[int]]:
    """The 1-process ascend950 build's greedy tokens, checked equal to the CPU build's."""
    model, _ = load_model(tiny_dir, with_tokenizer=False)
    tokens = {}
    for target in ("cpu", "ascend950"):
        outs = Engine(deepfuse.compile(model, target=target), CacheConfig(16, 32), 32, 4).generate(PROMPTS, PARAMS)
        tokens[target] = [o.outputs[0].token_ids for o in outs]
    assert tokens["ascend950"] == tokens["cpu"]
    return tokens["ascend950"]


@pytest.fixture(scope="module")
def tp_artifact(tiny_dir, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tp_ascend") / "art")
    assert main(["compile", "--model", tiny_dir, "--tp", "2", "--target", "ascend950", "-o", out]) == 0
    return out


def _tokens(path: str) -> list[list[int]]:
    """Greedy tokens of 2 ranks that compile the checkpoint at `path` for ascend950."""
    eng = ShardedEngine(path, 2, OPTIONS)
    try:
        got = eng.generate(PROMPTS, PARAMS)
    finally:
        eng.close()
    assert all(g.error is None for g in got)
    return [g.outputs[0].token_ids for g in got]


def test_the_host_code_calls_hccl_for_every_collective(tp_artifact):
    """Each rank's CANN project: its all_reduces and its vocabulary all_gather are HCCL calls of the
    host code (launches of kind "collective"), its vocabulary slice's lookup (vocab_embedding) an
    AscendC kernel, no op a host step; and CMake links HCCL."""
    import json

    for r in range(2):
        rank = os.path.join(tp_artifact, f"rank{r}")
        with open(os.path.join(rank, "plan.json")) as f:
            plan = json.load(f)
        with open(os.path.join(rank, "host", "deepfuse_launch.cpp")) as f:
            host = f.read()
        collectives = [p for p in plan["launches"] if p["op"] in ("all_reduce", "all_gather")]
        assert {p["kind"] for p in collectives} == {"collective"}
        assert plan["host_steps"] == []
        lookup = next(p for p in plan["launches"] if p["op"] == "vocab_embedding")
        assert lookup["kind"] == "template" and len(lookup["kernels"]) == 1
        assert f"int64_t local = (int64_t)idsGm.GetValue(row) - {64 * r};" in lookup["kernels"][0]["source"]
        assert host.count("HcclAllReduce(") == 1 and host.count("HcclAllGather(") == 1  # one function each
        assert sum(f'{{"{p["op"]}", 1, {{{p["collective"]}}}}}' in host for p in collectives) == len(collectives)
        with open(os.path.join(rank, "CMakeLists.txt")) as f:
            assert "target_link_libraries(deepfuse_launch PRIVATE hccl)" in f.read()


def test_llm_runs_the_tp2_ascend950_artifact_with_the_one_process_tokens(tp_artifact, want):
    from deepfuse import LLM

    llm = LLM(artifact=tp_artifact, artifact_digest=artifact_digest(tp_artifact), block_size=16, num_blocks=32,
              max_num_tokens=32, max_num_seqs=4)
    try:
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS[0])
    finally:
        llm.engine.close()
    assert [g.outputs[0].token_ids for g in got] == want


def test_ranks_that_compile_for_ascend950_give_the_one_process_tokens(tiny_dir, want):
    assert _tokens(tiny_dir) == want


def _rank_main_with_silent_all_reduce(*args) -> None:
    """A rank whose HcclAllReduce leaves its own partial sum in the output (a test-only mutation of
    the emulated HCCL's transport), then the rank as usual (in its process, the module's own)."""
    GlooTransport.all_reduce = lambda self, x, y, op: y.copy_(x)
    distributed._rank_main(*args)


def test_the_comparison_fails_when_the_ranks_do_not_reduce(tiny_dir, want, monkeypatch):
    """Every rank's all_reduce a copy of its partial sum: not the 1-process tokens, so the test
    above can fail."""
    monkeypatch.setattr(distributed, "_rank_main", _rank_main_with_silent_all_reduce)
    assert _tokens(tiny_dir) != want


def test_a_rank_plan_outside_a_distributed_run_names_the_fix(tiny_model):
    """One rank's ascend950 step run alone: its first HCCL collective needs a communicator of the
    other ranks, and the message says how to start them."""
    from deepfuse.errors import DeepfuseError
    from deepfuse.sharded_compile import compile_rank
    from tests.codegen.test_triton import mixed_step

    rank = compile_rank(tiny_model, 2, 0, target="ascend950")
    with pytest.raises(DeepfuseError, match="tensor_parallel_size=N"):
        rank.runner(mixed_step(rank.config))
