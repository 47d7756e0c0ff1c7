"""Artifact loader: verifies a directory written by CompiledModel.save and runs it.

Checks format version, deepfuse version, target and the sha256 of every file before
reading anything else; runs no compiler. Every refusal is a one-line DeepfuseError.
"""
from __future__ import annotations

import json
import os

from safetensors.torch import load_file

from .. import __version__
from ..codegen import get_target
from ..codegen.artifact import FORMAT_VERSION, CompiledModel, sha256_file
from ..errors import DeepfuseError
from ..ir import parse_graph, verify
from ..models.llama import LlamaConfig
from .tokenizer import Tokenizer


def read_manifest(directory: str) -> dict:
    path = os.path.join(directory, "manifest.json")
    if not os.path.isdir(directory):
        raise DeepfuseError(f"artifact directory not found: {directory}")
    if not os.path.isfile(path):
        raise DeepfuseError(f"{directory} is not a deepfuse artifact (no manifest.json); create one with `deepfuse compile`")
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise DeepfuseError(f"{path} is corrupt ({e}); recompile the artifact") from None


def check_manifest(m: dict, directory: str, target: str | None) -> None:
    if m.get("format_version") != FORMAT_VERSION:
        raise DeepfuseError(f"artifact {directory} has format version {m.get('format_version')}, this deepfuse "
                            f"reads {FORMAT_VERSION}; recompile it")
    if m.get("deepfuse_version") != __version__:
        raise DeepfuseError(f"artifact {directory} was built by deepfuse {m.get('deepfuse_version')}, this is "
                            f"{__version__}; recompile it")
    if target is not None and m.get("target") != target:
        raise DeepfuseError(f"artifact {directory} is for target {m.get('target')!r}, not {target!r}")
    for name, digest in m.get("files", {}).items():
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise DeepfuseError(f"artifact {directory} is missing {name}; recompile it")
        if sha256_file(path) != digest:
            raise DeepfuseError(f"artifact file {path} does not match its sha256 in manifest.json "
                                "(modified or corrupt); recompile it")


def load(directory: str, target: str | None = None) -> CompiledModel:
    """Loads a verified artifact. `target` (optional) must match the artifact's."""
    m = read_manifest(directory)
    check_manifest(m, directory, target)
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
    return CompiledModel(graph, plan, m["target"], m["dtype"], LlamaConfig.from_dict(m["model"]["config"]),
                         tok, tgt.make_runner(plan, graph.weights, files), m["passes"], m.get("quant"), files)
