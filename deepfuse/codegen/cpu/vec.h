// AVX-512 helpers shared by the native CPU kernels: 16-lane loads and stores of f32 or bf16
// rows (as f32 lanes; int8 loads too) and a vector exp. Included only where __AVX512F__ is defined.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include <c10/util/BFloat16.h>

// Whether this is an Intel CPU: the decode GEMV tiles' software prefetches were measured faster
// there (2-core Sapphire Rapids VM) and slower on AMD Zen 4, whose hardware prefetchers already
// stream the weight panels (q4a8_gemm.cpp, i8_gemm.cpp; docs/performance.md)
static inline bool intel_cpu() {
    static const bool intel = [] {
        __builtin_cpu_init();
        return __builtin_cpu_is("intel") != 0;
    }();
    return intel;
}

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

static inline __m512 load16(const c10::BFloat16* p) {  // 16 bf16 -> f32 (exact: the high half of each)
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline __m512 load16(const int8_t* p) {  // 16 int8 -> f32 (the integers themselves)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// exp(x) for x <= 0 to about 1 ulp: x = n ln2 + r (Cody-Waite), |r| <= ln2/2, exp(r) by its
// Taylor series to degree 7 (error < 1e-8), times 2^n with scalef (underflows cleanly to 0).
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));  // exp(-104) is 0 in f32; also maps -inf there
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

// Asks for rows of a paged-cache block: `count` rows of `bytes` bytes, `stride` bytes apart,
// every cache line each touches (one contiguous run where the rows are). The block ids a
// sequence reads are scattered, so the hardware prefetcher cannot guess them.
// Hint: _MM_HINT_T0 into L1 (needed soon), _MM_HINT_T1 into L2 (needed after a while).
template <int Hint = _MM_HINT_T0>
static inline void prefetch_rows(const void* rows, int64_t count, int64_t stride, int64_t bytes) {
    const char* p = static_cast<const char*>(rows);
    if (stride == bytes) {
        bytes *= count;
        count = 1;
    }
    for (int64_t r = 0; r < count; ++r) {
        const uintptr_t lo = reinterpret_cast<uintptr_t>(p + r * stride) & ~uintptr_t{63};
        const uintptr_t hi = reinterpret_cast<uintptr_t>(p + r * stride + bytes);
        for (uintptr_t a = lo; a < hi; a += 64) _mm_prefetch(reinterpret_cast<const char*>(a), static_cast<_mm_hint>(Hint));
    }
}

static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }

// f32 -> 16 bf16, rounding to nearest even as c10::BFloat16 does. With AVX512-BF16 one
// vcvtneps2bf16 (a norm row's three roundings had been most of its instructions); it differs
// from c10 only on f32 inputs below 2^-126, which it flushes to zero, and on a NaN's payload
// (both give a quiet NaN). Without it, integer arithmetic on the bits, exactly c10's.
static inline __m256i to_bf16(__m512 x) {
#if defined(__AVX512BF16__)
    return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
#else
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
#endif
}

static inline void store16(c10::BFloat16* p, __m512 x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(x));
}

// x rounded to T's precision (bf16: the f32 of the nearest bf16; f32: x itself)
static inline __m512 round16(__m512 x, const float*) { return x; }
static inline __m512 round16(__m512 x, const c10::BFloat16*) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(x)), 16));
}
