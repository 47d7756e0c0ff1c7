// deepfuse's CPU emulation of the AscendC high-level Matmul API (the subset its GEMM kernels use):
// MatmulType, Matmul<A, B, C, Bias> with SetTensorA / SetTensorB (B transposed) / SetTail /
// IterateAll / End, REGIST_MATMUL_OBJ, and TCubeTiling. NOT the hardware: the product is computed
// base tile by base tile (baseM x baseN, K in baseK steps, fp32 accumulation as in L0C), and the
// tiling is checked against Ascend 950's cube buffers -- L0A / L0B 64 KB (a base tile, double
// buffered), L0C 256 KB, base sizes in whole 16 x (32 bytes) fractals. The ND <-> fractal (NZ)
// layout conversions the hardware performs between GM, L1 and L0 are not modelled.
// As in the real header, ASCENDC_CUBE_ONLY defined before this include makes Matmul run on the
// cube core itself (a pure-cube kernel); without it Matmul is the mixed mode's vector-side client
// of a cube-side server, and the kernel runs as a mixed 1:2 kernel (deepfuse_emu/runtime.h).
#pragma once
#include "kernel_operator.h"
#include "kernel_tiling/kernel_tiling.h"

#ifdef ASCENDC_CUBE_ONLY
#define DEEPFUSE_EMU_MATMUL 1
#else
#define DEEPFUSE_EMU_MATMUL 2
#endif

namespace deepfuse_emu {
constexpr int64_t L0A_BYTES = 64 * 1024, L0B_BYTES = 64 * 1024, L0C_BYTES = 256 * 1024;
inline uint8_t*& sys_workspace() { static uint8_t* p = nullptr; return p; }
inline float* l0c() { static float acc[L0C_BYTES / sizeof(float)]; return acc; }
// int8_t A and B accumulate in int32_t in L0C, C int32_t (Matmul使用说明.md, the Ascend 950 row
// "int8_t | int8_t | int32_t | int32_t/half" of A, B, Bias, C types); other inputs in fp32
template <typename T> struct l0c_type { using type = float; };
template <> struct l0c_type<int8_t> { using type = int32_t; };
template <typename T> inline typename l0c_type<T>::type* l0c_of() {
  return reinterpret_cast<typename l0c_type<T>::type*>(l0c());
}
}  // namespace deepfuse_emu

namespace AscendC {
inline void SetSysWorkspace(GM_ADDR workspace) { deepfuse_emu::sys_workspace() = workspace; }
inline GM_ADDR GetSysWorkSpacePtr() { return deepfuse_emu::sys_workspace(); }
}  // namespace AscendC

namespace AscendC {
enum class CubeFormat { ND, NZ };

template <TPosition POS, CubeFormat FORMAT, typename T, bool ISTRANS = false>
struct MatmulType {
  using type = T;
  static constexpr bool isTrans = ISTRANS;
};

template <class A, class B, class C, class BIAS>
class Matmul {
  using TA = typename A::type;
  using TB = typename B::type;
  using TC = typename C::type;

