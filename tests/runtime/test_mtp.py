"""MTP draft head: training by self-distillation improves it on held-out text, drafting with it
keeps outputs identical (greedy and seeded sampling), and heads that do not fit are refused."""
import json
import random

import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.models import Llama
from deepfuse.runtime.engine import Engine, SamplingParams
from deepfuse.runtime.mtp import CONTEXT, DraftHead, MtpDrafter, context, extend, target_probe, target_weights
from deepfuse.runtime.spec import SpecConfig, SpecStats
from deepfuse.runtime.train_drafter import Examples, TrainConfig, greedy_states, train_drafter
from tests.helpers import check_spec_accounting

CONFIG = TrainConfig(num_prompts=24, max_tokens=24, steps=200, seconds=120, batch_size=64, lr=3e-3, eval_drafts=3)


@pytest.fixture(scope="module")
def tiny_target(tiny_model):
    return deepfuse.compile(tiny_model)


@pytest.fixture(scope="module")
def trained(tiny_target, tmp_path_factory):
    rng = random.Random(0)
    prompts = [[rng.randrange(128) for _ in range(rng.randrange(4, 20))] for _ in range(CONFIG.num_prompts)]
    path = str(tmp_path_factory.mktemp("mtp") / "head.safetensors")
    return path, train_drafter(tiny_target, path, CONFIG, prompts=prompts, log=lambda *_: None)


def test_greedy_states_pair_each_token_with_the_state_that_sampled_it(tiny_target):
    from deepfuse.runtime.batch import SeqChunk, build_step
    from deepfuse.runtime.kv_cache import CacheConfig, KVCache

    prompts = [[5, 17, 99, 3], [9, 2]]
    states = greedy_states(tiny_target, prompts, 6)
    plain = Engine(tiny_target).generate(prompts, [SamplingParams(temperature=0, max_tokens=6)] * 2)
    assert [g.tolist() for g, _ in states] == [o.outputs[0].token_ids for o in plain]
    c = tiny_target.config
    seq = prompts[0] + states[0][0].tolist()
    cache = KVCache(c.num_layers, c.num_kv_heads, c.head_dim, torch.float32, CacheConfig(4, 16))
    _, _, hidden = tiny_target(build_step([SeqChunk(seq[:-1], 0, [], samples=6)], cache))
    torch.testing.assert_close(states[0][1], hidden, atol=1e-5, rtol=1e-5)
    ex = Examples(prompts, states, depth=2)
    assert ex.starts.tolist() == [0, 1, 2, 3, 6, 7, 8, 9]  # i + 2 stays inside its continuation
    h, x, y, ctx = ex.batch(torch.tensor([1, 4]), 2)
    g0, g1 = states[0][0].tolist(), states[1][0].tolist()
    assert x.tolist() == [g0[1:3], g1[0:2]] and y.tolist() == [g0[2:4], g1[1:3]]
    assert torch.equal(h[1], states[1][1][0])
    # each fed token ends its context, which holds its own sequence's tokens only
    assert ctx.shape == (2, 2, CONTEXT) and ctx[0, 0].tolist() == context(prompts[0] + g0[:2])
    assert ctx[1, 1].tolist() == context(prompts[1] + g1[:2]) and ctx[1, 1, :-4].eq(-1).all()


def test_training_learns_the_targets_next_tokens(trained):
    path, m = trained
    assert m["steps"] == CONFIG.steps and m["last_loss"] < 0.9 * m["first_loss"]
    before, after = m["heldout_untrained"], m["heldout"]
    # the untrained head already copies (its induction bonus and pointer term start switched on)
    assert after["positions"] > 0 and after["first_draft_accuracy"] >= before["first_draft_accuracy"]
    assert after["first_draft_accuracy"] > 0.2 and after["mean_accepted_length"] > 1.2
    # calibrated on the held-out drafts: the first draft's confidence is near its accuracy
    assert abs(after["first_draft_mean_confidence"] - after["first_draft_accuracy"]) < 0.2
    head, probe, stored = DraftHead.load(path)
    assert stored["heldout"] == after and probe.shape == (16, 64)
    assert sum(p.numel() for p in head.parameters()) < 64 * 64 * 16  # the head is small: no vocab-sized matrix


def test_mtp_drafts_keep_outputs_identical(tiny_target, trained):
    path, _ = trained
    prompts = [[5, 17, 99, 3, 42], [9, 2, 64, 1, 7, 7, 8], [100]]
    params = [SamplingParams(temperature=0, max_tokens=20), SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0.9, seed=3, max_tokens=16)]
    plain = Engine(tiny_target).generate(prompts, params)
    for schedule in ("fixed", "confidence"):
        eng = Engine(tiny_target, spec=SpecConfig(method="mtp", draft_head=path, num_draft_tokens=3,
                                                  schedule=schedule))
        outs = eng.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
        if schedule == "fixed":
            check_spec_accounting(eng, outs, 3)


