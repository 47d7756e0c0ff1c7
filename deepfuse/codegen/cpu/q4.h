// The int4 tile decoder that the bf16 GEMMs share (bf16_gemm.cpp, vec_gemm.cpp): an int4 weight
// tile to the bf16 VNNI rows that a dense copy of the weight would hold.
#pragma once

#include "amx.h"

#if DEEPFUSE_BF16_DOT
#include <cstdint>

// a * b + c rounded twice, as torch computes it (plain vector * and + may be fused into an FMA)
static inline __m512 mul_add(__m512 a, __m512 b, __m512 c) {
    constexpr int rn = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    return _mm512_add_round_ps(_mm512_mul_round_ps(a, b, rn), c, rn);
}

// One int4 tile (16 columns x 32 k: 256 bytes of nibbles in VNNI order, f32 scale and min per
// column) to bf16 VNNI rows, as q * scale + min rounded once (what the dense copy holds).
static inline void dequant_tile(const uint8_t* nib, const float* scale, const float* min, uint16_t* dst) {
    const __m512 s = _mm512_loadu_ps(scale), mn = _mm512_loadu_ps(min);
    const __m512i lo_cols = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_cols = _mm512_add_epi32(lo_cols, _mm512_set1_epi32(8));
    const __m512 s0 = _mm512_permutexvar_ps(lo_cols, s), s1 = _mm512_permutexvar_ps(hi_cols, s);
    const __m512 m0 = _mm512_permutexvar_ps(lo_cols, mn), m1 = _mm512_permutexvar_ps(hi_cols, mn);
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int r = 0; r < 16; ++r) {  // row r: byte c holds column c's k = 2r (low nibble) and 2r + 1
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(nib + 16 * r));
        const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)));  // columns 0-7
        const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)));  // columns 8-15
        const __m512bh w = _mm512_cvtne2ps_pbh(mul_add(b, s1, m1), mul_add(a, s0, m0));
        _mm512_store_si512(dst + 32 * r, reinterpret_cast<__m512i>(w));
    }
}
#endif
