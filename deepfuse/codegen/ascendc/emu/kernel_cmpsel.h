// deepfuse's CPU emulation of AscendC's Compare and Select, count forms (included by
// kernel_vector.h). Declarations: include/basic_api/kernel_operator_vec_cmpsel_intf.h; the enums:
// impl/basic_api/utils/kernel_utils_mode.h. Rules checked, from the API pages (docs/zh/api/SIMD-API/
// 基础API/Memory矢量计算/比较与选择/Compare.md, Select.md):
//   - Compare writes one bit per element into a uint8_t / int8_t mask, element i at bit i % 8 of
//     byte i / 8 (little-endian); its count must cover whole 256-byte repeats ("需要保证count个元素所占
//     空间256字节对齐。未对齐部分元素不参与计算"): anything else is reported, not rounded down;
//     int32_t compares only for EQ;
//   - Select's VSEL_TENSOR_TENSOR_MODE / VSEL_TENSOR_SCALAR_MODE take bit i of selMask for element
//     i (1: src0, 0: src1), consuming 256/sizeof(T) bits per repeat, so the mask must hold the bits
//     of whole repeats; VSEL_CMPMASK_SPR (the compare register) is not modelled.
#pragma once

namespace AscendC {
enum class CMPMODE : uint8_t { LT = 0, GT, EQ, LE, GE, NE };
enum class SELMODE : uint8_t { VSEL_CMPMASK_SPR = 0, VSEL_TENSOR_SCALAR_MODE, VSEL_TENSOR_TENSOR_MODE };

template <typename T>
inline bool compare_one(T x, T y, CMPMODE m) {
  switch (m) {
    case CMPMODE::LT: return x < y;
    case CMPMODE::GT: return x > y;
    case CMPMODE::EQ: return x == y;
    case CMPMODE::LE: return x <= y;
    case CMPMODE::GE: return x >= y;
    default: return x != y;
  }
}
template <typename T, typename U>
void Compare(const LocalTensor<U>& dst, const LocalTensor<T>& src0, const LocalTensor<T>& src1, CMPMODE cmpMode,
             uint32_t count) {
  static_assert(sizeof(U) == 1, "Compare writes its mask as uint8_t / int8_t");
  vec_src(src0, "Compare"); vec_src(src1, "Compare"); vec_dst(dst, "Compare");
  if (count == 0 || count * sizeof(T) % 256 != 0)
    fail("Compare of %u elements (%lu bytes): the count must cover whole 256-byte repeats", count,
         (unsigned long)(count * sizeof(T)));
  if (sizeof(T) == 4 && (T)0.5 == (T)0 && cmpMode != CMPMODE::EQ) fail("Compare of int32_t supports CMPMODE::EQ only");
  check_count(src0, (int32_t)count, "Compare"); check_count(src1, (int32_t)count, "Compare");
  check_count(dst, (int32_t)(count / 8), "Compare mask");
  uint8_t* bits = (uint8_t*)dst.data();
  for (uint32_t i = 0; i < count / 8; i++) bits[i] = 0;
  for (uint32_t i = 0; i < count; i++)
    if (compare_one(src0.data()[i], src1.data()[i], cmpMode)) bits[i / 8] |= (uint8_t)(1u << (i % 8));
}
template <typename T, typename U>
inline const uint8_t* select_mask(const LocalTensor<U>& mask, SELMODE mode, uint32_t count) {
  if (mode == SELMODE::VSEL_CMPMASK_SPR) fail("Select: VSEL_CMPMASK_SPR (the compare register) is not modelled");
  vec_src(mask, "Select");
  uint32_t per_repeat = 256 / sizeof(T), need = (count + per_repeat - 1) / per_repeat * per_repeat / 8;
  if ((uint64_t)mask.GetSize() * sizeof(U) < need)
    fail("Select of %u elements needs a selMask of %u bytes (whole %u-element repeats), it has %lu", count, need,
         per_repeat, (unsigned long)(mask.GetSize() * sizeof(U)));
  return (const uint8_t*)mask.data();
}
template <typename T, typename U>
void Select(const LocalTensor<T>& dst, const LocalTensor<U>& selMask, const LocalTensor<T>& src0,
            const LocalTensor<T>& src1, SELMODE selMode, uint32_t count) {
  if (selMode != SELMODE::VSEL_TENSOR_TENSOR_MODE) fail("Select of two tensors wants VSEL_TENSOR_TENSOR_MODE");
  const uint8_t* bits = select_mask<T>(selMask, selMode, count);
  vec_src(src0, "Select"); vec_src(src1, "Select"); vec_dst(dst, "Select");
  check_count(dst, (int32_t)count, "Select"); check_count(src0, (int32_t)count, "Select");
  check_count(src1, (int32_t)count, "Select");
  for (uint32_t i = 0; i < count; i++) dst.data()[i] = (bits[i / 8] >> (i % 8)) & 1 ? src0.data()[i] : src1.data()[i];
}
template <typename T, typename U>
void Select(const LocalTensor<T>& dst, const LocalTensor<U>& selMask, const LocalTensor<T>& src0, T src1,
            SELMODE selMode, uint32_t count) {
  if (selMode != SELMODE::VSEL_TENSOR_SCALAR_MODE) fail("Select of a tensor and a scalar wants VSEL_TENSOR_SCALAR_MODE");
  const uint8_t* bits = select_mask<T>(selMask, selMode, count);
  vec_src(src0, "Select"); vec_dst(dst, "Select");
  check_count(dst, (int32_t)count, "Select"); check_count(src0, (int32_t)count, "Select");
  for (uint32_t i = 0; i < count; i++) dst.data()[i] = (bits[i / 8] >> (i % 8)) & 1 ? src0.data()[i] : src1;
}
}  // namespace AscendC
