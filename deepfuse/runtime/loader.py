"""Artifact loader: verifies a directory written by CompiledModel.save and runs it.

Before reading anything else it checks the manifest (against a pinned digest where one is
given), format version, deepfuse version and target, that the directory holds exactly the
files the manifest lists (graph.ir, plan.json and weights.safetensors among them), and the
sha256 of each; symbolic links are refused. Every refusal is a one-line DeepfuseError naming
the file. Files are hashed, then read: the directory must not change while it loads. What
loading then runs, per target, is in docs/artifact-format.md.
"""
from __future__ import annotations

import hashlib
import json
import os

from safetensors.torch import load_file

from .. import __version__
from ..codegen import get_target
from ..codegen.artifact import FORMAT_VERSION, CompiledModel, sha256_file
from ..errors import DeepfuseError
from ..ir import parse_graph, verify
from ..models import family_by_name
from .tokenizer import Tokenizer

REQUIRED = ("graph.ir", "plan.json", "weights.safetensors")  # read by every load


def read_manifest(directory: str, digest: str | None = None) -> dict:
    """The manifest, checked against `digest` ("sha256:<hex>" of manifest.json, as
    `deepfuse compile` prints it) when one is given."""
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise DeepfuseError(f"artifact directory not found: {directory}")
    if not os.path.isfile(path):
        raise DeepfuseError(f"{directory} is not a deepfuse artifact (no manifest.json); create one with `deepfuse compile`")
    with open(path, "rb") as f:
        data = f.read()
    if digest is not None:
        if not (isinstance(digest, str) and digest.startswith("sha256:") and len(digest) == 71):
            raise DeepfuseError(f"artifact digest must be 'sha256:' and 64 hex digits, got {digest!r}")
        actual = "sha256:" + hashlib.sha256(data).hexdigest()
        if actual != digest.lower():
            raise DeepfuseError(f"artifact {directory} has digest {actual}, not the pinned {digest}; "
                                "it is another or a modified artifact")
    try:
        m = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DeepfuseError(f"{path} is corrupt ({e}); recompile the artifact") from None
    if not isinstance(m, dict):
        raise DeepfuseError(f"{path} is corrupt (not a JSON object); recompile the artifact")
    return m


FIELDS = {"format_version": int, "deepfuse_version": str, "target": str, "dtype": str, "model": dict, "passes": list}


def check_manifest(m: dict, directory: str, target: str | None) -> None:
    for key, kind in FIELDS.items():
        if not isinstance(m.get(key), kind):
            raise DeepfuseError(f"artifact {directory}: manifest.json has no valid {key!r}; recompile it")
    if not isinstance(m["model"].get("config"), dict):
        raise DeepfuseError(f"artifact {directory}: manifest.json has no valid model config; recompile it")
    if m.get("format_version") != FORMAT_VERSION:
        raise DeepfuseError(f"artifact {directory} has format version {m.get('format_version')}, this deepfuse "
                            f"reads {FORMAT_VERSION}; recompile it")
    if m.get("deepfuse_version") != __version__:
        raise DeepfuseError(f"artifact {directory} was built by deepfuse {m.get('deepfuse_version')}, this is "
                            f"{__version__}; recompile it")
    if target is not None and m.get("target") != target:
        raise DeepfuseError(f"artifact {directory} is for target {m.get('target')!r}, not {target!r}")
    check_files(m.get("files"), directory)


def check_files(files: object, directory: str) -> None:
    """The directory holds exactly the listed files (REQUIRED among them), each with its sha256."""
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        raise DeepfuseError(f"artifact {directory}: manifest.json has no valid 'files' list of sha256s; recompile it")
    for name in REQUIRED + (("tokenizer_config.json",) if "tokenizer.json" in files else ()):
        if name not in files:
            raise DeepfuseError(f"artifact {directory}: manifest.json does not list {name}; recompile it")
    for name in present_files(directory):
        if name not in files:
            raise DeepfuseError(f"artifact {directory} holds {name}, which manifest.json does not list; "
                                "remove it or recompile the artifact")
    for name, digest in files.items():
        path = os.path.join(directory, name)
        if os.path.isabs(name) or ".." in name.split("/") or not os.path.isfile(path):
            raise DeepfuseError(f"artifact {directory} is missing {name}; recompile it")
        if sha256_file(path) != digest:
            raise DeepfuseError(f"artifact file {path} does not match its sha256 in manifest.json "
                                "(modified or corrupt); recompile it")


