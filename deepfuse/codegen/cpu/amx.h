// What the AMX kernels share (bf16_gemm.cpp, prefill_attention.cpp, vec_gemm.cpp): the build guards and the
// tile configuration. DEEPFUSE_AMX is defined where the build has AMX tiles, bf16 tile dot
// products and AVX512-BF16 on Linux; DEEPFUSE_BF16_DOT where it has AVX512-BF16 (vdpbf16ps:
// the vector paths of machines without AMX, such as AMD Zen 4, use it).
#pragma once

#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define DEEPFUSE_BF16_DOT 1
#include <immintrin.h>
constexpr bool kBf16DotBuilt = true;  // the vector bf16 kernels are built (AMX builds have them too)
#else
constexpr bool kBf16DotBuilt = false;
#endif

bool amx_available();  // bf16_gemm.cpp: the build has AMX and this process may use the tiles

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define DEEPFUSE_AMX 1
#include <immintrin.h>

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Configures this thread's tiles 0-7 as rows[t] rows of 64 bytes each.
static inline void configure_tiles(const uint8_t (&rows)[8]) {
    TileConfig c;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = rows[t];
        c.colsb[t] = 64;
    }
    // GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the 64: without this
    // barrier the stores of rows and colsb can be dropped as dead (and ldtilecfg faults)
    asm volatile("" : : "r"(&c) : "memory");
    _tile_loadconfig(&c);
}
#endif
