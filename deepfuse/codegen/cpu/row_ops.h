// Row prologues shared by the norm and swiglu kernels (norms.cpp, rows.cpp) and the int8-activation
// GEMMs' fused forms (prologue_rows.h: i8_gemm.cpp, q4a8_gemm.cpp), so a fused projection sees bit for
// bit the rows the unfused ops write.
//
//   norm_row(x, res, w, sum, out, d, eps)  sum = x + res (if res), out = rms_norm(sum or x) * w
//   swiglu_row(gate, up, dst, f)            dst = silu(gate) * up
//
// Rounding follows the IR's references: the norm's h = x * rsqrt(mean(x^2) + eps) in f32,
// rounded to the row dtype, then times w in the row dtype (one more rounding); the sum is
// rounded to the row dtype first, as torch.add does. SwiGLU is computed in float and rounded once.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include "vec.h"
#endif

namespace row_ops {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// With AVX-512, 16 lanes at a time (the sum of squares in 16 partial sums), the tail of a row
// past a multiple of 16 as scalars; the roundings are the same either way.
template <typename T>
inline void norm_row(const T* x, const T* res, const T* w, T* sum, T* out, int64_t d, float eps) {
    float ss = 0.f;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 ss16 = _mm512_setzero_ps();
    for (; j + 16 <= d; j += 16) {
        __m512 f = load16(x + j);
        if (res != nullptr) {
            f = round16(_mm512_add_ps(f, load16(res + j)), x);
            store16(sum + j, f);
        }
        ss16 = _mm512_fmadd_ps(f, f, ss16);
    }
    ss = _mm512_reduce_add_ps(ss16);
#endif
    for (; j < d; ++j) {
        float f = to_float(x[j]);
        if (res != nullptr) {
            const T s = static_cast<T>(f + to_float(res[j]));
            sum[j] = s;
            f = to_float(s);
        }
        ss += f * f;
    }
    if (res != nullptr) x = sum;
    const float rstd = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    j = 0;
#if defined(__AVX512F__)
    for (const __m512 r = _mm512_set1_ps(rstd); j + 16 <= d; j += 16)
        store16(out + j, _mm512_mul_ps(load16(w + j), round16(_mm512_mul_ps(load16(x + j), r), x)));
#endif
    for (; j < d; ++j) {
        const T h = static_cast<T>(to_float(x[j]) * rstd);
        out[j] = static_cast<T>(to_float(w[j]) * to_float(h));
    }
}

template <typename T>
inline void swiglu_row(const T* gate, const T* up, T* dst, int64_t f) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= f; i += 16) {  // silu(g) = g * sigmoid(g), from e = exp(-|g|) <= 1
        const __m512 g = load16(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
        const __m512 one_e = _mm512_add_ps(_mm512_set1_ps(1.f), e);
        const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
        __m512 inv = _mm512_rcp14_ps(one_e);  // 1 / (1 + e), one Newton step from 14 bits
        inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(one_e, inv, _mm512_set1_ps(2.f)));
        const __m512 sigmoid = _mm512_mask_mul_ps(inv, neg, inv, e);
        store16(dst + i, _mm512_mul_ps(_mm512_mul_ps(g, sigmoid), load16(up + i)));
    }
#endif
    for (; i < f; ++i) {
        const float g = to_float(gate[i]);
        const float e = std::exp(-std::fabs(g));  // <= 1: no overflow either side
        const float sigmoid = g >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
        dst[i] = static_cast<T>(g * sigmoid * to_float(up[i]));
    }
}

}  // namespace row_ops
