"""The CLI: bad input gets one line on stderr and exit code 2; good input streams text."""
import json
import os
import subprocess
import sys

import pytest

from deepfuse.cli import main
from deepfuse.models import smollm2_gguf_path


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def last_line(err: str) -> str:
    return [ln for ln in err.splitlines() if ln.strip()][-1]


@pytest.mark.parametrize("argv,message", [
    (["generate", "--model", "nope", "hi"], "error: unknown model 'nope'"),
    (["generate", "--model", "/no/such/model.gguf", "hi"], "error: GGUF file not found: /no/such/model.gguf"),
    (["compile", "--target", "tpu9", "-o", "/tmp/x"], "error: unknown target 'tpu9' (available: ascend950, cpu, sm100, sm90)"),
    (["generate", "--artifact", "/no/such/dir", "hi"], "error: artifact directory not found"),
    (["compile", "--target", "ascend950", "--batch-invariant", "-o", "/tmp/x"],
     "error: batch_invariant is implemented for the cpu, sm90, sm100 targets, not 'ascend950'"),
    (["serve", "--model", "nope"], "error: unknown model 'nope'"),
    (["serve", "--port", "0"], "error: --port must be >= 1"),
    (["serve", "--artifact-digest", "sha256:00"], "error: --artifact-digest pins an artifact"),
    (["serve", "--kv-store-gb", "2"], "error: --kv-store-gb sizes the disk store"),
    (["serve", "--replicas", "0"], "error: --replicas must be >= 1"),
    (["serve", "--decode-steps", "0"], "error: --decode-steps must be >= 1"),
    (["serve", "--replicas", "2", "--kv-store", "/tmp/x"], "error: --kv-store with --replicas"),
])
def test_bad_input_one_line_exit_2(capsys, argv, message):
    rc, out, err = run_main(capsys, *argv)
    assert rc == 2 and out == ""
    assert last_line(err).startswith(message)
    assert "Traceback" not in err


def test_hf_dir_without_tokenizer(capsys, tiny_dir):
    rc, out, err = run_main(capsys, "generate", "--model", tiny_dir, "hi")
    assert rc == 2 and out == "" and "has no usable tokenizer" in last_line(err)


