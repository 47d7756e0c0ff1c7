"""CPU executor: binds a launch plan to kernels and weights; runs one step per call.

Loading runs no compiler: kernels are looked up by op name. The executor holds no
per-request state; the kv cache tensors arrive as step inputs.
"""
from __future__ import annotations

import ctypes
from itertools import islice

import torch

from ...errors import DeepfuseError
from ...inference_mode import inference_mode
from ...ir import DTYPES
from .bound import BoundPrefix, StepBinder, layout_key
from .kernels import make_kernel, prepack_for
from .native import kernels as native_kernels
from .out_kernels import OUT_FACTORIES
from .packed_weights import Q4Weights, can_prepack, writes_in_place

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory() -> bool:
    """Tells glibc malloc to keep freed activations for reuse instead of returning them
    to the OS (which costs page faults every step). Returns False off glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 1 << 30)) and bool(libc.mallopt(M_TRIM_THRESHOLD, (1 << 31) - 1))
    except (OSError, AttributeError):
        return False


ALLOCATOR_TUNED = keep_freed_memory()

INVARIANT_AWARE = ("attention", "qkv_attention")  # kernels told when the plan asks for batch invariance


def check_batch_invariant(plan: dict, prepack: bool) -> None:
    """Raises DeepfuseError unless this machine runs `plan` with one kernel per op for every
    batch shape: projections on the native panel (f32) or bf16 (AMX or AVX512-BF16) GEMMs, whose rows never
    depend on one another, and attention in the native paged kernel, which computes each query
    row alone over its own keys in a fixed order."""
    why = None
    native = native_kernels()
    dtypes = {p["dtype"] for p in plan["launches"]} & {"bf16", "f16"}
    if native is None:
        why = "the native CPU kernels could not be built here"
    elif not (prepack and can_prepack()):
        why = "projections are not prepacked for the native GEMMs"
    elif "f16" in dtypes:
        why = "f16 projections run on oneDNN, whose kernels change with the row count"
    elif "bf16" in dtypes and not native.bf16_gemm_available():
        why = "bf16 projections need AMX or AVX512-BF16 for one kernel at every row count, and this CPU has neither"
    elif any(p["op"] in ("fused_moe", "moe", "moe_experts", "moe_local_experts") for p in plan["launches"]):
        why = "MoE layers group tokens by expert, so an expert's GEMM shape depends on the batch"
    elif any(p["op"] in INVARIANT_AWARE and p["attrs"].get("sinks") for p in plan["launches"]):
        why = "attention with sink logits has no native paged kernel"
    if why:
        raise DeepfuseError(f"batch-invariant execution is not available: {why}")


def then_epilogue(kernel, n_inner: int, attrs: dict):
    """A with_epilogue launch: the template's kernel on its first n_inner inputs, then the
    generated epilogue kernel (attrs["kernel"]) on its result and the remaining inputs."""
    epi = make_kernel("kernel", {"kernel": attrs["kernel"], "ops": attrs["ops"]})
    feeds = attrs["feeds"]

    def run(*xs):
        y = kernel(*xs[:n_inner])
        extra = xs[n_inner:]
        return epi(*extra[:feeds], y, *extra[feeds:])

    return run


class StepBuffers:
    """The memory plan's buffers, grown (never shrunk) to the largest step seen, and each
    launch's output views for the last step size (decode steps repeat it). generation counts
    the times the storage grew (views of one step size and generation are the same memory)."""

    def __init__(self, plan: dict):
        self.specs = plan.get("buffers", [])
        self.symbols = plan.get("symbols", {})
        self.storage = [torch.empty(0, dtype=DTYPES[b["dtype"]]) for b in self.specs]
        self.generation = 0
        self.key: tuple | None = None
        self.views: list[list[torch.Tensor] | None] = []

    def sizes(self, inputs: dict[str, torch.Tensor]) -> dict[str, int]:
        return {sym: inputs[name].shape[axis] for sym, (name, axis) in self.symbols.items()}

    def views_for(self, inputs: dict[str, torch.Tensor], launches: list[dict]) -> list[list[torch.Tensor] | None]:
        sizes = self.sizes(inputs)
        key = tuple(sorted(sizes.items()))
        if key == self.key:
            return self.views
        for i, b in enumerate(self.specs):
            need = (sizes[b["dim"]] if b["dim"] else 1) * b["row"]
            if self.storage[i].numel() < need:
                self.storage[i] = torch.empty(need, dtype=self.storage[i].dtype)
                self.generation += 1
        self.views = []
        for p in launches:
            if p is None:
                self.views.append(None)
                continue
            outs = []
            for buf, shape in zip(p["out_buf"], p["out_shape"]):
                dims = [sizes[d] if isinstance(d, str) else d for d in shape]
                numel = 1
                for d in dims:
                    numel *= d
                outs.append(self.storage[buf][:numel].view(dims))
            self.views.append(outs)
        self.key = key
        return self.views


class CpuExecutor:
    """plan: see plan.py; weights: the final graph's params by name. prepack: pack
    projection weights once at load (f32: the native kernel's panels; bf16: VNNI panels for
    the native kernel (AMX or AVX512-BF16), else oneDNN's blocked layout, as for f16; int4 weights: torch's
    int4 layout plus a dense copy, see packed_weights.Q4Weights).
    use_buffers: launches whose op has an out-kernel (out_kernels.py) and whose outputs all
    have a planned buffer write into the step buffers instead of allocating.
    A plan with "batch_invariant" runs one kernel per op for every batch shape (see
    check_batch_invariant), so a request's tokens do not depend on what shares its steps.
    bind_steps: steps whose inputs have the layout (memory, shapes, strides) of an earlier one
    run that one's launches as bound calls (bound.py), as far as they bind (decode steps: every
    launch where the LM head's GEMM is native, the step's outputs allocated by each run; where
    the self-check refused the native sampler, the sampler and spec_verify run from Python for a
    step with a sampled row or a draft; else all but the sampling tail)."""

    def __init__(self, plan: dict, weights: dict[str, torch.Tensor], prepack: bool = True, use_buffers: bool = True,
                 bind_steps: bool = True):
        self.num_slots = plan["num_slots"]
        self.inputs = plan["inputs"]
        self.outputs = plan["outputs"]
        self.buffers = StepBuffers(plan)
        self.batch_invariant = bool(plan.get("batch_invariant"))
        if self.batch_invariant:
            check_batch_invariant(plan, prepack)
        self.planned: list[dict | None] = []  # per launch: its plan entry if it writes into buffers
        self.base: list = [None] * self.num_slots
        for name, s in plan["params"].items():
            self.base[s] = weights[name]
        packed: dict[tuple[int, ...], int] = {}  # param slots -> slot of their packed object
        param_slots = set(plan["params"].values())
        self.launches = []
        for p in plan["launches"]:
            ins = list(p["in"])
            op, attrs, epilogue = p["op"], p["attrs"], None
            if op == "with_epilogue":  # a template op, then its generated epilogue on the result
                op, attrs, epilogue = attrs["inner"], attrs["inner_attrs"], attrs
            attrs = {**attrs, "batch_invariant": True} if self.batch_invariant and op in INVARIANT_AWARE else attrs
            kernel = make_kernel(op, attrs)
            pre = prepack_for(op, attrs) if prepack and can_prepack() else None
            in_place, prepacked = True, False  # its kernel could write into planned buffers
            if pre is not None and DTYPES[p["dtype"]] in pre.dtypes and all(ins[i] in param_slots for i in pre.weights):
                key = tuple(ins[i] for i in pre.weights)
                if key not in packed:
                    packed[key] = len(self.base)
                    one_kernel = {"one_kernel": True} if self.batch_invariant and pre.pack is Q4Weights else {}
                    self.base.append(pre.pack(DTYPES[p["dtype"]], *[self.base[s] for s in key], **one_kernel))
                ins = [packed[key] if i == pre.weights[0] else s for i, s in enumerate(ins) if i not in pre.weights[1:]]
                kernel = pre.make(attrs)
                in_place, prepacked = writes_in_place(self.base[packed[key]]), True
            if epilogue is not None:
                n_inner = epilogue["n_inner"] - (len(pre.weights) - 1 if prepacked else 0)
                self.planned.append(None)
                self.launches.append((then_epilogue(kernel, n_inner, epilogue), ins, p["out"], p["free"]))
                continue
            # an int4 or W8A8 projection writes in place only prepacked (its reference allocates)
            quantized = "group_size" in attrs or "act_group" in attrs
            if in_place and use_buffers and p["op"] in OUT_FACTORIES and (not quantized or prepacked) \
                    and -1 not in p.get("out_buf", [-1]):
                kernel = OUT_FACTORIES[p["op"]](attrs)
                self.planned.append(p)
                self.launches.append((kernel, ins, p["out"], p["free"]))
                continue
            self.planned.append(None)
            self.launches.append((kernel, ins, p["out"], p["free"]))
        self.binder = StepBinder() if bind_steps and use_buffers else None
        self._again: tuple[BoundPrefix, dict[str, torch.Tensor]] | None = None  # see rerun()

    def _env(self, inputs: dict[str, torch.Tensor]) -> list:
        env = list(self.base)
        for name, s in self.inputs.items():
            env[s] = inputs[name]
        return env

    @inference_mode
    def __call__(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        self._again = None
        views = self.buffers.views_for(inputs, self.planned)
        if self.binder is None:
            return self._loop(self._env(inputs), views, 0)
        key = (self.buffers.generation, layout_key([inputs[name] for name in self.inputs]))
        prefix, env, done = self.binder.cached(key, self.launches), None, 0
        for fresh in (False, True):  # a guard failed (nothing ran): bind again
            if prefix is None or fresh:
                env = self._env(inputs) if env is None else env
                prefix = self.binder.get(key, self.launches, env, views, fresh=fresh)
            if not prefix.count:
                done = 0
                break
            whole = prefix.count == len(self.launches)
            done, bound_env = prefix.run(self.outputs if whole else None)
            if done >= 0:
                break
        else:
            raise DeepfuseError("a freshly bound step failed its own guards")
        if done and done == len(self.launches):  # the whole step ran bound: bound_env is its outputs
            self._again = (prefix, inputs)
            return bound_env
        if done:  # the first `done` launches ran (a stop may have held the rest: they run below)
            env = bound_env
            for name, s in self.inputs.items():  # this step's tensors (kernels may key caches on them)
                env[s] = inputs[name]
        return self._loop(self._env(inputs) if env is None else env, views, done)

    @inference_mode
    def rerun(self, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
        """The last call's step again over its inputs (`inputs`: that call's, the same dict),
        whose contents the caller has rewritten in place and nothing else (the same memory, shapes
        and strides: a decode step that follows the last one, runtime/batch.py's advance_decode),
        where that call ran bound to its end: its prepared calls, without the layout lookup. None
        (nothing ran) where it did not, where `inputs` are another call's, or where a guard now
        fails (the caller then runs the step as a new call)."""
        again, self._again = self._again, None
        if again is None or again[1] is not inputs:
            return None
        prefix, inputs = again
        done, bound_env = prefix.run(self.outputs)
        if done == -1:
            return None
        if done < len(self.launches):  # a stop held the rest: from Python, over fresh views of the
            # inputs (kernels key per-step work on their inputs' identity, runtime/batch.py)
            for name, s in self.inputs.items():
                bound_env[s] = inputs[name].view(inputs[name].shape)
            return self._loop(bound_env, self.buffers.views, done)
        self._again = again
        return bound_env

    def _loop(self, env: list, views: list, start: int) -> list[torch.Tensor]:
        """Runs the launches from `start` on, each from Python; returns the step's outputs."""
        for (kernel, ins, outs, frees), out in zip(islice(self.launches, start, None), islice(views, start, None)):
            if out is not None:
                kernel(*[env[i] for i in ins], out=out)
                res = out[0] if len(outs) == 1 else out
            else:
                res = kernel(*[env[i] for i in ins])
            if len(outs) == 1:
                env[outs[0]] = res
            else:
                for s, t in zip(outs, res):
                    env[s] = t
            for s in frees:
                env[s] = None
        return [env[s] for s in self.outputs]
