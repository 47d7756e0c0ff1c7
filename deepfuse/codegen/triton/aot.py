"""Ahead-of-time compilation of emitted kernels for sm90 / sm100 on a machine with no GPU:
triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32)) -> PTX and a cubin (the
triton wheel ships ptxas). Triton's own cache makes a second compile of the same kernel free.
"""
from __future__ import annotations

import hashlib
import json

from ...errors import DeepfuseError
from .runner import load_kernel

ARCHS = {"sm90": 90, "sm100": 100}


def pointer_params(spec: dict) -> list[str]:
    """The kernel's pointer parameters, which its cubin assumes 16-byte aligned (aligned_attrs)."""
    return [k for k, t in spec["signature"].items() if t.startswith("*")]


def aligned_attrs(aligned: list[str], arg_names: list[str]) -> dict:
    """Triton's divisibility hints for the pointer parameters named in `aligned`: each is compiled as a
    multiple of 16 bytes, as Triton's JIT specializes them when they are (the runner checks it
    before it launches the cubin). Without them the compiler cannot prove any alignment: the
    GEMMs load every element alone, with no cp.async pipeline (PTX); on an H200, the engine's
    GEMMs from such cubins took 3-10x the JIT build's time (docs/targets.md)."""
    return {(arg_names.index(k),): [["tt.divisibility", 16]] for k in aligned}


def compile_spec(spec: dict, arch: str, where: str) -> dict[str, bytes]:
    """Files for one kernel: {name}.py (source), .ptx, .cubin, .json (launch metadata).
    `where` names the IR node, for the error a failing kernel gets."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    try:
        fn = JITFunction(load_kernel(spec, jit=False))
        src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"],
                        attrs=aligned_attrs(pointer_params(spec), fn.arg_names))
        k = triton.compile(src, target=GPUTarget("cuda", ARCHS[arch], 32),
                           options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"],
                                    "enable_fp_fusion": spec.get("fp_fusion", True)})
    except Exception as e:  # triton raises CompilationError, RuntimeError, ...: all become one message
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise DeepfuseError(f"Triton kernel {spec['name']} for {where} failed to compile for {arch}: {first}") from e
    meta = {"name": k.name, "num_warps": k.metadata.num_warps, "shared": k.metadata.shared,
            "arch": arch, "signature": spec["signature"], "constexprs": spec["constexprs"],
            "source_sha256": hashlib.sha256(spec["source"].encode()).hexdigest(), "triton_version": triton.__version__,
            "aligned_16": pointer_params(spec),
            # Triton's own metadata, as its cache writes it: what loading the cubin needs (runner.load_binary)
            "triton": json.loads(json.dumps(k.metadata._asdict(), default=vars))}
    stem = spec["name"]
    return {f"{stem}.py": spec["source"].encode(), f"{stem}.ptx": k.asm["ptx"].encode(), f"{stem}.cubin": k.asm["cubin"],
            f"{stem}.json": json.dumps(meta, indent=1).encode()}


def compile_all(jobs: list[tuple[dict, str]], arch: str, workers: int = 2) -> dict[str, bytes]:
    """Compiles (spec, where) jobs in `workers` child processes (python -m this module), started
    without TRITON_INTERPRET: Triton reads it once at import, and a process that interprets
    kernels cannot also compile them. Returns the files of every kernel."""
    import os
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    files: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as out:
        procs = []
        for w in range(max(1, min(workers, len(jobs)))):
            share = jobs[w::workers]
            p = subprocess.Popen([sys.executable, "-m", "deepfuse.codegen.triton.aot"], stdin=subprocess.PIPE,
                                 stderr=subprocess.PIPE, env=env, text=True)
            p.stdin.write(json.dumps({"arch": arch, "jobs": share, "out": out}))
            p.stdin.close()
            procs.append(p)
        errors = [p.stderr.read().strip() for p in procs]
        for p, err in zip(procs, errors):
            if p.wait() != 0:
                last = [line for line in err.splitlines() if line.startswith("deepfuse:")] or err.splitlines()[-1:]
                raise DeepfuseError(last[-1].removeprefix("deepfuse: ") if last else "kernel compiler failed")
        for name in os.listdir(out):
            with open(os.path.join(out, name), "rb") as f:
                files[name] = f.read()
    return files


def main() -> None:
    import os
    import sys
    import warnings

    warnings.filterwarnings("ignore")
    req = json.load(sys.stdin)
    try:
        for spec, where in req["jobs"]:
            for name, data in compile_spec(spec, req["arch"], where).items():
                with open(os.path.join(req["out"], name), "wb") as f:
                    f.write(data)
    except DeepfuseError as e:
        print(f"deepfuse: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
