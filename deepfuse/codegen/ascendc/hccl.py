"""The emulated HCCL's side in Python (emu/runtime/hccl.cpp): a rank's communicator and the
transport that carries its collectives out.

    comm = init_comm(lib, world)   rank 0's HcclGetRootInfo, broadcast over the process group,
                                   then HcclCommInitRootInfo on every rank (as CANN host code does)

The generated host code queues HcclAllReduce / HcclAllGather on its stream; when the emulated
stream reaches one it calls TRANSPORT, which runs torch.distributed (the rank's gloo process
group) in place on the buffers the host code passed. Nothing here runs on Ascend hardware.
"""
from __future__ import annotations

import ctypes

import torch
import torch.distributed as dist

from ...errors import DeepfuseError

ALLREDUCE, ALLGATHER = 2, 6  # HcclCMDType
TORCH_TYPES = {0: torch.int8, 2: torch.int32, 3: torch.float16, 4: torch.float32, 5: torch.int64, 7: torch.uint8,
               11: torch.bfloat16}  # HcclDataType -> torch
REDUCE_OPS = {0: dist.ReduceOp.SUM, 1: dist.ReduceOp.PRODUCT, 2: dist.ReduceOp.MAX, 3: dist.ReduceOp.MIN}
HCCL_E_INTERNAL = 4
TransportFn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint64,
                               ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint32)


class RootInfo(ctypes.Structure):
    """hccl_types.h's HcclRootInfo."""
    _fields_ = [("internal", ctypes.c_char * 4108)]


def device_tensor(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of `dtype` at emulated device address ptr (host memory), as a tensor over it."""
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=dtype)


class GlooTransport:
    """Carries out each collective the emulated HCCL hands over with torch.distributed on the
    default process group. An exception cannot cross the C callback: it is kept in `error` and
    the collective reports HCCL_E_INTERNAL, which fails the stream's synchronisation."""

    def __init__(self):
        self.error: BaseException | None = None

    def __call__(self, cmd: int, send: int, recv: int, count: int, dtype: int, op: int, rank: int, n_ranks: int) -> int:
        try:
            if (dist.get_rank(), dist.get_world_size()) != (rank, n_ranks):
                raise DeepfuseError(f"the HcclComm is rank {rank} of {n_ranks}, the process group's rank "
                                    f"{dist.get_rank()} of {dist.get_world_size()}")
            t = TORCH_TYPES[dtype]
            x = device_tensor(send, count, t)
            if cmd == ALLREDUCE:
                self.all_reduce(x, device_tensor(recv, count, t), REDUCE_OPS[op])
            else:
                self.all_gather(x, device_tensor(recv, count * n_ranks, t), n_ranks)
            return 0
        except BaseException as e:  # noqa: BLE001  (reported through the synchronisation's error)
            self.error = e
            return HCCL_E_INTERNAL

    def all_reduce(self, x: torch.Tensor, y: torch.Tensor, op) -> None:
        """y[count] = op over the ranks of x[count] (y may be x)."""
        if y.data_ptr() != x.data_ptr():
            y.copy_(x)
        dist.all_reduce(y, op)

    def all_gather(self, x: torch.Tensor, y: torch.Tensor, world: int) -> None:
        """y[world * count] = the ranks' x[count], rank-major."""
        dist.all_gather(list(y.chunk(world)), x)


TRANSPORT = GlooTransport()
_CALLBACK = TransportFn(TRANSPORT)  # kept alive as long as the process: the libraries hold its address


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        lib.HcclGetErrorString.restype = ctypes.c_char_p
        raise DeepfuseError(f"{what} failed in the emulated HCCL: {lib.HcclGetErrorString(rc).decode()} ({rc})")


def init_comm(lib: ctypes.CDLL, world: int) -> ctypes.c_void_p:
    """This rank's HcclComm in `lib` (a host launch library, emulate.load_project), its collectives
    sent to TRANSPORT. Every rank calls it at the same point (rank 0's root info is broadcast)."""
    if not dist.is_initialized():
        raise DeepfuseError("this ascend950 plan is one rank's of a tensor-parallel model and its collectives need "
                            "the other ranks: run it with LLM(..., tensor_parallel_size=N) or a `deepfuse compile "
                            "--tp N` artifact")
    if dist.get_world_size() != world:
        raise DeepfuseError(f"the plan was partitioned for {world} ranks, the process group has {dist.get_world_size()}")
    root = RootInfo()
    if dist.get_rank() == 0:
        _check(lib, lib.HcclGetRootInfo(ctypes.byref(root)), "HcclGetRootInfo")
    raw = torch.frombuffer(bytearray(bytes(root)), dtype=torch.uint8)
    dist.broadcast(raw, 0)
    root = RootInfo.from_buffer_copy(raw.numpy().tobytes())
    comm = ctypes.c_void_p()
    lib.HcclCommInitRootInfo.argtypes = [ctypes.c_uint32, ctypes.POINTER(RootInfo), ctypes.c_uint32,
                                         ctypes.POINTER(ctypes.c_void_p)]
    _check(lib, lib.HcclCommInitRootInfo(world, ctypes.byref(root), dist.get_rank(), ctypes.byref(comm)),
           "HcclCommInitRootInfo")
    lib.deepfuse_emu_hccl_set_transport(_CALLBACK)
    return comm


def transport_error() -> str:
    """The last collective's failure in the transport, for an error message ('' if none); cleared."""
    e, TRANSPORT.error = TRANSPORT.error, None
    return f": {type(e).__name__}: {e}" if e is not None else ""
