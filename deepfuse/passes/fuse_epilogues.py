"""fuse_epilogues: a generated pointwise kernel that only post-processes a GEMM template's result
becomes that template's epilogue (one `with_epilogue` launch): bias, activation, residual add,
scaling, soft-capping, whatever the kernel IR holds, with no change to the template.

It applies where the kernel has no reduction, runs over the GEMM's [T, N] output row by row
(index space (T, 1, N), the output read at r*N + c), and is the output's only reader.
"""
from __future__ import annotations

from collections.abc import Callable

from ..ir import Graph, Node
from ..kernel.ir import Index, Kernel
from .generate_kernels import stable_topo

HOSTS = ("linear", "linear_q4", "rms_norm_linear", "swiglu_linear", "linear_w8a8")  # one [T, N] output


def fuse_epilogues(keeps: Callable[[Node], bool]) -> Callable[[Graph], Graph]:
    def run(g: Graph) -> Graph:
        producers, users = g.producers(), g.users()
        outputs = set(g.outputs)
        fused: dict[Node, Node | None] = {}
        for n in g.nodes:
            if n.op != "kernel":
                continue
            k = Kernel.from_json(n.attrs["kernel"])
            if k.reductions() or k.space[1] != 1:
                continue
            for i, v in enumerate(n.inputs):
                host = producers.get(v)
                if host is None or host.op not in HOSTS or not keeps(host) or host in fused or v in outputs \
                        or users[v] != [n] or not _reads_rows(k, f"in{i}", v.type.shape):
                    continue
                attrs = {"inner": host.op, "inner_attrs": host.attrs, "n_inner": len(host.inputs),
                         "kernel": n.attrs["kernel"], "feeds": i, "ops": [host.op] + n.attrs["ops"]}
                node = Node("with_epilogue", host.inputs + n.inputs[:i] + n.inputs[i + 1:], n.outputs, attrs)
                fused[host], fused[n] = None, node
                break
        g.nodes = [fused.get(n, n) for n in g.nodes if fused.get(n, n) is not None]
        stable_topo(g)
        return g

    run.module = __import__(__name__, fromlist=["_"])
    return run


def _reads_rows(k: Kernel, buf: str, shape: tuple) -> bool:
    """Whether every load of `buf` reads element (r, c) of a [R, C] row-major tensor of `shape`."""
    if len(shape) != 2 or shape[1] != k.space[2] or shape[0] != k.space[0]:
        return False
    loads = [i for i in k.body if i.op == "load" and i.attrs["buf"] == buf]
    return bool(loads) and all(i.attrs["index"] == Index(shape[1], 0, 1, 0) for i in loads)
