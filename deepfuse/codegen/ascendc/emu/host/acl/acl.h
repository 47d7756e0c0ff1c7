// deepfuse's emulation of the aclrt subset its generated host code uses (acl/acl.h), defined in
// runtime/runtime.cpp. Device memory is host memory here. Streams are ordered queues, as CANN's
// (per the CANN runtime docs): a kernel launch and an aclrtMemcpyAsync are queued on their stream
// and run, in order, at aclrtSynchronizeStream; aclrtMemcpy copies at once and is not ordered
// with the stream ("no implicit device or stream synchronisation"), so a blocking copy into
// memory that a queued kernel has yet to read changes what that kernel reads.
// aclrtMemcpyAsync from host memory not allocated by aclrtMallocHost completes before it returns
// (after the stream's earlier work), as CANN documents for pageable memory.
#pragma once
#include <cstddef>
#include <cstdint>

typedef int aclError;
typedef void* aclrtStream;
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
#define ACL_ERROR_FAILURE 500001
#define ACL_ERROR_RT_AICORE_EXCEPTION 507015
enum aclrtMemcpyKind { ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE };

extern "C" {
aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind);
aclError aclrtMemcpyAsync(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind kind,
                          aclrtStream stream);
// `height` rows of `width` bytes, row i from src + i * spitch to dst + i * dpitch, queued like
// aclrtMemcpyAsync (device to device only here)
aclError aclrtMemcpy2dAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                            aclrtMemcpyKind kind, aclrtStream stream);
aclError aclrtMallocHost(void** hostPtr, size_t size);
aclError aclrtFreeHost(void* hostPtr);
aclError aclrtCreateStream(aclrtStream* stream);
aclError aclrtDestroyStream(aclrtStream stream);
// runs the stream's queued work; a kernel's violation is ACL_ERROR_RT_AICORE_EXCEPTION, its
// message in deepfuse_emu_error()
aclError aclrtSynchronizeStream(aclrtStream stream);
const char* deepfuse_emu_error(void);
}
