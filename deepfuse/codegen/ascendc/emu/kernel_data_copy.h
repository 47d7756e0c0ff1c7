// deepfuse's CPU emulation of AscendC's GM <-> UB data movement (included by kernel_operator.h):
// DataCopy (whole 32-byte blocks) and DataCopyPad (rows of any byte length) with the Ascend 950
// (arch 3510) parameter structs of include/basic_api/kernel_struct_data_copy.h: blockLen in bytes,
// GM strides in bytes (int64), UB strides in 32-byte blocks. Each copy takes part in the pipe
// synchronisation model (copied_in / copying_out).
#pragma once

namespace AscendC {
inline void check_ub_aligned(const void* p, const char* what) {
  if ((uintptr_t)p % 32 != 0) fail("%s: unified-buffer address not 32-byte aligned", what);
}
// a vector op reads its sources (scalar writes and TBuf copy-ins must be waited for) and
// writes its destination (scalar reads and TBuf copy-outs of it must then wait)
template <typename T>
void vec_src(const LocalTensor<T>& t, const char* op) {
  deepfuse_emu::need_core(deepfuse_emu::Core::AIV, op);
  need_synced(t.owner(), HardEvent::S_V, " of a scalar SetValue's data", op);
  need_synced(t.owner(), HardEvent::MTE2_V, " of data copied into a TBuf", op);
}
template <typename T>
void vec_dst(const LocalTensor<T>& t, const char* op) {
  vec_src(t, op);
  need_synced(t.owner(), HardEvent::MTE3_V, " into a TBuf still being copied out", op);
  raise_event(t.owner(), HardEvent::V_S);
  raise_event(t.owner(), HardEvent::V_MTE3);
}
template <typename T>
void copied_in(const LocalTensor<T>& dst) {
  if (!dst.queued()) raise_event(dst.owner(), HardEvent::MTE2_V);
}
template <typename T>
void copying_out(const LocalTensor<T>& src) {
  if (src.queued()) return;
  need_synced(src.owner(), HardEvent::V_MTE3, "a copy-out of a vector op's result from a TBuf");
  need_synced(src.owner(), HardEvent::S_MTE3, "a copy-out of a scalar SetValue's data from a TBuf");
  raise_event(src.owner(), HardEvent::MTE3_S);
  raise_event(src.owner(), HardEvent::MTE3_V);
}
template <typename T>
void whole_blocks(uint32_t count, const char* what) {
  if (count * sizeof(T) % 32 != 0)
    fail("%s of %u elements (%lu bytes) is not whole 32-byte blocks: the hardware rounds it down silently; use "
         "DataCopyPad", what, count, (unsigned long)(count * sizeof(T)));
}

template <typename T>
void DataCopy(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const uint32_t count) {
  whole_blocks<T>(count, "DataCopy");
  check_ub_aligned(dst.data(), "DataCopy GM->UB");
  if (count > dst.GetSize() || count > src.GetSize()) fail("DataCopy GM->UB past a tensor's end");
  __builtin_memcpy(dst.data(), src.data(), count * sizeof(T));
  copied_in(dst);
}
template <typename T>
void DataCopy(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count) {
  whole_blocks<T>(count, "DataCopy");
  check_ub_aligned(src.data(), "DataCopy UB->GM");
  copying_out(src);
  if (count > src.GetSize() || count > dst.GetSize()) fail("DataCopy UB->GM past a tensor's end");
  __builtin_memcpy(dst.data(), src.data(), count * sizeof(T));
}
// a UB -> UB move, on the vector pipe
template <typename T>
void DataCopy(const LocalTensor<T>& dst, const LocalTensor<T>& src, const uint32_t count) {
  vec_src(src, "DataCopy UB->UB"); vec_dst(dst, "DataCopy UB->UB");
  whole_blocks<T>(count, "DataCopy UB->UB");
  check_ub_aligned(dst.data(), "DataCopy UB->UB");
  check_ub_aligned(src.data(), "DataCopy UB->UB");
  if (count > dst.GetSize() || count > src.GetSize()) fail("DataCopy UB->UB past a tensor's end");
  __builtin_memmove(dst.data(), src.data(), count * sizeof(T));
}

// the arch-3510 layout: strides are int64_t there (uint32_t on earlier arches)
struct DataCopyExtParams {
  uint16_t blockCount = 1;
  uint32_t blockLen = 0;  // bytes
  int64_t srcStride = 0;  // gap after each row: bytes in GM, 32-byte blocks in UB
  int64_t dstStride = 0;
  uint32_t rsv = 0;
  DataCopyExtParams() = default;
  DataCopyExtParams(uint16_t count, uint32_t len, int64_t srcStrideIn, int64_t dstStrideIn, uint32_t rsvIn)
      : blockCount(count), blockLen(len), srcStride(srcStrideIn), dstStride(dstStrideIn), rsv(rsvIn) {}
};
template <typename T>
struct DataCopyPadExtParams {
  bool isPad = false;
  uint8_t leftPadding = 0;
  uint8_t rightPadding = 0;
  T paddingValue = 0;
  DataCopyPadExtParams() = default;
  DataCopyPadExtParams(bool isPadValue, uint8_t leftPadValue, uint8_t rightPadValue, T padValue)
      : isPad(isPadValue), leftPadding(leftPadValue), rightPadding(rightPadValue), paddingValue(padValue) {}
};
template <typename T>
void check_pad_params(const DataCopyExtParams& p, int64_t gm_stride, int64_t ub_stride, const char* what) {
  if (p.blockCount > 4095 || p.blockLen > 2097151 || p.blockLen % sizeof(T) != 0)
    fail("%s: blockCount %u / blockLen %u bytes outside the API's ranges (blockLen a multiple of the element size)",
         what, (unsigned)p.blockCount, p.blockLen);
  if (ub_stride < 0 || ub_stride > 65535 || gm_stride < -(int64_t)p.blockLen)
    fail("%s: stride outside the API's ranges", what);
}

// blockCount rows of blockLen bytes; UB rows padded to 32 bytes
template <typename T>
void DataCopyPad(const LocalTensor<T>& dst, const GlobalTensor<T>& src, const DataCopyExtParams& p,
                 const DataCopyPadExtParams<T>& pad) {
  check_pad_params<T>(p, p.srcStride, p.dstStride, "DataCopyPad GM->UB");
  check_ub_aligned(dst.data(), "DataCopyPad GM->UB");
  uint64_t row = (p.blockLen + 31) / 32 * 32, ub_pitch = row + 32 * (uint64_t)p.dstStride;
  if (p.blockCount && (p.blockCount - 1) * ub_pitch + row > dst.GetSize() * sizeof(T)) fail("DataCopyPad GM->UB past the UB tensor");
  const uint8_t* s = (const uint8_t*)src.data();
  uint8_t* d = (uint8_t*)dst.data();
  for (uint32_t r = 0; r < p.blockCount; r++) {
    int64_t off = (int64_t)r * ((int64_t)p.blockLen + p.srcStride);
    if (off < 0 || (uint64_t)off + p.blockLen > src.GetSize() * sizeof(T)) fail("DataCopyPad GM->UB reads past the global tensor");
    __builtin_memcpy(d + r * ub_pitch, s + off, p.blockLen);
    if (pad.isPad)
      for (uint64_t b = p.blockLen; b < row; b += sizeof(T)) *(T*)(d + r * ub_pitch + b) = pad.paddingValue;
  }
  copied_in(dst);
}
template <typename T>
void DataCopyPad(const GlobalTensor<T>& dst, const LocalTensor<T>& src, const DataCopyExtParams& p) {
  check_pad_params<T>(p, p.dstStride, p.srcStride, "DataCopyPad UB->GM");
  check_ub_aligned(src.data(), "DataCopyPad UB->GM");
  copying_out(src);
  uint64_t row = (p.blockLen + 31) / 32 * 32, ub_pitch = row + 32 * (uint64_t)p.srcStride;
  if (p.blockCount && (p.blockCount - 1) * ub_pitch + row > src.GetSize() * sizeof(T)) fail("DataCopyPad UB->GM past the UB tensor");
  uint8_t* d = (uint8_t*)dst.data();
  const uint8_t* s = (const uint8_t*)src.data();
  for (uint32_t r = 0; r < p.blockCount; r++) {
    int64_t off = (int64_t)r * ((int64_t)p.blockLen + p.dstStride);
    if (off < 0 || (uint64_t)off + p.blockLen > dst.GetSize() * sizeof(T)) fail("DataCopyPad UB->GM writes past the global tensor");
    __builtin_memcpy(d + off, s + r * ub_pitch, p.blockLen);
  }
}
}  // namespace AscendC
