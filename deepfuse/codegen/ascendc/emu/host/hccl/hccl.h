// deepfuse's emulation of CANN's hccl/hccl.h: the collectives its generated host code calls,
// with CANN's signatures (hccl include/hccl.h), defined in runtime/hccl.cpp. Each is queued on
// `stream` in order with the kernels and copies there, and runs at aclrtSynchronizeStream: the
// emulator hands it to the transport the process installed (deepfuse_emu_hccl_set_transport).
#pragma once
#include "acl/acl.h"
#include "hccl/hccl_comm.h"
#include "hccl/hccl_types.h"

#ifdef __cplusplus
extern "C" {
#endif

// recvBuf[i] = the `op` of sendBuf[i] over the ranks, i < count; sendBuf == recvBuf is allowed
HcclResult HcclAllReduce(void* sendBuf, void* recvBuf, uint64_t count, HcclDataType dataType, HcclReduceOp op,
                         HcclComm comm, aclrtStream stream);
// recvBuf[r * sendCount + i] = rank r's sendBuf[i]: the ranks' buffers one after another
HcclResult HcclAllGather(void* sendBuf, void* recvBuf, uint64_t sendCount, HcclDataType dataType, HcclComm comm,
                         aclrtStream stream);

#ifdef __cplusplus
}
#endif
