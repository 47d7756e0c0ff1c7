"""CompiledModel (an artifact in memory) and its writer.

Directory layout:
    manifest.json        format/deepfuse version, target, dtype, quant, model config, pass ids, sha256 of every file
    graph.ir             the final IR as text
    plan.json            the target's launch plan
    kernels/             compiled targets' kernels: source, PTX, cubin, launch metadata (sm90/sm100)
    weights.safetensors  params of the final graph
    tokenizer.json, tokenizer_config.json
No pickle. What is code, per target (kernel sources, cubins) and what loading runs: docs/artifact-format.md.
The manifest lists every other file with its sha256; `artifact_digest` (sha256 of manifest.json)
pins the whole artifact.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field

import torch
from safetensors.torch import save_file

from .. import __version__
from ..ir import Graph, TensorType, print_graph
from ..ir.opdefs_ep import with_ep_rows
from ..models.family import ModelConfig
from ..runtime.tokenizer import Tokenizer
from .targets import Runner

FORMAT_VERSION = 3  # 2: the step takes draft_tokens and verifies drafts (spec_verify); 3: it returns hidden rows


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def artifact_digest(directory: str) -> str:
    """"sha256:<hex>" of the artifact's manifest.json, which holds the sha256 of every other file."""
    return "sha256:" + sha256_file(os.path.join(directory, "manifest.json"))


@dataclass
class CompiledModel:
    graph: Graph
    plan: dict
    target: str
    dtype: str
    config: ModelConfig  # the family's config (models/family.py)
    tokenizer: Tokenizer | None
    runner: Runner
    passes: list[dict] = field(default_factory=list)  # [{name, id, seconds, nodes_before, nodes_after}]
    quant: str | None = None
    files: dict[str, bytes] = field(default_factory=dict)  # target binaries, relative path -> bytes
    _ep_rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # by T (with_ep_rows)

    @property
    def batch_invariant(self) -> bool:
        """Whether it was compiled to run one kernel per op for every batch shape."""
        return bool(self.plan.get("batch_invariant"))

    @property
    def kv_cache_type(self) -> TensorType:
        """The type of each layer's cache input ([2,N,BS,Hkv,row]; dtype i8 for an int8 cache)."""
        return next(v.type for v in self.graph.inputs if v.name.startswith("kv_cache."))

    @property
    def kv_cache_dtype(self) -> str | None:
        """None (caches of the model dtype) or "int8", as compile() was given it."""
        return "int8" if self.kv_cache_type.dtype == "i8" else None

    @property
    def device(self) -> torch.device:
        """Where the step's kernels run and its KV cache must live: the GPU for an sm90/sm100
        artifact on a GPU, else the CPU."""
        return getattr(self.runner, "device", torch.device("cpu"))

    def __call__(self, inputs: dict) -> list:
        if "ep_rows" in self.plan:  # a rank whose MoE takes its own token rows (ir/opdefs_ep.py)
            inputs = with_ep_rows(inputs, *self.plan["ep_rows"], self._ep_rows)
        return self.runner(inputs)

    def rerun(self, inputs: dict) -> list | None:
        """The last call's step again over its inputs (that call's dict), their contents rewritten
        in place (the CPU executor's rerun); None where this runner cannot (nothing ran): call it
        afresh."""
        rerun = getattr(self.runner, "rerun", None)
        return None if rerun is None or "ep_rows" in self.plan else rerun(inputs)

    def save(self, directory: str) -> str:
        """Writes the artifact directory; returns its path."""
        os.makedirs(directory, exist_ok=True)
        files = ["graph.ir", "plan.json", "weights.safetensors"]
        with open(os.path.join(directory, "graph.ir"), "w") as f:
            f.write(print_graph(self.graph))
        with open(os.path.join(directory, "plan.json"), "w") as f:
            json.dump(self.plan, f)
        weights = {k: v.contiguous() for k, v in self.graph.weights.items()}
        save_file(weights, os.path.join(directory, "weights.safetensors"))
        if self.tokenizer is not None:
            files += self.tokenizer.save(directory)
        for name, data in sorted(self.files.items()):
            os.makedirs(os.path.dirname(os.path.join(directory, name)), exist_ok=True)
            with open(os.path.join(directory, name), "wb") as f:
                f.write(data)
            files.append(name)
        manifest = {
            "format_version": FORMAT_VERSION,
            "deepfuse_version": __version__,
            "target": self.target,
            "dtype": self.dtype,
            "quant": self.quant,
            "kv_cache_dtype": self.kv_cache_dtype,
            "batch_invariant": self.batch_invariant,
            "model": {"family": self.config.family, "config": self.config.to_dict()},
            "passes": [{"name": p["name"], "id": p["id"]} for p in self.passes],
            # ops that run their reference, not a kernel of the target
            "host_steps": self.plan.get("host_steps", []),
            "files": {name: sha256_file(os.path.join(directory, name)) for name in files},
        }
        with open(os.path.join(directory, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        return directory
