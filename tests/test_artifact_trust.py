"""Artifacts check everything loading reads: the directory holds exactly the files the
manifest lists, each with its sha256, and a digest of the manifest pins the whole artifact.
Each tampering case is refused with one line naming the file, on a CPU and an sm90 artifact."""
import json
import os
import shutil

import pytest

import deepfuse
from deepfuse.codegen.artifact import artifact_digest
from deepfuse.errors import DeepfuseError


@pytest.fixture(scope="module", params=["cpu", "sm90"])
def artifact(request, tiny_model, tmp_path_factory):
    art = deepfuse.compile(tiny_model, target=request.param)
    return art.save(str(tmp_path_factory.mktemp(request.param) / "art"))


def clone(src: str, dst) -> str:
    """A copy of the artifact whose files are hard links (edit() breaks a link before writing)."""
    shutil.copytree(src, dst, copy_function=os.link)
    return str(dst)


def edit(path: str, change) -> None:
    data = open(path, "rb").read()
    os.remove(path)
    with open(path, "wb") as f:
        f.write(change(data))


def edit_manifest(d: str, change) -> None:
    m = json.loads(open(os.path.join(d, "manifest.json")).read())
    change(m)
    edit(os.path.join(d, "manifest.json"), lambda _: json.dumps(m).encode())


def refused(d: str, match: str, **kw) -> None:
    with pytest.raises(DeepfuseError, match=match) as e:
        deepfuse.load(d, **kw)
    assert "\n" not in str(e.value)


def test_an_untouched_artifact_loads_and_lists_every_file(artifact):
    m = json.loads(open(os.path.join(artifact, "manifest.json")).read())
    on_disk = {os.path.relpath(os.path.join(r, n), artifact) for r, _, ns in os.walk(artifact) for n in ns}
    assert on_disk - {"manifest.json"} == set(m["files"])
    loaded = deepfuse.load(artifact, digest=artifact_digest(artifact))
    assert loaded.target == m["target"]


def test_removing_the_files_list_or_an_entry_is_refused(artifact, tmp_path):
    d = clone(artifact, tmp_path / "nofiles")
    edit_manifest(d, lambda m: m.pop("files"))
    refused(d, "manifest.json has no valid 'files'")
    names = json.loads(open(os.path.join(artifact, "manifest.json")).read())["files"]
    for name in ["graph.ir", "plan.json", "weights.safetensors"] + [n for n in names if n.startswith("kernels/")][:1]:
        d = clone(artifact, tmp_path / f"drop-{name.replace('/', '-')}")
        edit_manifest(d, lambda m, name=name: m["files"].pop(name))
        refused(d, f"(does not list {name}|holds {name}, which manifest.json does not list)")


def test_an_added_file_is_refused(artifact, tmp_path):
    for name in ("extra.txt", "kernels/extra.py"):
        d = clone(artifact, tmp_path / name.replace("/", "-"))
        os.makedirs(os.path.dirname(os.path.join(d, name)), exist_ok=True)
        open(os.path.join(d, name), "w").write("import os\n")
        refused(d, f"holds {name}, which manifest.json does not list")


def test_a_missing_or_altered_file_is_refused(artifact, tmp_path):
    names = json.loads(open(os.path.join(artifact, "manifest.json")).read())["files"]
    for name in ["graph.ir", "plan.json", "weights.safetensors"] + [n for n in names if n.startswith("kernels/")][:2]:
        tag = name.replace("/", "-")
        d = clone(artifact, tmp_path / f"missing-{tag}")
        os.remove(os.path.join(d, name))
        refused(d, f"is missing {name}")
        d = clone(artifact, tmp_path / f"altered-{tag}")
        edit(os.path.join(d, name), lambda b: b[:-1] + bytes([b[-1] ^ 1]))
        refused(d, f"{name} does not match its sha256")


def test_a_path_outside_the_artifact_is_refused(artifact, tmp_path):
    d = clone(artifact, tmp_path / "escape")
    edit_manifest(d, lambda m: m["files"].update({"../outside.ir": "0" * 64}))
    refused(d, r"is missing \.\./outside\.ir")


def test_the_digest_pins_the_manifest(artifact, tmp_path):
    digest = artifact_digest(artifact)
    assert digest.startswith("sha256:") and len(digest) == 71
    d = clone(artifact, tmp_path / "pinned")
    edit_manifest(d, lambda m: m.update(dtype=m["dtype"]))  # same content, other bytes: another artifact
    refused(d, "not the pinned", digest=digest)
    refused(artifact, "must be 'sha256:' and 64 hex digits", digest="abc")
    refused(artifact, "not the pinned", digest="sha256:" + "0" * 64)


def test_a_symbolic_link_or_a_malformed_manifest_is_refused(artifact, tmp_path):
    d = clone(artifact, tmp_path / "link")
    os.remove(os.path.join(d, "plan.json"))
    os.symlink(os.path.join(artifact, "plan.json"), os.path.join(d, "plan.json"))  # the same bytes, elsewhere
    refused(d, "holds plan.json, a symbolic link")
    for key in ("dtype", "model", "passes"):
        d = clone(artifact, tmp_path / f"no-{key}")
        edit_manifest(d, lambda m, key=key: m.pop(key))
        refused(d, f"manifest.json has no valid '{key}'")


def test_an_unknown_model_family_is_refused(artifact, tmp_path):
    d = clone(artifact, tmp_path / "family")
    edit_manifest(d, lambda m: m["model"].update(family="nosuch"))
    refused(d, r"model family 'nosuch' is unknown \(known: .*gemma3.*llama")