def test_mtp_drafter_chains_its_own_state(tiny_target, trained):
    """propose_batch's drafts are the head applied to (hidden, last token), then to its own output."""
    path, _ = trained
    drafter = MtpDrafter(path, tiny_target)
    embed, head_w = target_weights(tiny_target)

    class Req:
        request_id, tokens, hidden, spec = "r", [3, 4, 5], torch.randn(64), SpecStats()

    draft = drafter.propose_batch([Req(), Req()], [3, 0])
    h, x, want, conf = Req.hidden[None], torch.tensor([5]), [], 1.0
    ctx = torch.tensor([[-1] * (CONTEXT - 3) + [3, 4, 5]])
    with torch.no_grad():
        for _ in range(3):
            logits, h, c = drafter.head(h, x, ctx, embed, head_w)
            x = logits.argmax(-1)
            ctx = extend(ctx, x)
            conf *= float(torch.sigmoid(c))
            want.append(int(x))
    assert draft[0].tokens == want and draft[0].confidence[-1] == pytest.approx(conf, rel=1e-5)
    assert draft[1].tokens == [] and 0 < draft[0].confidence[2] <= draft[0].confidence[0] < 1
    # drafts that do not pay their LM-head reads are skipped, but every 8th round probes again
    assert 0.1 < drafter.gate.cost < 1
    for _ in range(3):
        Req.spec.add(3, 0)
    rounds = [bool(drafter.propose_batch([Req()], [3])[0].tokens) for _ in range(8)]
    assert rounds == [False] * 7 + [True]


def test_heads_that_do_not_fit_are_refused(tiny_model, tiny_target, trained, tmp_path):
    from transformers import LlamaForCausalLM

    from deepfuse.models import load_model
    from tests.conftest import tiny_hf_config

    path, _ = trained
    with pytest.raises(DeepfuseError, match="needs draft_head"):
        SpecConfig(method="mtp")
    LlamaForCausalLM(tiny_hf_config(vocab_size=64)).save_pretrained(tmp_path / "small")
    other = deepfuse.compile(load_model(str(tmp_path / "small"), with_tokenizer=False)[0])
    spec = SpecConfig(method="mtp", draft_head=path)
    with pytest.raises(DeepfuseError, match="vocabulary of 128 tokens, the target 64"):
        Engine(other, spec=spec)
    weights = {k: torch.randn_like(v) if "lm_head" in k else v for k, v in tiny_model.weights.items()}
    with pytest.raises(DeepfuseError, match="trained for another model"):
        Engine(deepfuse.compile(Llama(tiny_model.config, weights)), spec=spec)
    bf16 = deepfuse.compile(tiny_model, dtype="bf16")  # the same model rounded: accepted
    assert isinstance(Engine(bf16, spec=spec).drafter, MtpDrafter)
    not_a_head = tmp_path / "x.safetensors"
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(not_a_head))
    with pytest.raises(DeepfuseError, match="not a deepfuse MTP draft head"):
        Engine(tiny_target, spec=SpecConfig(method="mtp", draft_head=str(not_a_head)))
    with pytest.raises(DeepfuseError, match="cannot read draft head"):
        Engine(tiny_target, spec=SpecConfig(method="mtp", draft_head=str(tmp_path / "missing.safetensors")))
    _, lm_head = target_weights(tiny_target)
    assert torch.equal(target_probe(lm_head), DraftHead.load(path)[1])


def test_bad_training_config_is_refused():
    with pytest.raises(DeepfuseError, match="depth must be >= 1"):
        TrainConfig(depth=0)
    with pytest.raises(DeepfuseError, match="seconds and lr"):
        TrainConfig(seconds=0)


def test_cli_trains_a_head_from_a_prompts_file(tiny_dir, tmp_path, capsys):
    """`deepfuse train-drafter` on a checkpoint, prompts from a JSONL file; a bad line is named."""
    from deepfuse.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt_token_ids": [i, i + 1, i + 2, 7]}) for i in range(12)) + "\n")
    out = tmp_path / "h.safetensors"
    assert main(["train-drafter", "--model", tiny_dir, "--prompts", str(prompts), "--max-tokens", "16",
                 "--steps", "5", "-o", str(out)]) == 0
    assert "held-out" in capsys.readouterr().err and DraftHead.load(str(out))[2]["steps"] == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    assert main(["train-drafter", "--model", tiny_dir, "--prompts", str(bad), "-o", str(out)]) == 2
    assert "line 1" in capsys.readouterr().err
    bad.write_text('{"prompt_token_ids": [1, "x"]}\n')
    assert main(["train-drafter", "--model", tiny_dir, "--prompts", str(bad), "-o", str(out)]) == 2
    assert "line 1: prompt_token_ids must be a non-empty list of integers" in capsys.readouterr().err
    assert main(["train-drafter", "--model", tiny_dir, "--prompts", str(tmp_path / "none.jsonl"), "-o", str(out)]) == 2
    assert "cannot read prompts file" in capsys.readouterr().err
    assert main(["train-drafter", "--model", tiny_dir, "-o", str(tmp_path / "no" / "dir" / "h.safetensors")]) == 2
    assert "is not a writable directory" in capsys.readouterr().err


def test_cli_draft_head_needs_speculate(capsys):
    from deepfuse.cli import main

    assert main(["generate", "--draft-head", "h.safetensors", "hello"]) == 2
    assert "--draft-head needs --speculate" in capsys.readouterr().err
