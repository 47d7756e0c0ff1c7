// deepfuse's emulation of CANN's hccl/hccl_comm.h: making and querying a communicator, with
// CANN's signatures (hcomm include/hccl/hccl_comm.h). Rank 0 calls HcclGetRootInfo and hands the
// bytes to every rank, each calls HcclCommInitRootInfo with its rank.
#pragma once
#include "acl/acl.h"
#include "hccl/hccl_types.h"

#ifdef __cplusplus
extern "C" {
#endif

HcclResult HcclGetRootInfo(HcclRootInfo* rootInfo);
HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo* rootInfo, uint32_t rank, HcclComm* comm);
HcclResult HcclGetRankSize(HcclComm comm, uint32_t* rankSize);
HcclResult HcclGetRankId(HcclComm comm, uint32_t* rank);
HcclResult HcclCommDestroy(HcclComm comm);
const char* HcclGetErrorString(HcclResult code);

#ifdef __cplusplus
}
#endif
