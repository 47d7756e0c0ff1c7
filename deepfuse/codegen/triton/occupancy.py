"""What an sm90/sm100 plan launches and what its compiled kernels use, read without a GPU.

- `decode_launches(plan, seqs, context)`: for a decode step of `seqs` one-token sequences at
  `context` keys each, every kernel the runner would launch (its `when` holds) with its grid,
  from meta tensors of the step's shapes and of the scratch its symbolic dims give (nothing is
  allocated or run). Split-KV kernels also report their working programs: partitions past a
  sequence's keys return at once.
- `ptx_loads(ptx)`: the global loads of a kernel's PTX by instruction (ld.global widths,
  cp.async sizes) and its tensor-core MMA instruction.
- `ptxas_usage(ptx, arch)`: registers, spill bytes and stack frame, from Triton's own ptxas
  run with -v on the PTX (the cubin's compiler; its CompiledKernel.n_regs / n_spills are only
  filled when the cubin is loaded on a GPU).
Owns no plan state; reads plans and compiled files only.
"""
from __future__ import annotations

import re
import subprocess
import tempfile

import torch

from .runner import bind, grid_of, launched, sizes_of

ARCH_CC = {"sm90": 90, "sm100": 100}


def _meta_inputs(p: dict, env: dict[str, int]) -> list[torch.Tensor]:
    """The launch's inputs as f32 meta tensors of the step's shapes (only shapes are read)."""
    return [torch.empty([env[d] if isinstance(d, str) else d for d in shape], device="meta") for shape in p["in_shape"]]


def split_kv_working(spec: dict, context: int) -> int:
    """Partitions of split_kv.py's geometry that hold keys for a one-query sequence of `context`
    keys, no window (per = cdiv(cdiv(context, P), KT) * KT keys each)."""
    z = spec["sizing"]
    cdiv = lambda a, b: -(-a // b)
    per = cdiv(cdiv(context, z["partitions"]), z["keys"]) * z["keys"]
    return cdiv(context, per)


def decode_launches(plan: dict, seqs: int, context: int, block_size: int = 16) -> list[dict]:
    """One row per launched kernel of a plain decode step: node, op, kernel, grid, ctas, and
    `working` (programs with work; split-KV only, else the CTAs)."""
    blocks = -(-context // block_size)
    env = {"T": seqs, "S": seqs, "R": seqs, "B": blocks, "N": seqs * blocks + 1, "NW": seqs * blocks + 1,
           "BS": block_size}
    rows = []
    for p in plan["launches"]:
        if not p.get("kernels"):
            continue
        ins = _meta_inputs(p, env)
        outs = [torch.empty(s, device="meta") for s in sizes_of(p["out_shape"], ins, p["in_shape"])]
        tmps = [torch.empty([d if isinstance(d, int) else bind(d, ins, [], []) for d in t["dims"]], device="meta")
                if "dims" in t else None for t in p.get("tmps", [])]
        for spec in p["kernels"]:
            if not launched(spec, ins):
                continue
            grid = grid_of(spec, ins, outs, tmps)
            ctas = grid[0] * grid[1] * grid[2]
            working = ctas
            if spec.get("sizing", {}).get("partitions"):
                working = grid[0] * grid[1] * split_kv_working(spec, context)
            rows.append({"node": p["node"], "op": p["op"], "kernel": spec["name"], "grid": list(grid), "ctas": ctas,
                         "working": working})
    return rows


def ptx_loads(ptx: str) -> dict:
    """{"mma": "wgmma" | "tcgen05" | "mma.sync" | None, "loads": {instruction: count}} where an
    ld.global is named by its vector width and type (ld.global.v4.b32, ld.global.b16) and a
    cp.async by its byte count (cp.async.16)."""
    loads: dict[str, int] = {}
    for m in re.finditer(r"\bld\.global((?:\.\w+)*)\s", ptx):
        mods = [x for x in m.group(1).split(".") if x and (x[0] in "vbsuf" and x[1:].isdigit())]
        key = "ld.global." + ".".join(mods)
        loads[key] = loads.get(key, 0) + 1
    for m in re.finditer(r"\bcp\.async\.c[ag]\.shared\.global[^;]*?,\s*(0x[0-9a-f]+|\d+)\s*[,;]", ptx):
        key = f"cp.async.{int(m.group(1), 0)}"
        loads[key] = loads.get(key, 0) + 1
    mma = "tcgen05" if "tcgen05.mma" in ptx else "wgmma" if "wgmma.mma_async" in ptx else \
        "mma.sync" if re.search(r"\bmma\.sync", ptx) else None
    return {"mma": mma, "loads": loads}


def scalar_loads(loads: dict[str, int], widths: tuple[int, ...] = (8, 16)) -> int:
    """How many ld.global of one element of `widths` bits (not vectors): element data read one
    by one. 32- and 64-bit scalars are left out: indices, lengths and per-row values."""
    return sum(n for k, n in loads.items() if k.startswith("ld.global.") and not k.split(".")[2].startswith("v")
               and int(k.rsplit(".", 1)[1][1:]) in widths)


def ptxas_usage(ptx: str, arch: str) -> dict:
    """{"registers", "spill_stores", "spill_loads", "stack"} of the PTX's kernel, from `ptxas -v`
    (Triton's ptxas for the arch)."""
    from triton.backends.nvidia.compiler import get_ptxas

    cc = ARCH_CC[arch]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run([get_ptxas(cc).path, "-v", f"--gpu-name=sm_{cc}a", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    if not (frame and regs):
        raise RuntimeError(f"unexpected ptxas -v output: {text[-400:]}")
    return {"registers": int(regs.group(1)), "stack": int(frame.group(1)), "spill_stores": int(frame.group(2)),
            "spill_loads": int(frame.group(3))}


__all__ = ["decode_launches", "ptx_loads", "ptxas_usage", "scalar_loads", "split_kv_working"]
