"""Runs a Triton plan: each launch's kernels (or its op's torch reference) over the step's tensors.

On a machine with an NVIDIA GPU of the artifact's architecture, the kernels are the artifact's
own cubins, loaded as Triton CompiledKernels (load_binary) and launched through Triton's
launcher; on a GPU of another architecture, or without binaries (a plan compiled for
"interpret"), they are JIT-built from their sources. Without a GPU they run in Triton's CPU
interpreter when the process started with TRITON_INTERPRET=1 (how the tests check them), and
calling the runner otherwise is refused with that advice.

A step's inputs on the host reach the device in one non-blocking copy (staging.py); a launch
without a kernel runs its op's torch stand-in (device_refs.py). Nothing here reads a value back.
"""
from __future__ import annotations

import linecache
import os
import tempfile

import torch

from ...errors import DeepfuseError
from ...ir import DTYPES
from .device_refs import reference
from .staging import Packer


def as_list(res) -> list:
    """An op's result (a tensor, or a tuple of them) as a list of outputs."""
    return list(res) if isinstance(res, (tuple, list)) else [res]


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def load_kernel(spec: dict, jit: bool = True):
    """The kernel function from its source; jit=False gives the undecorated function (for AOT)."""
    import triton

    filename = f"<deepfuse-triton:{spec['name']}>"
    linecache.cache[filename] = (len(spec["source"]), None, spec["source"].splitlines(True), filename)
    # a module name: Triton reads its helpers' __module__ (a kernel with @triton.jit helpers)
    ns: dict = {"__name__": f"deepfuse_kernel_{spec['name']}"}
    exec(compile(spec["source"].replace("@triton.jit\n", ""), filename, "exec"), ns)
    fn = ns[spec["name"]]
    return triton.jit(fn) if jit else fn


class Cubin:
    """An artifact's kernel: `kernel`, a Triton CompiledKernel; `aligned`, the positions among
    its launch arguments of the pointers it was compiled to assume 16-byte aligned (aot.py).
    A launch whose pointers are not goes to `jit()`, the same source built for them."""

    def __init__(self, kernel, spec: dict, aligned_names: list[str]):
        self.kernel, self.spec = kernel, spec
        params = [k for k, t in spec["signature"].items() if t != "constexpr"]
        self.aligned = [i for i, k in enumerate(params) if k in aligned_names]
        self._jit = None

    def fits(self, args: list) -> bool:
        return all(args[i].data_ptr() % 16 == 0 for i in self.aligned)

    def jit(self):
        if self._jit is None:
            self._jit = load_kernel(self.spec)
        return self._jit


def load_binary(spec: dict, binaries: dict[str, bytes], workdir: str) -> Cubin:
    """The artifact's cubin of `spec` as a Triton CompiledKernel: Triton's metadata from
    kernels/<name>.json, the cubin from kernels/<name>.cubin (both written to workdir, where
    CompiledKernel reads them), the source signature from the spec. Nothing touches a GPU until
    its first launch. Launch: cubin.kernel[grid](*args, *constexpr values)."""
    import json

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.jit import JITFunction

    from .aot import aligned_attrs

    name = spec["name"]
    meta = json.loads(binaries[f"kernels/{name}.json"])
    group = {}
    for ext, data in (("json", json.dumps(meta["triton"]).encode()), ("cubin", binaries[f"kernels/{name}.cubin"])):
        group[f"{name}.{ext}"] = os.path.join(workdir, f"{name}.{ext}")
        with open(group[f"{name}.{ext}"], "wb") as f:
            f.write(data)
    fn = JITFunction(load_kernel(spec, jit=False))
    aligned = meta.get("aligned_16", [])  # artifacts before the hints assume no alignment
    src = ASTSource(fn=fn, signature=spec["signature"], constexprs=spec["constexprs"],
                    attrs=aligned_attrs(aligned, fn.arg_names))
    if list(spec["signature"]) != src.fn.arg_names:  # the launcher packs arguments in signature order
        raise DeepfuseError(f"{name}: signature order {list(spec['signature'])} differs from the kernel's "
                            f"parameters {src.fn.arg_names}")
    kernel = CompiledKernel(src, group, meta["source_sha256"])
    want = GPUTarget("cuda", {"sm90": 90, "sm100": 100}[meta["arch"]], 32)
    if kernel.metadata.target != want or kernel.name != name:
        raise DeepfuseError(f"kernels/{name}.cubin is for {kernel.metadata.target} ({kernel.name}), expected {want}")
    return Cubin(kernel, spec, aligned)


