// deepfuse's emulation of the aclrt subset its generated host code uses (acl/acl.h): device
// memory is host memory here, a stream is a token, kernels run when launched.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>

typedef int aclError;
typedef void* aclrtStream;
#define ACL_SUCCESS 0
#define ACL_ERROR_INVALID_PARAM 100000
enum aclrtMemcpyKind { ACL_MEMCPY_HOST_TO_HOST, ACL_MEMCPY_HOST_TO_DEVICE, ACL_MEMCPY_DEVICE_TO_HOST, ACL_MEMCPY_DEVICE_TO_DEVICE };

inline aclError aclrtMemcpy(void* dst, size_t destMax, const void* src, size_t count, aclrtMemcpyKind) {
  if (dst == nullptr || src == nullptr || count > destMax) return ACL_ERROR_INVALID_PARAM;
  std::memcpy(dst, src, count);
  return ACL_SUCCESS;
}