def test_truncated_gguf(capsys, tmp_path):
    data = open(smollm2_gguf_path(), "rb").read()
    bad = tmp_path / "trunc.gguf"
    bad.write_bytes(data[: len(data) // 3])
    rc, _, err = run_main(capsys, "generate", "--model", str(bad), "hi")
    assert rc == 2 and "is truncated or corrupt" in last_line(err)
    notgguf = tmp_path / "x.gguf"
    notgguf.write_bytes(b"hello world")
    rc, _, err = run_main(capsys, "generate", "--model", str(notgguf), "hi")
    assert rc == 2 and "is not a GGUF file" in last_line(err)


@pytest.fixture(scope="module")
def compiled_dir(tmp_path_factory):
    """(artifact directory, what `deepfuse compile` printed on stdout)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("art") / "smollm2-cpu"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["compile", "--model", "smollm2", "--target", "cpu", "-o", str(out)]) == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def artifact_dir(compiled_dir):
    return compiled_dir[0]


def test_compile_prints_the_digest_and_generate_checks_it(capsys, compiled_dir, tmp_path):
    from tests.test_artifact_trust import clone, edit

    d, printed = compiled_dir
    digest = printed.split("artifact digest: ")[1].split()[0]
    assert digest.startswith("sha256:") and len(digest) == 71
    rc, out, err = run_main(capsys, "generate", "--artifact", str(d), "--artifact-digest", digest, "--no-chat",
                            "--max-tokens", "4", "--temperature", "0", "The capital of France is")
    assert rc == 0 and "Paris" in out
    other = clone(str(d), tmp_path / "other")
    edit(os.path.join(other, "manifest.json"), lambda b: b + b"\n")
    rc, out, err = run_main(capsys, "generate", "--artifact", other, "--artifact-digest", digest, "hi")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "not the pinned" in err
    rc, out, err = run_main(capsys, "generate", "--artifact-digest", digest, "hi")
    assert rc == 2 and "--artifact-digest pins an artifact" in err


def test_each_tampered_artifact_exits_2_with_one_line(capsys, artifact_dir, tmp_path):
    from tests.test_artifact_trust import clone, edit, edit_manifest

    cases = {"files list dropped": lambda d: edit_manifest(d, lambda m: m.pop("files")),
             "entry dropped": lambda d: edit_manifest(d, lambda m: m["files"].pop("plan.json")),
             "file added": lambda d: open(os.path.join(d, "notes.txt"), "w").write("x"),
             "file missing": lambda d: os.remove(os.path.join(d, "graph.ir")),
             "file altered": lambda d: edit(os.path.join(d, "tokenizer_config.json"), lambda b: b.replace(b"{", b"{ ", 1))}
    for name, tamper in cases.items():
        d = clone(str(artifact_dir), tmp_path / name.replace(" ", "-"))
        tamper(d)
        rc, out, err = run_main(capsys, "generate", "--artifact", d, "hi")
        assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, name
        assert err.startswith("error: artifact") and "Traceback" not in err, name


def test_generate_from_artifact_and_prompt_too_long(capsys, artifact_dir):
    rc, out, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--no-chat", "--max-tokens", "8",
                            "The three primary colors are")
    assert rc == 0 and out == " the primary colors of the RGB color model\n"
    assert "compiling" not in err  # loaded, not recompiled
    rc, out, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--no-chat", "word " * 9000)
    assert rc == 2 and out == "" and "exceeds the context (max_model_len 8192)" in last_line(err)
    rc, _, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--temperature", "-1", "hi")
    assert rc == 2 and "temperature must be a finite number >= 0" in last_line(err)
    rc, out, _ = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--no-chat", "--max-tokens", "8",
                          "--decode-steps", "1", "The three primary colors are")  # token by token: the same text
    assert rc == 0 and out == " the primary colors of the RGB color model\n"
    rc, _, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--decode-steps", "0", "hi")
    assert rc == 2 and "decode_steps must be an integer >= 1" in last_line(err)
    rc, out, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--no-chat", "--max-tokens", "8",
                            "--speculate", "4", "The three primary colors are")
    assert rc == 0 and out == " the primary colors of the RGB color model\n" and "drafts accepted" in err
    rc, _, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--speculate", "-2", "hi")
    assert rc == 2 and "num_draft_tokens must be >= 1" in last_line(err)
    # streamed output stops before a stop string: nothing of it is printed, even in part
    rc, out, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--no-chat", "--max-tokens", "8",
                            "--stop", "zz", "--stop", "color model", "The three primary colors are")
    assert rc == 0 and out == " the primary colors of the RGB \n" and "finish: stop" in err
    rc, out, _ = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--no-chat", "--max-tokens", "8",
                          "--repetition-penalty", "1.5", "The three primary colors are")
    assert rc == 0 and out.startswith(" ") and out != " the primary colors of the RGB color model\n"
    rc, _, err = run_main(capsys, "generate", "--artifact", str(artifact_dir), "--repetition-penalty", "0", "hi")
    assert rc == 2 and "repetition_penalty must be a finite number > 0" in last_line(err)


def test_tampered_and_foreign_artifacts_refused(capsys, artifact_dir, tmp_path):
    import shutil

    import deepfuse
    from deepfuse.errors import DeepfuseError

    def copy(name):
        d = tmp_path / name
        shutil.copytree(artifact_dir, d)
        return d

    d = copy("tampered")
    with open(d / "plan.json", "a") as f:
        f.write(" ")
    with pytest.raises(DeepfuseError, match="plan.json does not match its sha256"):
        deepfuse.load(str(d))
    d = copy("missing")
    os.remove(d / "weights.safetensors")
    with pytest.raises(DeepfuseError, match="missing weights.safetensors"):
        deepfuse.load(str(d))
    for key, value, msg in [("deepfuse_version", "0.0.1", "built by deepfuse 0.0.1"),
                            ("format_version", 99, "format version 99"),
                            ("target", "sm100", "is for target 'sm100', not 'cpu'")]:
        d = copy(key)
        m = json.loads((d / "manifest.json").read_text())
        m[key] = value
        (d / "manifest.json").write_text(json.dumps(m))
        with pytest.raises(DeepfuseError, match=msg):
            deepfuse.load(str(d), target="cpu")
    m = json.loads((artifact_dir / "manifest.json").read_text())
    assert m["target"] == "cpu" and len(m["passes"]) >= 6 and set(m["files"]) >= {"graph.ir", "weights.safetensors"}


def test_subprocess_error_has_no_traceback():
    r = subprocess.run([sys.executable, "-m", "deepfuse.cli", "compile", "--target", "nope", "-o", "/tmp/x"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: unknown target 'nope' (available: ascend950, cpu, sm100, sm90)"


def test_ir_dump_dir(capsys, tmp_path):
    rc, out, err = run_main(capsys, "ir", "--dump-dir", str(tmp_path / "ir"))
    assert rc == 0
    files = os.listdir(tmp_path / "ir")
    assert "04-fuse_sibling_linears.after.ir" in files and "kernels.txt" in files
    (swiglu,) = [f for f in files if f.endswith("-fuse_swiglu.after.ir")]
    after = (tmp_path / "ir" / swiglu).read_text()
    assert after.count("= swiglu(") == 30


def test_ir_stats_shows_rules_and_kernels(capsys, tiny_dir):
    rc, out, err = run_main(capsys, "ir", "--model", tiny_dir, "--stats")
    assert rc == 0
    assert "fuse_add_rms_norm" in out and "add_rms_norm x4" in out and "swiglu x2" in out
    assert "kernels per step:" in out.splitlines()[-1]


def test_compile_int4_artifact(capsys, tmp_path):
    rc, out, err = run_main(capsys, "compile", "--dtype", "bf16", "--quant", "int4", "-o", str(tmp_path / "q"))
    assert rc == 0
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    assert manifest["quant"] == "int4" and any(p["name"] == "quantize_int4" for p in manifest["passes"])
    assert manifest["batch_invariant"] is False


def test_compile_batch_invariant_artifact(capsys, tmp_path):
    rc, out, err = run_main(capsys, "compile", "--batch-invariant", "-o", str(tmp_path / "bi"))
    assert rc == 0
    assert json.loads((tmp_path / "bi" / "manifest.json").read_text())["batch_invariant"] is True
    assert json.loads((tmp_path / "bi" / "plan.json").read_text())["batch_invariant"] is True