def present_files(directory: str) -> list[str]:
    """Every file under directory but manifest.json, as manifest names ("kernels/x.ptx"). A
    symbolic link anywhere in it is refused: what it points at is outside what was hashed."""
    out = []
    for root, dirs, names in os.walk(directory):
        for n in dirs + names:
            rel = os.path.relpath(os.path.join(root, n), directory).replace(os.sep, "/")
            if os.path.islink(os.path.join(root, n)):
                raise DeepfuseError(f"artifact {directory} holds {rel}, a symbolic link; an artifact holds only "
                                    "plain files (copy it with the files themselves)")
            if n in names and rel != "manifest.json":
                out.append(rel)
    return sorted(out)


def model_config(m: dict, directory: str):
    """The model config, read by the class of the manifest's model family (models/family.py)."""
    try:
        return family_by_name(m["model"].get("family", "llama")).config.from_dict(m["model"]["config"])
    except DeepfuseError as e:
        raise DeepfuseError(f"artifact {directory}: {e}") from None


def tensor_parallel_size(directory: str) -> int:
    """The ranks of a tensor-parallel artifact (`deepfuse compile --tp N`); 1 for any other."""
    try:
        with open(os.path.join(directory, "manifest.json")) as f:
            m = json.load(f)
    except (OSError, ValueError):
        return 1
    tp = m.get("tensor_parallel", 1) if isinstance(m, dict) else 1
    return tp if isinstance(tp, int) and tp >= 1 else 1


def load_rank(directory: str, rank: int, digest: str | None = None) -> CompiledModel:
    """Rank `rank`'s CompiledModel of a tensor-parallel artifact (sharded_compile.save_sharded),
    verified: the top manifest (against `digest` where given), the directory holding only the
    ranks' directories, and the rank's own artifact against the sha256 the top manifest lists."""
    m = read_manifest(directory, digest)
    world = m.get("tensor_parallel")
    ranks = m.get("ranks")
    if not (isinstance(world, int) and world >= 2 and isinstance(ranks, dict)
            and sorted(ranks) == sorted(f"rank{r}" for r in range(world))):
        raise DeepfuseError(f"{directory} is not a tensor-parallel artifact (manifest.json names no ranks); "
                            "create one with `deepfuse compile --tp N`")
    for key in ("format_version", "deepfuse_version"):
        if m.get(key) != {"format_version": FORMAT_VERSION, "deepfuse_version": __version__}[key]:
            raise DeepfuseError(f"artifact {directory} has {key} {m.get(key)!r}; recompile it")
    if not 0 <= rank < world:
        raise DeepfuseError(f"artifact {directory} has {world} ranks; there is no rank {rank}")
    extra = sorted(set(os.listdir(directory)) - set(ranks) - {"manifest.json"})
    if extra:
        raise DeepfuseError(f"artifact {directory} holds {extra[0]}, which manifest.json does not list; "
                            "remove it or recompile the artifact")
    name = f"rank{rank}"
    if os.path.islink(os.path.join(directory, name)):
        raise DeepfuseError(f"artifact {directory} holds {name}, a symbolic link; an artifact holds only plain files")
    return load(os.path.join(directory, name), digest="sha256:" + ranks[name])


def load(directory: str, target: str | None = None, digest: str | None = None) -> CompiledModel:
    """Loads a verified artifact. `target` (optional) must match the artifact's; `digest`
    (optional, "sha256:<hex>" as `deepfuse compile` prints it) pins the whole artifact."""
    m = read_manifest(directory, digest)
    if isinstance(m.get("tensor_parallel"), int) and m["tensor_parallel"] > 1:
        raise DeepfuseError(f"artifact {directory} is tensor-parallel ({m['tensor_parallel']} ranks): run it with "
                            f"tensor_parallel_size={m['tensor_parallel']} (`--tp {m['tensor_parallel']}`)")
    check_manifest(m, directory, target)
    config = model_config(m, directory)
    tgt = get_target(m["target"])
    with open(os.path.join(directory, "graph.ir")) as f:
        graph = parse_graph(f.read())
    graph.weights = load_file(os.path.join(directory, "weights.safetensors"))
    verify(graph)
    with open(os.path.join(directory, "plan.json")) as f:
        plan = json.load(f)
    tok = Tokenizer.load(directory) if "tokenizer.json" in m["files"] else None
    files = {}
    for name in m["files"]:
        if name.startswith("kernels/"):
            with open(os.path.join(directory, name), "rb") as f:
                files[name] = f.read()
    return CompiledModel(graph, plan, m["target"], m["dtype"], config,
                         tok, tgt.make_runner(plan, graph.weights, files), m["passes"], m.get("quant"), files)
