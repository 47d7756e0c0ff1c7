// deepfuse's CPU emulation of the AscendC vector unit (included by kernel_operator.h): the
// element-wise, scalar, reduction and cast ops its kernels use, over UB tensors, each taking
// part in the pipe-synchronisation model (vec_src / vec_dst) and checking counts and alignment.
#pragma once

namespace AscendC {
// ---- vector unit (count elements; operands are UB tensors) -------------------------------
template <typename T>
inline void check_count(const LocalTensor<T>& t, int32_t n, const char* op) {
  check_ub_aligned(t.data(), op);
  if (n < 0 || (uint32_t)n > t.GetSize()) fail("%s of %d elements on a tensor of %u", op, n, t.GetSize());
}
#define DEEPFUSE_BINARY(NAME, EXPR)                                                                   \
  template <typename T>                                                                             \
  void NAME(const LocalTensor<T>& d, const LocalTensor<T>& a, const LocalTensor<T>& b, const int32_t& n) { \
    vec_src(a, #NAME); vec_src(b, #NAME); vec_dst(d, #NAME); check_count(d, n, #NAME); check_count(a, n, #NAME); check_count(b, n, #NAME); \
    for (int32_t i = 0; i < n; i++) { T x = a.data()[i], y = b.data()[i]; d.data()[i] = (EXPR); }  \
  }
DEEPFUSE_BINARY(Add, x + y)
DEEPFUSE_BINARY(Sub, x - y)
DEEPFUSE_BINARY(Mul, x * y)
DEEPFUSE_BINARY(Div, x / y)
DEEPFUSE_BINARY(Max, x > y ? x : y)
DEEPFUSE_BINARY(Min, x < y ? x : y)  // include/basic_api/kernel_operator_vec_binary_intf.h (count form)
DEEPFUSE_BINARY(And, x & y)
#define DEEPFUSE_SCALAR(NAME, EXPR)                                                      \
  template <typename T>                                                                \
  void NAME(const LocalTensor<T>& d, const LocalTensor<T>& a, const T& s, const int32_t& n) {       \
    vec_src(a, #NAME); vec_dst(d, #NAME); check_count(d, n, #NAME); check_count(a, n, #NAME); \
    for (int32_t i = 0; i < n; i++) { T x = a.data()[i]; d.data()[i] = (EXPR); }      \
  }
DEEPFUSE_SCALAR(Adds, x + s)
DEEPFUSE_SCALAR(ShiftRight, x >> s)
DEEPFUSE_SCALAR(Muls, x * s)
DEEPFUSE_SCALAR(Maxs, x > s ? x : s)
DEEPFUSE_SCALAR(Mins, x < s ? x : s)
// dst += src * s (the vector unit's fused multiply-add by a scalar)
template <typename T>
void Axpy(const LocalTensor<T>& d, const LocalTensor<T>& a, const T s, const int32_t n) {
  vec_src(a, "Axpy"); vec_dst(d, "Axpy"); check_count(d, n, "Axpy"); check_count(a, n, "Axpy");
  for (int32_t i = 0; i < n; i++) d.data()[i] = d.data()[i] + a.data()[i] * s;
}
#define DEEPFUSE_UNARY(NAME, EXPR)                                                   \
  template <typename T>                                                            \
  void NAME(const LocalTensor<T>& d, const LocalTensor<T>& a, const int32_t& n) {        \
    vec_src(a, #NAME); vec_dst(d, #NAME); check_count(d, n, #NAME); check_count(a, n, #NAME); \
    for (int32_t i = 0; i < n; i++) { T x = a.data()[i]; d.data()[i] = (EXPR); }  \
  }
DEEPFUSE_UNARY(Exp, (T)__builtin_expf((float)x))
DEEPFUSE_UNARY(Sqrt, (T)__builtin_sqrtf((float)x))
DEEPFUSE_UNARY(Reciprocal, (T)(1.0f / (float)x))
DEEPFUSE_UNARY(Sin, (T)__builtin_sinf((float)x))
DEEPFUSE_UNARY(Cos, (T)__builtin_cosf((float)x))
// Abs, Ln: count forms of include/basic_api/kernel_operator_vec_unary_intf.h
DEEPFUSE_UNARY(Abs, (T)__builtin_fabsf((float)x))
DEEPFUSE_UNARY(Ln, (T)__builtin_logf((float)x))
template <typename T>
void Duplicate(const LocalTensor<T>& d, const T& v, const int32_t& n) {
  vec_dst(d, "Duplicate"); check_count(d, n, "Duplicate");
  for (int32_t i = 0; i < n; i++) d.data()[i] = v;
}
// ReduceSum, count form (include/basic_api/kernel_operator_vec_reduce_intf.h): dst[0] =
// sum(src[0:count]). On Ascend 950 sharedTmpBuffer holds the first pass's partial sums, one per
// 256-byte repeat, in whole 32-byte blocks (ReduceSum.md, 方式二); dst may overlap it, src may
// not, nor may dst overlap src (ReduceSum.md 约束说明, and the general overlap rule).
template <typename T>
inline bool overlap(const LocalTensor<T>& a, uint32_t na, const LocalTensor<T>& b, uint32_t nb) {
  return a.data() < b.data() + nb && b.data() < a.data() + na;
}
template <typename T>
void ReduceSum(const LocalTensor<T>& d, const LocalTensor<T>& s, const LocalTensor<T>& work, const int32_t count) {
  int32_t n = count;
  vec_src(s, "ReduceSum"); vec_dst(work, "ReduceSum"); vec_dst(d, "ReduceSum");
  check_count(s, n, "ReduceSum"); check_count(d, 1, "ReduceSum");
  uint32_t per_block = 32 / sizeof(T), partials = n < (int32_t)(256 / sizeof(T)) ? 1 : (n + 256 / sizeof(T) - 1) / (256 / sizeof(T));
  uint32_t need = (partials + per_block - 1) / per_block * per_block;
  check_ub_aligned(work.data(), "ReduceSum sharedTmpBuffer");
  if (work.GetSize() < need)
    fail("ReduceSum of %d %s needs a sharedTmpBuffer of %u elements (%lu bytes), it has %u", n,
         sizeof(T) == 4 ? "float" : "half", need, (unsigned long)(need * sizeof(T)), work.GetSize());
  if (overlap(work, need, s, (uint32_t)n)) fail("ReduceSum: its sharedTmpBuffer overlaps its source (only dst may)");
  if (overlap(d, 1, s, (uint32_t)n)) fail("ReduceSum: its destination overlaps its source");
  float acc = 0.0f;
  for (int32_t i = 0; i < n; i++) acc += (float)s.data()[i];
  d.data()[0] = (T)acc;
}
// ReduceMax, count form: on Ascend 950 sharedTmpBuffer is not used ("可以直接传入src或者任意大小的
// sharedTmpBuffer", ReduceMax.md)
// dst[0] = max(src[0:n]); with calIndex, dst[1] holds the first maximum's index (its bits as T)
template <typename T>
void ReduceMax(const LocalTensor<T>& d, const LocalTensor<T>& s, const LocalTensor<T>& work, const int32_t count,
               bool calIndex = false) {
  int32_t n = count;
  (void)work;
  vec_src(s, "ReduceMax"); vec_dst(d, "ReduceMax"); check_count(s, n, "ReduceMax"); check_count(d, calIndex ? 2 : 1, "ReduceMax");
  if (n == 0) fail("ReduceMax of 0 elements");
  uint32_t best = 0;
  for (int32_t i = 1; i < n; i++)
    if (s.data()[i] > s.data()[best]) best = i;
  d.data()[0] = s.data()[best];
  if (calIndex) {
    static_assert(sizeof(T) == 4, "ReduceMax index in a 32-bit lane");
    __builtin_memcpy(&d.data()[1], &best, sizeof(best));
  }
}
// ReduceMin, count form (include/basic_api/kernel_operator_vec_reduce_intf.h): as ReduceMax, the
// first minimum and, with calIndex, its index in dst[1]
template <typename T>
void ReduceMin(const LocalTensor<T>& d, const LocalTensor<T>& s, const LocalTensor<T>& work, const int32_t count,
               bool calIndex = false) {
  int32_t n = count;
  (void)work;
  vec_src(s, "ReduceMin"); vec_dst(d, "ReduceMin"); check_count(s, n, "ReduceMin"); check_count(d, calIndex ? 2 : 1, "ReduceMin");
  if (n == 0) fail("ReduceMin of 0 elements");
  uint32_t best = 0;
  for (int32_t i = 1; i < n; i++)
    if (s.data()[i] < s.data()[best]) best = i;
  d.data()[0] = s.data()[best];
  if (calIndex) {
    static_assert(sizeof(T) == 4, "ReduceMin index in a 32-bit lane");
    __builtin_memcpy(&d.data()[1], &best, sizeof(best));
  }
}
template <typename T> struct cast_to_int { static constexpr bool value = false; };
template <> struct cast_to_int<int8_t> { static constexpr bool value = true; };
template <> struct cast_to_int<uint8_t> { static constexpr bool value = true; };
template <> struct cast_to_int<int16_t> { static constexpr bool value = true; };
template <> struct cast_to_int<int32_t> { static constexpr bool value = true; };
template <typename D, typename S> struct cast_same { static constexpr bool value = false; };
template <typename T> struct cast_same<T, T> { static constexpr bool value = true; };
// Cast.md (Ascend 950 table): CAST_RINT rounds to nearest, ties to even -- to an integer where the
// destination is an integer type (half -> int8_t, float -> int32_t) or the source type itself
// (float -> float); float -> half / bfloat16_t round to the nearest representable value
template <typename D, typename S>
void Cast(const LocalTensor<D>& d, const LocalTensor<S>& s, const RoundMode& mode, const uint32_t n) {
  if (sizeof(D) < sizeof(S) && mode == RoundMode::CAST_NONE) fail("Cast to a narrower type needs a rounding mode (CAST_RINT)");
  vec_src(s, "Cast"); vec_dst(d, "Cast"); check_count(d, (int32_t)n, "Cast"); check_count(s, (int32_t)n, "Cast");
  const bool rint = mode == RoundMode::CAST_RINT && (cast_to_int<D>::value || cast_same<D, S>::value);
  for (uint32_t i = 0; i < n; i++) {
    float v = (float)s.data()[i];
    d.data()[i] = (D)(rint ? __builtin_rintf(v) : v);
  }
}
// GatherMask with a built-in pattern: 1 keeps the even elements, 2 the odd ones, of
// repeatTimes contiguous 256-byte repeats (the modes deepfuse emits)
struct GatherMaskParams { uint8_t src0BlockStride; uint16_t repeatTimes; uint16_t src0RepeatStride; uint8_t src1RepeatStride; };
template <typename T>
void GatherMask(const LocalTensor<T>& d, const LocalTensor<T>& s, uint8_t pattern, bool reduceMode, uint32_t mask,
                const GatherMaskParams& p, uint64_t& rsvdCnt) {
  (void)mask;
  if (reduceMode || (pattern != 1 && pattern != 2) || p.src0BlockStride != 1 || p.src0RepeatStride != 8)
    fail("GatherMask: the emulator models patterns 1 and 2 over contiguous repeats");
  uint32_t n = p.repeatTimes * (256 / sizeof(T));
  vec_src(s, "GatherMask"); vec_dst(d, "GatherMask"); check_count(s, (int32_t)n, "GatherMask"); check_count(d, (int32_t)(n / 2), "GatherMask");
  for (uint32_t i = 0; i < n / 2; i++) d.data()[i] = s.data()[2 * i + (pattern == 2 ? 1 : 0)];
  rsvdCnt = n / 2;
}
}  // namespace AscendC
#include "kernel_cmpsel.h"  // Compare and Select
