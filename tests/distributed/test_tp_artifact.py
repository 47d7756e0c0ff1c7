"""A tensor-parallel artifact (`deepfuse compile --tp 2`): one directory of per-rank plans and
weight shards that the ranks load instead of compiling, with the 1-process tokens; pinned by one
digest, every rank's files verified, refused where changed or loaded as a one-process artifact."""
import os

import pytest

import deepfuse
from deepfuse.cli import main
from deepfuse.codegen.artifact import artifact_digest
from deepfuse.errors import DeepfuseError
from deepfuse.models import load_model
from deepfuse.runtime.distributed import RankOptions, ShardedEngine
from deepfuse.runtime.engine import Engine
from deepfuse.runtime.kv_cache import CacheConfig
from deepfuse.runtime.loader import load, load_rank
from deepfuse.runtime.request import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 7, 64, 1], list(range(20, 60))]
PARAMS = [SamplingParams(temperature=0, max_tokens=10, logprobs=2, ignore_eos=True),
          SamplingParams(temperature=0.8, seed=4, max_tokens=8)]
OPTIONS = RankOptions(with_tokenizer=False, block_size=4, num_blocks=128, max_num_tokens=32, max_num_seqs=4)


def _same_tokens_from_ranks(want, artifact: str, digest: str | None = None):
    """The artifact's ranks' outputs of PROMPTS, asserted to have the tokens of `want`."""
    eng = ShardedEngine(None, 2, OPTIONS, artifact=artifact, artifact_digest=digest)
    try:
        got = eng.generate(PROMPTS, PARAMS)
    finally:
        eng.close()
    for w, g in zip(want, got):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
    return got


@pytest.fixture(scope="module")
def tp_artifact(tiny_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp") / "art")
    assert main(["compile", "--model", tiny_dir, "--tp", "2", "-o", out]) == 0
    return out


def test_ranks_load_the_artifact_and_give_the_one_process_tokens(tiny_dir, tp_artifact):
    assert sorted(os.listdir(tp_artifact)) == ["manifest.json", "rank0", "rank1"]
    model, _ = load_model(tiny_dir, with_tokenizer=False)
    want = Engine(deepfuse.compile(model), CacheConfig(4, 128), 32, 4).generate(PROMPTS, PARAMS)
    # each rank holds its shard: rank 0's q projection has half the model's rows
    rank0 = load_rank(tp_artifact, 0)
    full = {k: v.shape for k, v in deepfuse.compile(model).graph.weights.items()}
    assert rank0.config.num_kv_heads * 2 == model.config.num_kv_heads
    assert any(v.shape[0] * 2 == full[k][0] for k, v in rank0.graph.weights.items() if k in full and v.dim() == 2)
    got = _same_tokens_from_ranks(want, tp_artifact, artifact_digest(tp_artifact))
    for lw, lg in zip(want[0].outputs[0].logprobs, got[0].outputs[0].logprobs):
        assert lw.keys() == lg.keys() and max(abs(lw[t].logprob - lg[t].logprob) for t in lw) <= 1e-5


def test_llm_runs_a_tp_artifact_on_its_ranks_and_async_llm_refuses_it(tp_artifact):
    from deepfuse import LLM
    from deepfuse.runtime.async_llm import AsyncLLM

    llm = LLM(artifact=tp_artifact, block_size=4, num_blocks=128, max_num_tokens=32, max_num_seqs=4)
    try:
        out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], PARAMS[0])[0]
        assert len(out.outputs[0].token_ids) == 10 and llm.model is None
    finally:
        llm.engine.close()
    with pytest.raises(DeepfuseError, match="runs one in-process engine"):
        AsyncLLM(LLM(artifact=tp_artifact, block_size=4, num_blocks=128))


