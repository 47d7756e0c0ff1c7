// deepfuse's emulated HCCL (host/hccl/hccl.h, hccl_comm.h): communicators made from root info,
// and collectives queued on a stream which, when the stream reaches them, call the transport
// the process installed with deepfuse_emu_hccl_set_transport (deepfuse's runner installs one
// that runs torch.distributed over the rank's process group: codegen/ascendc/hccl.py). It checks
// what CANN reports as parameter errors (null buffers or communicator, an unknown data type or
// reduction, a stream aclrtCreateStream did not make); it moves no data itself.
#include <cstdio>
#include <cstring>
#include <set>
#include <unistd.h>

#include "deepfuse_emu/runtime.h"
#include "hccl/hccl.h"

extern "C" {
// runs one collective on the rank's buffers: cmd (HCCL_CMD_ALLREDUCE: recv = op over the ranks of
// send, count elements; HCCL_CMD_ALLGATHER: recv = the ranks' `count`-element sends in rank
// order); returns an HcclResult
typedef int (*DeepfuseHcclTransport)(int cmd, void* send, void* recv, uint64_t count, int dataType, int op,
                                     uint32_t rank, uint32_t nRanks);
}

namespace {
const char ROOT_TAG[] = "deepfuse-emu-hccl root ";

struct Comm {
  uint32_t rank, n_ranks;
};
std::set<Comm*> g_comms;
DeepfuseHcclTransport g_transport = nullptr;
unsigned g_roots = 0;

struct Task {
  HcclCMDType cmd;
  void *send, *recv;
  uint64_t count;
  HcclDataType type;
  HcclReduceOp op;
  uint32_t rank, n_ranks;
};

const char* cmd_name(HcclCMDType cmd) { return cmd == HCCL_CMD_ALLREDUCE ? "HcclAllReduce" : "HcclAllGather"; }

void run(void* ctx) {
  const Task* t = (const Task*)ctx;
  if (g_transport == nullptr)
    deepfuse_emu::fail("%s ran with no HCCL transport installed (deepfuse_emu_hccl_set_transport)", cmd_name(t->cmd));
  int rc = g_transport(t->cmd, t->send, t->recv, t->count, t->type, t->op, t->rank, t->n_ranks);
  if (rc != HCCL_SUCCESS)
    deepfuse_emu::fail("%s of %llu elements on rank %u of %u failed in the transport (HcclResult %d)", cmd_name(t->cmd),
                       (unsigned long long)t->count, t->rank, t->n_ranks, rc);
}

void release(void* ctx) { delete (Task*)ctx; }

bool known_type(HcclDataType t) {
  return t == HCCL_DATA_TYPE_FP32 || t == HCCL_DATA_TYPE_FP16 || t == HCCL_DATA_TYPE_BFP16 ||
         t == HCCL_DATA_TYPE_INT32 || t == HCCL_DATA_TYPE_INT64 || t == HCCL_DATA_TYPE_INT8 ||
         t == HCCL_DATA_TYPE_UINT8;
}

Comm* comm_of(HcclComm comm) { return g_comms.count((Comm*)comm) ? (Comm*)comm : nullptr; }

HcclResult queue(HcclCMDType cmd, void* send, void* recv, uint64_t count, HcclDataType type, HcclReduceOp op,
                 HcclComm comm, aclrtStream stream) {
  if (send == nullptr || recv == nullptr || comm == nullptr) return HCCL_E_PTR;
  Comm* c = comm_of(comm);
  if (c == nullptr || !known_type(type) || op > HCCL_REDUCE_MIN) return HCCL_E_PARA;
  Task* t = new Task{cmd, send, recv, count, type, op, c->rank, c->n_ranks};
  return deepfuse_emu::enqueue_task(stream, run, t, release) ? HCCL_SUCCESS : HCCL_E_PARA;
}
}  // namespace

extern "C" {
void deepfuse_emu_hccl_set_transport(DeepfuseHcclTransport transport) { g_transport = transport; }

HcclResult HcclGetRootInfo(HcclRootInfo* rootInfo) {
  if (rootInfo == nullptr) return HCCL_E_PTR;
  std::memset(rootInfo->internal, 0, sizeof(rootInfo->internal));
  std::snprintf(rootInfo->internal, sizeof(rootInfo->internal), "%s%d.%u", ROOT_TAG, (int)getpid(), g_roots++);
  return HCCL_SUCCESS;
}

HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo* rootInfo, uint32_t rank, HcclComm* comm) {
  if (rootInfo == nullptr || comm == nullptr) return HCCL_E_PTR;
  if (nRanks == 0 || rank >= nRanks || std::strncmp(rootInfo->internal, ROOT_TAG, sizeof(ROOT_TAG) - 1) != 0)
    return HCCL_E_PARA;
  Comm* c = new Comm{rank, nRanks};
  g_comms.insert(c);
  *comm = c;
  return HCCL_SUCCESS;
}

HcclResult HcclGetRankSize(HcclComm comm, uint32_t* rankSize) {
  Comm* c = comm_of(comm);
  if (c == nullptr || rankSize == nullptr) return HCCL_E_PARA;
  *rankSize = c->n_ranks;
  return HCCL_SUCCESS;
}

HcclResult HcclGetRankId(HcclComm comm, uint32_t* rank) {
  Comm* c = comm_of(comm);
  if (c == nullptr || rank == nullptr) return HCCL_E_PARA;
  *rank = c->rank;
  return HCCL_SUCCESS;
}

HcclResult HcclCommDestroy(HcclComm comm) {
  Comm* c = comm_of(comm);
  if (c == nullptr) return HCCL_E_PARA;
  g_comms.erase(c);
  delete c;
  return HCCL_SUCCESS;
}

const char* HcclGetErrorString(HcclResult code) {
  switch (code) {
    case HCCL_SUCCESS: return "success";
    case HCCL_E_PARA: return "parameter error";
    case HCCL_E_PTR: return "empty pointer";
    default: return "HCCL error";
  }
}

HcclResult HcclAllReduce(void* sendBuf, void* recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op,
                         HcclComm comm, aclrtStream stream) {
  return queue(HCCL_CMD_ALLREDUCE, sendBuf, recvBuf, count, dataType, op, comm, stream);
}

HcclResult HcclAllGather(void* sendBuf, void* recvBuf, uint64_t sendCount, HcclDataType dataType, HcclComm comm,
                         aclrtStream stream) {
  return queue(HCCL_CMD_ALLGATHER, sendBuf, recvBuf, sendCount, dataType, HCCL_REDUCE_SUM, comm, stream);
}
}
