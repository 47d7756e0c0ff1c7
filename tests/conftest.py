"""Shared fixtures: a tiny random Llama (saved as a HF checkpoint) and the real SmolLM2."""
from __future__ import annotations

import os
import shutil

# Triton reads this once, at import: its kernels run in the CPU interpreter in this test process
# (Triton's own debug switch; AOT compiles run in child processes without it)
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import deepfuse  # noqa: E402
from deepfuse.models import load_model  # noqa: E402


def tiny_hf_config(**over):
    from transformers import LlamaConfig

    kw = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(over)
    return LlamaConfig(**kw)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random-weight Llama checkpoint directory written by transformers."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_hf_config()).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model(tiny_dir):
    model, _ = load_model(tiny_dir, with_tokenizer=False)
    return model


@pytest.fixture(scope="session")
def smollm2():
    """(Llama, Tokenizer) of the embedded SmolLM2-135M-Instruct, fp32."""
    return load_model("smollm2")


@pytest.fixture(scope="session")
def smollm2_compiled(smollm2):
    model, tok = smollm2
    return deepfuse.compile(model, target="cpu", tokenizer=tok)


def has_compiler() -> bool:
    return shutil.which("c++") is not None or shutil.which("g++") is not None


@pytest.fixture(scope="session")
def native():
    """The native CPU kernels' module (codegen/cpu/native.py). Where there is a C++ compiler (and
    always under CI=true) a library that fails to build, or that its self-check refuses, fails
    the tests that use it; only a machine without a compiler skips them."""
    from deepfuse.codegen.cpu import native as native_module

    mod = native_module.kernels()
    if mod is None:
        why = f"the native CPU kernels are unavailable: {native_module.build_error}"
        if has_compiler() or CI:
            pytest.fail(why)
        pytest.skip("no C++ compiler here")
    return mod


CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# the AscendC emulator's tests: skipped without g++, which CI=true turns into a failure (below)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="the AscendC emulator needs g++")
# skips that mean a part of the project did not build or is missing, never acceptable in CI
MISSING_TOOL = ("compiler", "g++", "cmake", "emulator", "could not be built", "failed to build")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skip for a missing compiler, g++, cmake or the emulator is a failure."""
    outcome = yield
    report = outcome.get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
        if any(word in reason for word in MISSING_TOOL):
            report.outcome = "failed"
            report.longrepr = f"CI=true: a skip for a missing tool fails the suite ({reason})"


def pytest_terminal_summary(terminalreporter):
    """The skip count with its reasons, one line each, at the very end."""
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons: dict[str, int] = {}
    for r in skipped:
        reason = str(r.longrepr[-1] if isinstance(r.longrepr, tuple) else r.longrepr).removeprefix("Skipped: ")
        reasons[reason] = reasons.get(reason, 0) + 1
    terminalreporter.write_line(f"{len(skipped)} skipped:")
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"  {n:4d}  {reason}")


@pytest.fixture(scope="session")
def swa_model(tiny_dir, tmp_path_factory):
    """The tiny model as a Mistral-style checkpoint with a sliding window of 8."""
    import json
    import shutil

    from deepfuse.models import load_model

    d = tmp_path_factory.mktemp("swa") / "ckpt"
    shutil.copytree(tiny_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=8)
    (d / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(str(d), with_tokenizer=False)
    return model
