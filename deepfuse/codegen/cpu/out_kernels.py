"""CPU kernels that write into planned buffers (passes/plan_memory.py): kernel(*inputs, out=[views]).

Only ops whose kernels take `out=` have one (projections: MKL's GEMM and the native panel
GEMMs, f32 and bf16, the native int4 and int8 GEMMs write in place (torch's int4 GEMM, for
steps of a few rows, is copied there); the oneDNN-packed GEMM allocates its result, so such a
prepacked launch keeps its allocating kernel). Each computes what its kernels.py twin computes.

Each has a bind (bound.py): its Python depends only on its inputs' shapes, dtypes and strides
(bind_as_is repeats the call as it is), the W8A8 ones bind straight to their native GEMM, and
attention binds where the step is all decode rows.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from ...ir.opdefs_fused import is_q4a8
from . import native_binds
from . import q4a8_kernels as q4a8
from .bound import Bound, bind_as_is
from .generated_build import make_generated
from .kernels import FACTORIES, Kernel, factory
from .packed_weights import PanelWeight, Q4Weights, q4_linear
from .program import aten_op
from .q4a8_kernels import native_linear as native_q4a8
from .q4a8_kernels import q4a8_linear
from .row_kernels import add_rms_rows, rms_rows, swiglu_rows
from .w8a8_kernels import (
    native_linear,
    native_norm_linear,
    native_swiglu_linear,
    w8a8_linear,
    w8a8_norm_linear,
    w8a8_swiglu_linear,
)

OUT_FACTORIES: dict[str, Callable[[dict], Kernel]] = {}


def out_factory(op: str) -> Callable:
    """Registers an out-kernel factory; a kernel it makes without a bind gets bind_as_is."""
    def wrap(make: Callable[[dict], Kernel]) -> Callable[[dict], Kernel]:
        def make_bindable(attrs: dict) -> Kernel:
            kernel = make(attrs)
            return kernel if hasattr(kernel, "bind") else bind_as_is(kernel)

        return factory(op, OUT_FACTORIES)(make_bindable)

    return wrap


def with_bind(kernel: Callable, bind: Callable[..., Bound | None]) -> Callable:
    kernel.bind = bind
    return kernel


def with_native_bind(kernel: Callable, ops: Callable[..., list | None]) -> Callable:
    """kernel, bound to ops(*ins, out=out) (native_binds.py: its call as native ops), or to its
    own call where those are None."""
    kernel.bind = lambda *ins, out: Bound(ops(*ins, out=out) or [partial(kernel, *ins, out=out)])
    return kernel


def native_bind(native: Callable[..., Callable[[], object] | None], *tail) -> Callable[..., Bound | None]:
    """A bind to native(*ins, *tail, out=out[0]) (one of the native_* W8A8 calls), else None."""
    return lambda *ins, out: Bound.of(native(*ins, *tail, out=out[0]))


def mm_into(x: torch.Tensor, w: torch.Tensor | PanelWeight | Q4Weights, out: torch.Tensor) -> None:
    """out[T,N] = x[T,K] @ w[N,K]^T; w dense f32, native panels (packed_weights.PanelWeight) or int4
    (packed_weights.Q4Weights)."""
    if isinstance(w, Q4Weights):
        q4_linear(x, w, out)
    elif isinstance(w, PanelWeight):
        w(x, out)
    else:
        torch.mm(x, w.t(), out=out)


@out_factory("embedding")
def _embedding(attrs: dict) -> Kernel:
    return with_native_bind(lambda table, ids, out: torch.index_select(table, 0, ids, out=out[0]),
                            lambda table, ids, out: [aten_op("index_select", table, ids, out[0])])


@out_factory("add")
def _add(attrs: dict) -> Kernel:
    return with_native_bind(lambda a, b, out: torch.add(a, b, out=out[0]),
                            lambda a, b, out: [aten_op("add", a, b, out[0])])


@out_factory("kernel")
def _kernel(attrs: dict) -> Kernel:
    return make_generated(attrs, into=True)  # binds to its native call (generated_build.NativeKernel.bind)


@out_factory("rms_norm")
def _rms_norm_out(attrs: dict) -> Kernel:
    eps = attrs["eps"]

    def run(x, w, out):
        out[0].copy_(rms_rows(x, w, eps))

    return with_native_bind(run, lambda x, w, out: native_binds.rms_norm_into(x, w, eps, out[0]))


@out_factory("swiglu")
def _swiglu_out(attrs: dict) -> Kernel:
    """A SwiGLU left unfused (its reader is no swiglu_linear)."""
    def run(x, out):
        out[0].copy_(swiglu_rows(x))

    return with_native_bind(run, lambda x, out: native_binds.swiglu_into(x, out[0]))


@out_factory("add_rms_norm")
def _add_rms_norm_out(attrs: dict) -> Kernel:
    eps = attrs["eps"]

    def run(x, res, w, out):
        s, normed = add_rms_rows(x, res, w, eps, out[0])
        out[1].copy_(normed)

    return with_native_bind(run, lambda x, res, w, out: native_binds.add_rms_norm_into(x, res, w, eps, out[0], out[1]))


@out_factory("linear")
def _linear(attrs: dict) -> Kernel:
    return with_native_bind(lambda x, w, out: mm_into(x, w, out[0]),
                            lambda x, w, out: native_binds.project(x, w, out[0]))


@out_factory("linear_q4")
def _linear_q4(attrs: dict) -> Kernel:
    return with_native_bind(lambda x, w, out: q4_linear(x, w, out[0]),
                            lambda x, w, out: native_binds.project(x, w, out[0]))


@out_factory("linear_q4a8")
def _linear_q4a8(attrs: dict) -> Kernel:
    return with_bind(lambda x, w, out: q4a8_linear(x, w, out[0]), native_bind(native_q4a8))


@out_factory("linear_w8a8")
def _linear_w8a8(attrs: dict) -> Kernel:
    group = attrs["act_group"]
    return with_bind(lambda x, w, out: w8a8_linear(x, w, group, out[0]), native_bind(native_linear, group))


@out_factory("rms_norm_linear")
def _rms_norm_linear(attrs: dict) -> Kernel:
    eps = attrs["eps"]
    if is_q4a8(attrs):  # an int4-a8 projection (q4a8_kernels.Q4A8Weights)
        return with_bind(lambda x, w, proj, out: q4a8.q4a8_norm_linear(x, None, w, eps, proj, out=out[0]),
                         lambda x, w, proj, out: Bound.of(q4a8.native_norm_linear(x, None, w, eps, proj, None, out[0])))
    if "act_group" in attrs:  # a W8A8 projection (w8a8_kernels.W8A8Weights)
        group = attrs["act_group"]
        return with_bind(lambda x, w, proj, out: w8a8_norm_linear(x, None, w, eps, proj, group, out=out[0]),
                         lambda x, w, proj, out: Bound.of(native_norm_linear(x, None, w, eps, proj, group, None,
                                                                             out[0])))
    return with_native_bind(lambda x, w, proj, out: mm_into(rms_rows(x, w, eps), proj, out[0]),
                            lambda x, w, proj, out: native_binds.then_project(native_binds.rms_norm(x, w, eps), proj,
                                                                              out[0]))


@out_factory("add_rms_norm_linear")
def _add_rms_norm_linear(attrs: dict) -> Kernel:
    eps = attrs["eps"]
    if is_q4a8(attrs):
        return with_bind(lambda x, res, w, proj, out: q4a8.q4a8_norm_linear(x, res, w, eps, proj, out[0], out[1]),
                         lambda x, res, w, proj, out: Bound.of(q4a8.native_norm_linear(x, res, w, eps, proj, out[0],
                                                                                       out[1])))
    if "act_group" in attrs:
        group = attrs["act_group"]
        return with_bind(lambda x, res, w, proj, out: w8a8_norm_linear(x, res, w, eps, proj, group, out[0], out[1]),
                         lambda x, res, w, proj, out: Bound.of(native_norm_linear(x, res, w, eps, proj, group, out[0],
                                                                                  out[1])))

    def run(x, res, w, proj, out):
        _, normed = add_rms_rows(x, res, w, eps, out[0])
        mm_into(normed, proj, out[1])

    return with_native_bind(run, lambda x, res, w, proj, out: native_binds.then_project(
        native_binds.add_rms_norm(x, res, w, eps, out[0]), proj, out[1]))


@out_factory("swiglu_linear")
def _swiglu_linear(attrs: dict) -> Kernel:
    if is_q4a8(attrs):
        return with_bind(lambda x, proj, out: q4a8.q4a8_swiglu_linear(x, proj, out[0]),
                         native_bind(q4a8.native_swiglu_linear))
    if "act_group" in attrs:
        group = attrs["act_group"]
        return with_bind(lambda x, proj, out: w8a8_swiglu_linear(x, proj, group, out[0]),
                         native_bind(native_swiglu_linear, group))
    return with_native_bind(lambda x, proj, out: mm_into(swiglu_rows(x), proj, out[0]),
                            lambda x, proj, out: native_binds.then_project(native_binds.swiglu(x), proj, out[0]))


def _attending(op: str) -> Callable[[dict], Kernel]:
    def make(attrs: dict) -> Kernel:
        kernel = FACTORIES[op](attrs)
        return with_bind(lambda *ins, out: kernel(*ins, out=out[0]), lambda *ins, out: kernel.bind(*ins, out=out[0]))

    return make


OUT_FACTORIES["attention"] = _attending("attention")
OUT_FACTORIES["qkv_attention"] = _attending("qkv_attention")
