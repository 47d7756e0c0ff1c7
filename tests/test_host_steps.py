"""No silent host steps: an op with no ascend950 kernel (neither a template nor a decomposition into
ops with kernels) makes compile() refuse, naming it; allowed, the plan, the manifest and
CompiledGraph.launches say it runs its reference. The cpu target just lists such ops."""
from __future__ import annotations

import json

import pytest
import torch

import deepfuse
from deepfuse.errors import DeepfuseError
from deepfuse.frontend import Spec, ops, trace
from deepfuse.ir import interpret
from tests.conftest import needs_gxx


def graph():
    return trace(lambda x, y: ops.exp(ops.concat(x, y, axis=-1)), Spec("x", "f32", ("T", 8)),
                 Spec("y", "f32", ("T", 8)))


@needs_gxx
def test_ascend950_refuses_host_steps_unless_allowed():
    with pytest.raises(DeepfuseError, match=r"1 op\(s\) would run on the host.*concat.*allow_host_steps=True"):
        deepfuse.compile(graph(), target="ascend950")
    f = deepfuse.compile(graph(), target="ascend950", allow_host_steps=True)
    assert [p["kind"] for p in f.launches] == ["reference", "generated"]
    assert [s["op"] for s in f.host_steps] == ["concat"] and "no kernel for concat" in f.host_steps[0]["why"]
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(f(x, y), interpret(graph(), {"x": x, "y": y})[0])


def test_a_model_artifact_lists_its_host_steps_in_the_manifest(tmp_path, tiny_model):
    art = deepfuse.compile(tiny_model, target="cpu")
    art.save(str(tmp_path))
    manifest = json.load(open(tmp_path / "manifest.json"))
    assert manifest["host_steps"] == art.plan["host_steps"]
    assert {s["op"] for s in manifest["host_steps"]} <= {"spec_verify", "take_rows"}  # torch references on the CPU