 public:
  void Init(const TCubeTiling* tiling, TPipe* pipe) {
    if (tiling == nullptr || pipe == nullptr) fail("REGIST_MATMUL_OBJ needs a pipe and a tiling");
    t_ = *tiling;
    const TCubeTiling& t = t_;
    if (t.baseM <= 0 || t.baseN <= 0 || t.baseK <= 0) fail("Matmul tiling: base sizes must be positive");
    // the TCubeTiling doc's rules (TCubeTiling结构体.md): step / depth > 0, dbL0* in {1, 2}
    if (t.usedCoreNum <= 0 || t.stepM <= 0 || t.stepN <= 0 || t.stepKa <= 0 || t.stepKb <= 0 || t.depthA1 <= 0 ||
        t.depthB1 <= 0)
      fail("Matmul tiling: usedCoreNum, step* and depth* must be positive");
    if (t.dbL0A < 1 || t.dbL0A > 2 || t.dbL0B < 1 || t.dbL0B > 2 || t.dbL0C < 1 || t.dbL0C > 2)
      fail("Matmul tiling: dbL0A / dbL0B / dbL0C must be 1 or 2");
    if (t.baseM % 16 || t.baseN % 16 || (t.baseK * (int)sizeof(TA)) % 32)
      fail("Matmul tiling: baseM and baseN must be multiples of 16 and baseK whole 32-byte fractal rows");
    int64_t a = (int64_t)t.baseM * t.baseK * sizeof(TA) * (t.dbL0A > 1 ? 2 : 1);
    int64_t b = (int64_t)t.baseK * t.baseN * sizeof(TB) * (t.dbL0B > 1 ? 2 : 1);
    int64_t c = (int64_t)t.baseM * t.baseN * sizeof(float) * (t.dbL0C > 1 ? 2 : 1);
    if (a > deepfuse_emu::L0A_BYTES) fail("Matmul tiling: the A base tile overflows L0A (%ld bytes)", (long)a);
    if (b > deepfuse_emu::L0B_BYTES) fail("Matmul tiling: the B base tile overflows L0B (%ld bytes)", (long)b);
    if (c > deepfuse_emu::L0C_BYTES) fail("Matmul tiling: the C base tile overflows L0C (%ld bytes)", (long)c);
    if (t.Ka != t.Kb || t.singleCoreK > t.Ka || t.singleCoreN > t.N)
      fail("Matmul tiling: single-core shape does not fit the original shape");
    tailM_ = t.singleCoreM; tailN_ = t.singleCoreN; tailK_ = t.singleCoreK;
    ready_ = true;
  }
  void SetTensorA(const GlobalTensor<TA>& a, bool transA = false) {
    if (transA) fail("Matmul: transposed A is not emitted by deepfuse");
    a_ = a; hasA_ = true;
  }
  void SetTensorB(const GlobalTensor<TB>& b, bool transB = false) {
    if (transB != B::isTrans) fail("Matmul: SetTensorB's transpose flag differs from the B MatmulType");
    b_ = b; hasB_ = true;
  }
  void SetTail(int tailM = -1, int tailN = -1, int tailK = -1) {
    if (tailM > 0) tailM_ = tailM;
    if (tailN > 0) tailN_ = tailN;
    if (tailK > 0) tailK_ = tailK;
    if (tailM_ > t_.M || tailN_ > t_.singleCoreN || tailK_ > t_.Ka) fail("Matmul SetTail past the single-core shape");
  }
  // C[m, n] = sum_k A[m, k] * B[n, k] (B transposed) over this core's tailM x tailN block
  void IterateAll(const GlobalTensor<TC>& c, uint8_t enAtomic = 0) {
    if (!ready_) fail("Matmul IterateAll before REGIST_MATMUL_OBJ");
    if (!hasA_ || !hasB_) fail("Matmul IterateAll before SetTensorA / SetTensorB");
    deepfuse_emu::cube_work(DEEPFUSE_EMU_MATMUL);
    const TCubeTiling& t = t_;
    using Acc = typename deepfuse_emu::l0c_type<TA>::type;
    Acc* acc = deepfuse_emu::l0c_of<TA>();
    for (int m0 = 0; m0 < tailM_; m0 += t.baseM)
      for (int n0 = 0; n0 < tailN_; n0 += t.baseN) {
        int bm = t.baseM < tailM_ - m0 ? t.baseM : tailM_ - m0, bn = t.baseN < tailN_ - n0 ? t.baseN : tailN_ - n0;
        for (int i = 0; i < t.baseM * t.baseN; i++) acc[i] = 0;
        for (int k0 = 0; k0 < tailK_; k0 += t.baseK) {
          int bk = t.baseK < tailK_ - k0 ? t.baseK : tailK_ - k0;
          for (int i = 0; i < bm; i++)
            for (int j = 0; j < bn; j++) {
              Acc s = 0;
              for (int k = 0; k < bk; k++)
                s += (Acc)a_.GetValue((uint64_t)(m0 + i) * t.Ka + k0 + k) * (Acc)b_.GetValue((uint64_t)(n0 + j) * t.Kb + k0 + k);
              acc[(size_t)i * t.baseN + j] += s;
            }
        }
        for (int i = 0; i < bm; i++)
          for (int j = 0; j < bn; j++) {
            uint64_t at = (uint64_t)(m0 + i) * t.N + n0 + j;
            TC v = (TC)acc[(size_t)i * t.baseN + j];
            c.SetValue(at, enAtomic ? (TC)(c.GetValue(at) + v) : v);
          }
      }
    hasA_ = hasB_ = false;
  }
  void End() { ready_ = false; }

 private:
  TCubeTiling t_{};
  GlobalTensor<TA> a_;
  GlobalTensor<TB> b_;
  int tailM_ = 0, tailN_ = 0, tailK_ = 0;
  bool ready_ = false, hasA_ = false, hasB_ = false;
};
}  // namespace AscendC
namespace matmul = AscendC;

#define REGIST_MATMUL_OBJ(pipe, workspace, obj, tiling) (obj).Init((tiling), (pipe))