def bind(form, ins: list[torch.Tensor], outs: list[torch.Tensor], tmps: list[torch.Tensor]):
    """The value of one argument form (see emit.py) for this launch."""
    kind = form[0]
    if kind == "in":
        return ins[form[1]]
    if kind == "out":
        return outs[form[1]]
    if kind == "tmp":
        return tmps[form[1]]
    if kind == "tmp_shape":
        return tmps[form[1]].shape[form[2]]
    if kind == "shape":
        return ins[form[1]].shape[form[2]]
    if kind == "stride":
        return ins[form[1]].stride(form[2])
    if kind == "half_numel":
        return ins[form[1]].numel() // 2
    if kind == "index":
        return ins[form[1]][form[2]]
    if kind == "const":
        return form[1]
    if kind in SIZE_OPS:  # scratch sizes: min(a, b), a * b, a + b, cdiv(a, b) (each an int or a form)
        a, b = (f if isinstance(f, int) else bind(f, ins, outs, tmps) for f in form[1:])
        return SIZE_OPS[kind](a, b)
    raise ValueError(f"unknown argument form {form!r}")


SIZE_OPS = {"min": min, "mul": lambda a, b: a * b, "add": lambda a, b: a + b, "cdiv": lambda a, b: -(-a // b)}
COMPARE = {"le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ne": lambda a, b: a != b}


def launched(spec: dict, ins: list[torch.Tensor]) -> bool:
    """Whether the launch runs this kernel: its `when` [op, form, form] (emit.py) holds for
    the step's shapes (no device value is read)."""
    if "when" not in spec:
        return True
    op, a, b = spec["when"]
    return COMPARE[op](*(f if isinstance(f, int) else bind(f, ins, [], []) for f in (a, b)))


def grid_of(spec: dict, ins, outs, tmps) -> tuple[int, int, int]:
    dims = []
    for g in spec["grid"]:
        if isinstance(g, int):
            dims.append(g)
        elif g[0] == "cdiv":
            dims.append(-(-bind(g[1], ins, outs, tmps) // g[2]))
        else:
            dims.append(bind(g, ins, outs, tmps))
    return tuple(dims)


def sizes_of(types: list[list], ins: list[torch.Tensor], in_types: list[list]) -> list[list[int]]:
    """Binds symbolic dims of `types` from the inputs' actual shapes."""
    env: dict[str, int] = {}
    for shape, t in zip(in_types, ins):
        for d, n in zip(shape, t.shape):
            if isinstance(d, str):
                env.setdefault(d, n)
    return [[env[d] if isinstance(d, str) else d for d in shape] for shape in types]


def gpu_arch() -> str | None:
    """"sm90" / "sm100" for the visible GPU (sm_90 / sm_100 capability), else None."""
    if not torch.cuda.is_available():
        return None
    return {(9, 0): "sm90", (10, 0): "sm100"}.get(torch.cuda.get_device_capability())


class TritonRunner:
    """plan: from build_plan; binaries: the artifact's kernels/* files (used when the GPU is of
    the plan's arch). `kernel_source` says what runs: "cubin", "jit", "interpret" or "none"."""

    def __init__(self, plan: dict, weights: dict[str, torch.Tensor], binaries: dict[str, bytes] | None = None):
        self.plan = plan
        # with its index: tensors report cuda:0, and torch.device("cuda") compares unequal to it;
        # Triton's interpreter runs on the CPU's tensors, GPU or not
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() and not interpreting() else torch.device("cpu")
        self.usable = self.device.type == "cuda" or interpreting()
        self.base: list = [None] * plan["num_slots"]
        for name, s in plan["params"].items():
            self.base[s] = weights[name].to(self.device)
        use_cubins = bool(binaries) and not interpreting() and gpu_arch() == plan["arch"]
        self.kernel_source = ("cubin" if use_cubins else "jit" if self.device.type == "cuda"
                              else "interpret" if interpreting() else "none")
        self.packer = Packer(self.device)
        self._workdir = tempfile.TemporaryDirectory(prefix="deepfuse-cubins-") if use_cubins else None
        self.launches = []
        for p in plan["launches"]:
            kernels = []
            if self.usable:
                for spec in p.get("kernels", []):
                    fn = load_binary(spec, binaries, self._workdir.name) if use_cubins else load_kernel(spec)
                    kernels.append((spec, fn))
            self.launches.append((p, kernels, reference(p["op"])))  # no host reads (device_refs.py)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        if not self.usable:
            raise DeepfuseError(f"this {self.plan['arch']} artifact runs on an NVIDIA GPU; none is visible (to run its "
                                "kernels in Triton's CPU interpreter, start the process with TRITON_INTERPRET=1)")
        env, moved = list(self.base), {}
        for name, s in self.plan["inputs"].items():
            x = inputs[name]
            if x.device != self.device:
                if name.startswith("kv_cache."):  # written in place: a copy would drop this step's rows
                    raise DeepfuseError(f"{name} is on {x.device}, this {self.plan['arch']} artifact runs on "
                                        f"{self.device}: make the cache there (KVCache(..., device=model.device))")
                moved[name] = x
            env[s] = x
        if moved:  # the host's inputs in one non-blocking copy (staging.py), not one waiting copy each
            for name, x in self.packer.pack(moved).items():
                env[self.plan["inputs"][name]] = x
        for p, kernels, ref in self.launches:
            ins = [env[i] for i in p["in"]]
            if kernels:
                outs = self._run(p, kernels, ins)
            else:
                outs = as_list(ref(*ins, **p["attrs"]))
            for s, t in zip(p["out"], outs):
                env[s] = t
            for s in p["free"]:
                env[s] = None
        return [env[s] for s in self.plan["outputs"]]

    def _run(self, p: dict, kernels, ins: list[torch.Tensor]) -> list[torch.Tensor]:
        shapes = sizes_of(p["out_shape"], ins, p["in_shape"])
        outs = [torch.empty(s, dtype=DTYPES[d], device=self.device) for s, d in zip(shapes, p["out_dtype"])]
        kernels = [(spec, fn) for spec, fn in kernels if launched(spec, ins)]
        tmps = self._scratch(p, kernels, ins)
        for spec, fn in kernels:
            for i, axis, n, what in spec.get("requires", []):
                got = ins[i].shape[axis]
                if got > n or (got != n and "at most" not in what):
                    raise DeepfuseError(f"{spec['name']} ({p['node']}) was built for {what} {n}, the step has {got}")
            grid = grid_of(spec, ins, outs, tmps)
            if 0 in grid:
                continue
            self._launch(spec, fn, grid, [bind(f, ins, outs, tmps) for f in spec["args"]])
        return outs

    def _launch(self, spec: dict, fn, grid: tuple[int, int, int], args: list) -> None:
        """One kernel launch, nothing else (tests wrap it: Triton's interpreter reads its tensors on
        the host, which the step itself must never do)."""
        if self.kernel_source == "cubin" and fn.fits(args):  # every parameter in order, constexprs last
            fn.kernel[grid](*args, *spec["constexprs"].values())
        elif self.kernel_source == "cubin":  # a pointer the cubin assumed aligned is not
            fn.jit()[grid](*args, **spec["constexprs"], num_warps=spec["num_warps"], num_stages=spec["num_stages"],
                           enable_fp_fusion=spec.get("fp_fusion", True))
        else:
            fn[grid](*args, **spec["constexprs"], num_warps=spec["num_warps"], num_stages=spec["num_stages"],
                     enable_fp_fusion=spec.get("fp_fusion", True))

    def _scratch(self, p: dict, kernels, ins: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The launch's scratch tensors that its launched kernels use (None for the others): a
        `shape` of the graph's symbols, or `dims` of argument forms."""
        used = {f[1] for spec, _ in kernels for f in spec["args"] if f[0] == "tmp"}
        tmps: list[torch.Tensor | None] = []
        for j, t in enumerate(p.get("tmps", [])):
            if j not in used:
                tmps.append(None)
                continue
            if "dims" in t:
                shape = [d if isinstance(d, int) else bind(d, ins, [], []) for d in t["dims"]]
            else:
                shape = sizes_of([t["shape"]], ins, p["in_shape"])[0]
            tmps.append(torch.empty(shape, dtype=DTYPES[t["dtype"]], device=self.device))
        return tmps
