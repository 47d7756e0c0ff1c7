"""Collective ops of a partitioned (per-rank) graph, and the ops that slice or reduce a rank's share.

    all_reduce   x[...] on every rank -> the sum over the ranks, on every rank
    all_gather   x[..., n, ...] on every rank -> the ranks' slices joined along `dim` (rank order)
    all_to_all   x[W, ...] on every rank -> block i of rank r's result is block r of rank i's x
    take_shard   x -> this rank's slice of x along `dim` (no communication)

A collective's reference asks the communicator of the running process (`use_communicator`):
torch.distributed's process group in a launched rank (runtime/distributed.py). One process that
runs every rank's graph (ir/spmd.py) calls each collective's COMBINE entry on the ranks' values
instead. This file owns the ops' types and semantics, not the transport.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch

from ..errors import DeepfuseError
from .ops import expect, register
from .types import TensorType


class Communicator(Protocol):
    world: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor: ...

    def all_to_all(self, x: torch.Tensor) -> torch.Tensor: ...


_CURRENT: list[Communicator] = []


@contextmanager
def use_communicator(comm: Communicator) -> Iterator[Communicator]:
    """Collective ops run while this is active call `comm`."""
    _CURRENT.append(comm)
    try:
        yield comm
    finally:
        _CURRENT.pop()


def current_communicator(op: str, world: int) -> Communicator:
    if not _CURRENT:
        raise DeepfuseError(f"collective op {op} ran outside a distributed run: launch the ranks "
                            "(LLM(..., tensor_parallel_size=N)) or simulate them (ir.spmd.interpret_ranks)")
    comm = _CURRENT[-1]
    if comm.world != world:
        raise DeepfuseError(f"collective op {op} was partitioned for {world} ranks, the run has {comm.world}")
    return comm


# op -> combine(values of all ranks in rank order, attrs) -> each rank's result
COMBINE: dict[str, Callable[[list[torch.Tensor], dict], list[torch.Tensor]]] = {}


def _all_reduce_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    expect(attrs["world"] >= 1, f"all_reduce world must be >= 1, got {attrs['world']}")
    return [x]


@register("all_reduce", _all_reduce_type)
def all_reduce(x: torch.Tensor, *, world: int) -> torch.Tensor:
    """Sum of x over the `world` ranks; every rank gets the same sum."""
    return current_communicator("all_reduce", world).all_reduce(x)


def _sum_in_rank_order(xs: list[torch.Tensor], attrs: dict) -> list[torch.Tensor]:
    total = functools.reduce(torch.add, xs)
    return [total.clone() for _ in xs]


COMBINE["all_reduce"] = _sum_in_rank_order


def _all_gather_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    dim = attrs["dim"]
    expect(0 <= dim < x.rank and isinstance(x.shape[dim], int), f"all_gather dim {dim} must be a fixed dim of {x}")
    shape = list(x.shape)
    shape[dim] *= attrs["world"]
    return [x.with_shape(*shape)]


@register("all_gather", _all_gather_type)
def all_gather(x: torch.Tensor, *, dim: int, world: int) -> torch.Tensor:
    """x[..., n, ...] of every rank -> [..., world*n, ...]: rank r's slice at r*n along dim."""
    return current_communicator("all_gather", world).all_gather(x, dim)


COMBINE["all_gather"] = lambda xs, attrs: [torch.cat(xs, attrs["dim"]) for _ in xs]


def _all_to_all_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    expect(x.rank >= 1 and x.shape[0] == attrs["world"], f"all_to_all wants x[{attrs['world']}, ...] (a block per "
           f"rank), got {x}")
    return [x]


@register("all_to_all", _all_to_all_type)
def all_to_all(x: torch.Tensor, *, world: int) -> torch.Tensor:
    """x[W, ...]: block j is for rank j -> [W, ...]: block i is what rank i sent this rank."""
    return current_communicator("all_to_all", world).all_to_all(x)


COMBINE["all_to_all"] = lambda xs, attrs: [torch.stack([x[r] for x in xs]) for r in range(len(xs))]


def shard_bounds(size: int, units: int, world: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank's slice of a dim of `size` made of `units` equal blocks (0: `world` blocks),
    dealt out in contiguous runs: rank r gets blocks r*units//world .. (r+1)*units//world - 1, so the
    slices differ by at most one block (3 kv heads over 2 ranks: 1 and 2)."""
    u = units or world
    if size % u or u < world or not 0 <= rank < world:
        raise ValueError(f"a dim of {size} in {u} blocks does not split over {world} ranks (rank {rank})")
    block = size // u
    return rank * u // world * block, (rank + 1) * u // world * block


def _take_shard_type(types: list[TensorType], attrs: dict) -> list[TensorType]:
    (x,) = types
    dim = attrs["dim"]
    expect(0 <= dim < x.rank and isinstance(x.shape[dim], int), f"take_shard: dim {dim} of {x} is not fixed")
    lo, hi = shard_bounds(x.shape[dim], attrs.get("units", 0), attrs["world"], attrs["rank"])
    shape = list(x.shape)
    shape[dim] = hi - lo
    return [x.with_shape(*shape)]


@register("take_shard", _take_shard_type)
def take_shard(x: torch.Tensor, *, dim: int, world: int, rank: int, units: int = 0) -> torch.Tensor:
    """Rank `rank`'s slice of x along dim (shard_bounds: `units` blocks, 0 for `world` equal ones)."""
    lo, hi = shard_bounds(x.shape[dim], units, world, rank)
    return x.narrow(dim, lo, hi - lo).contiguous()