def test_a_changed_or_misused_artifact_is_refused(tp_artifact, tmp_path):
    with pytest.raises(DeepfuseError, match=r"tensor-parallel \(2 ranks\).*--tp 2"):
        load(tp_artifact)
    with pytest.raises(DeepfuseError, match="not the pinned"):
        ShardedEngine(None, 2, OPTIONS, artifact=tp_artifact, artifact_digest="sha256:" + "0" * 64)
    with pytest.raises(DeepfuseError, match="has 2 ranks, not 4"):
        ShardedEngine(None, 4, OPTIONS, artifact=tp_artifact)
    with pytest.raises(DeepfuseError, match="no rank 2"):
        load_rank(tp_artifact, 2)
    import shutil

    bad = str(tmp_path / "bad")
    shutil.copytree(tp_artifact, bad)
    with open(os.path.join(bad, "rank1", "manifest.json"), "a") as f:  # a rank's manifest changed
        f.write(" ")
    with pytest.raises(DeepfuseError, match="not the pinned"):
        load_rank(bad, 1)
    shutil.rmtree(bad)
    shutil.copytree(tp_artifact, bad)
    with open(os.path.join(bad, "rank0", "weights.safetensors"), "r+b") as f:  # a shard's bytes changed
        f.seek(-4, 2)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(DeepfuseError, match="does not match its sha256"):
        load_rank(bad, 0)
    with pytest.raises(DeepfuseError, match="tensor-parallel rank 0 failed: .*does not match its sha256"):
        ShardedEngine(None, 2, OPTIONS, artifact=bad)
    os.makedirs(os.path.join(bad, "rank2"))
    with pytest.raises(DeepfuseError, match="holds rank2"):
        load_rank(bad, 1)


def test_compile_tp_refuses_what_ranks_do_not_take(tiny_dir, tmp_path, capsys):
    assert main(["compile", "--model", tiny_dir, "--tp", "2", "--quant", "int4", "-o", str(tmp_path / "x")]) == 2
    assert "--tp does not take --quant" in capsys.readouterr().err
    assert main(["compile", "--model", tiny_dir, "--tp", "4", "-o", str(tmp_path / "y")]) == 2
    assert "cannot be split over 4 ranks" in capsys.readouterr().err and not os.path.exists(tmp_path / "y")
    assert main(["compile", "--model", tiny_dir, "--moe-dispatch", "all_to_all", "-o", str(tmp_path / "z")]) == 2
    assert "give --tp N" in capsys.readouterr().err
    assert main(["compile", "--model", tiny_dir, "--tp", "2", "--target", "sm90", "--moe-dispatch", "all_to_all",
                 "-o", str(tmp_path / "w")]) == 0  # a dense model has no MoE to dispatch


def test_an_all_to_all_artifact_dispatches_by_all_to_all_with_the_one_process_tokens(tmp_path, capsys):
    import torch

    from tests.models.test_moe_families import mixtral

    torch.manual_seed(0)
    mixtral().eval().save_pretrained(tmp_path / "m")
    out = str(tmp_path / "art")
    assert main(["compile", "--model", str(tmp_path / "m"), "--tp", "2", "--moe-dispatch", "all_to_all", "-o", out]) == 0
    model, _ = load_model(str(tmp_path / "m"), with_tokenizer=False)
    rank1 = load_rank(out, 1)
    assert rank1.plan["ep_rows"] == [2, 1]
    assert rank1.graph.op_counts()["all_to_all"] == 4 * model.config.num_layers
    # the experts run the target's grouped GEMMs, not their references (host steps), in both forms
    from deepfuse.sharded_compile import compile_rank

    reduce_rank = compile_rank(model, 2, 0)
    assert reduce_rank.graph.op_counts()["moe_experts"] == model.config.num_layers
    for r in (rank1, reduce_rank):
        assert not {s["op"] for s in r.plan["host_steps"]} & {"moe_experts", "moe_local_experts"}
    assert main(["compile", "--model", str(tmp_path / "m"), "--tp", "2", "--target", "sm90", "--moe-dispatch",
                 "all_to_all", "-o", str(tmp_path / "gpu")]) == 2
    assert "runs on the cpu target" in capsys.readouterr().err
    want = Engine(deepfuse.compile(model), CacheConfig(4, 128), 32, 4).generate(PROMPTS, PARAMS)
    _same_tokens_from_ranks(want, out)


@pytest.mark.slow
def test_generate_runs_a_tp_artifact_of_smollm2_with_the_one_process_text(tmp_path, capsys):
    out = str(tmp_path / "smollm2-tp2")
    assert main(["compile", "--model", "smollm2", "--tp", "2", "-o", out]) == 0
    capsys.readouterr()
    assert main(["generate", "--artifact", out, "--no-chat", "--max-tokens", "12", "The capital of France is"]) == 0
    sharded = capsys.readouterr().out
    assert main(["generate", "--no-chat", "--max-tokens", "12", "The capital of France is"]) == 0
    assert sharded == capsys.readouterr().out and "Paris" in sharded
