// Paged decode attention for the CPU target: query rows that each attend to a prefix of their
// sequence, keys and values read in place from the paged cache (no gather into a padded copy).
// A decoding sequence has one row; a verify chunk (last token + drafts) one row per token, each
// limited to its own position, so a whole decode/verify step is one call.
//
//   q       [N, H*D]            query rows (f32 or bf16)
//   cache   [2, NB, BS, Hkv, D] the layer's paged k/v cache (same dtype as q), or int8 rows
//           [2, NB, BS, Hkv, D + 4] each ending in its f32 scale (ir.opdefs_llm.quantize_kv_rows):
//           a key's scores and a value's weights are scaled by its row's scale, half the bytes read
//   tables  [N, B] int64        each row's sequence's block ids (rows may be strided, entries not)
//   lens    [N] int64           each row's causal length (its keys: positions 0 .. len-1)
//   window  0, or attend only to the last `window` positions before len
//   out     [N, H*D]            written
//   amx_rows bf16 runs of at least this many rows of one sequence on AMX (see below; 0: never)
//   batch_invariant  a row's result must not depend on the rows beside it: its positions are
//           never split across threads (see position_parts)
//
// Work item: (row, kv head); its H/Hkv query heads share every key and value read.
// Scores of one block at a time, then an online softmax (running max and sum) in float.
// With AVX-512 and a head size of 64, 128 or 256, `decode_avx512` works on segments of up to 512
// positions: every score of the segment (vector dot products over tiles of 16 keys; bf16 keys
// by vdpbf16ps, exact products in f32), one max, one vectorised exp and sum per head, then the
// values with the accumulators in registers. The running max and sum carry across segments.
// Its work item is a row and all of its kv heads where there are rows enough for the threads
// (a block's rows are then read front to back), a row and one kv head otherwise (batch 1).
// The thread's next work item is prefetched into L2 while this one computes, a block of it per
// block of this one: a step's time is mostly waiting on memory (the cache is far larger than
// L3); see decode_avx512 for the measurements. In a step program each thread also warms its share
// of the next op's weights (team::warm, kWarmLines per tile and block): the kernel computes more
// than it reads, so those loads overlap its arithmetic.
// bf16 rows in runs of at least `amx_rows` rows of one sequence (a verify chunk's, a prompt
// chunk's) go to the AMX path (decode_amx.cpp), which reads each key and value once for all of
// the run's query vectors: amx_rows 2 (the default) keeps lone rows on the vector path (faster
// for them), 1 sends every row to AMX (batch invariance), 0 none.
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "balanced.h"

// C: the cache's element: the query's type, or int8_t (rows of D values + their f32 scale)
template <typename C>
constexpr bool kInt8Rows = std::is_same_v<C, int8_t>;

template <typename C>
constexpr int64_t row_elems(int64_t d) {
    return kInt8Rows<C> ? d + 4 : d;
}

// The scale of a cache row of d values (1 for float rows)
template <typename C>
static inline float row_scale(const C* row, int64_t d) {
    if constexpr (kInt8Rows<C>) {
        float s;
        std::memcpy(&s, row + d, sizeof(float));
        return s;
    } else {
        return 1.f;
    }
}

static inline float to_float(float x) { return x; }
static inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
static inline float to_float(int8_t x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
#include "vec.h"

// bf16 keys are dotted in pairs by vdpbf16ps where the build has it
template <typename T>
constexpr bool kPairScores =
#if defined(__AVX512BF16__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

// int8 keys with bf16 queries: each tile's rows converted once to bf16 (their integers: exact) and
// then dotted in pairs by vdpbf16ps as bf16 keys are (converting to f32 for every head's f32 dot
// had made the scores three times the work of bf16 keys')
template <typename T, typename C>
constexpr bool kStagedPairs = kPairScores<T> && kInt8Rows<C>;

// int8 keys with bf16 queries where the build has AVX512-VNNI: integer scores by vpdpbusd
// (kVnniScores replaces kStagedPairs). The query is split into two int8 parts, q ~ s1 * q1 + s2 * q2
// with s1 = max|q| / 127 and s2 = s1 / 254: the residual's step is ~1/32,000 of max|q|, finer than
// bf16's own rounding of q (1/256 of each value). A tile of 16 keys is transposed into 16-key
// columns of 4 dims (a 16 x 16 dword transpose, once for every head) and each part's scores are
// 16 vpdpbusd a head, against 32 vdpbf16ps and a 45-instruction horizontal sum per head before
// (and the tile's conversion to bf16): ~2.3x fewer instructions for the scores.
template <typename T, typename C>
constexpr bool kVnniScores =
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    kStagedPairs<T, C>;
#else
    false;
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// One head's query split in two int8 parts (see kVnniScores): q1 and q2 [D] (-127..127), their steps
// s[0..1] and 128 * the sum of each part in c[0..1] (what the keys' +128 offset adds to its dots).
template <typename T, int DV>
static inline void split_query(const T* src, int8_t* q1, int8_t* q2, float* s, int32_t* c) {
    __m512 x[DV], top = _mm512_setzero_ps();
    for (int v = 0; v < DV; ++v) {
        x[v] = load16(src + 16 * v);
        top = _mm512_max_ps(top, _mm512_abs_ps(x[v]));
    }
    const float amax = _mm512_reduce_max_ps(top);
    s[0] = amax / 127.f;
    s[1] = s[0] / 254.f;
    const __m512 inv1 = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f), inv2 = _mm512_set1_ps(amax > 0.f ? 254.f * 127.f / amax : 0.f);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
    __m512i sum1 = _mm512_setzero_si512(), sum2 = _mm512_setzero_si512();
    for (int v = 0; v < DV; ++v) {
        const __m512i a = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(x[v], inv1)), hi), lo);
        const __m512 r = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(a), _mm512_set1_ps(s[0]), x[v]);  // x - a * s1
        const __m512i b = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(r, inv2)), hi), lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q1 + 16 * v), _mm512_cvtepi32_epi8(a));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q2 + 16 * v), _mm512_cvtepi32_epi8(b));
        sum1 = _mm512_add_epi32(sum1, a);
        sum2 = _mm512_add_epi32(sum2, b);
    }
    c[0] = 128 * _mm512_reduce_add_epi32(sum1);
    c[1] = 128 * _mm512_reduce_add_epi32(sum2);
}

// 16 rows of 16 dwords (r[i]: row i) -> t[c]: dword c of every row (lane i: row i's)
static inline void transpose16(const __m512i r[16], __m512i t[16]) {
    __m512i a[16], b[16], s[4][4];
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: rows 2i, 2i+1 interleaved, dwords 4L, 4L+1 (a[2i]) and 4L+2, 4L+3
        a[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {  // b[4i+e], lane L: dword 4L+e of rows 4i .. 4i+3
        b[4 * i] = _mm512_unpacklo_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 1] = _mm512_unpackhi_epi64(a[4 * i], a[4 * i + 2]);
        b[4 * i + 2] = _mm512_unpacklo_epi64(a[4 * i + 1], a[4 * i + 3]);
        b[4 * i + 3] = _mm512_unpackhi_epi64(a[4 * i + 1], a[4 * i + 3]);
    }
    for (int e = 0; e < 4; ++e) {  // gather lane L of b[e], b[4+e], b[8+e], b[12+e] into t[4L+e]
        s[e][0] = _mm512_shuffle_i32x4(b[e], b[4 + e], _MM_SHUFFLE(2, 0, 2, 0));
        s[e][1] = _mm512_shuffle_i32x4(b[e], b[4 + e], _MM_SHUFFLE(3, 1, 3, 1));
        s[e][2] = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], _MM_SHUFFLE(2, 0, 2, 0));
        s[e][3] = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], _MM_SHUFFLE(3, 1, 3, 1));
        t[e] = _mm512_shuffle_i32x4(s[e][0], s[e][2], _MM_SHUFFLE(2, 0, 2, 0));
        t[8 + e] = _mm512_shuffle_i32x4(s[e][0], s[e][2], _MM_SHUFFLE(3, 1, 3, 1));
        t[4 + e] = _mm512_shuffle_i32x4(s[e][1], s[e][3], _MM_SHUFFLE(2, 0, 2, 0));
        t[12 + e] = _mm512_shuffle_i32x4(s[e][1], s[e][3], _MM_SHUFFLE(3, 1, 3, 1));
    }
}

// acc += (16 keys' 4 dims as unsigned bytes) . (the query's 4 dims, broadcast from memory)
static inline __m512i dot_quad(__m512i acc, __m512i keys, const int8_t* q4) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(keys), "m"(*reinterpret_cast<const int32_t*>(q4)));
    return acc;
}
#endif

// Sums each of 16 vectors: lane i of the result is the sum of p[i]'s 16 lanes (a butterfly
// of in-lane unpacks, then 128-bit lane shuffles: 45 instructions instead of 16 reductions).
static inline __m512 sum16(__m512 p[16]) {
    __m512 s1[8], s2[4], s3[2];
    for (int k = 0; k < 8; ++k)  // per 128-bit lane: keys (2k, 2k+1, 2k, 2k+1)
        s1[k] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * k], p[2 * k + 1]), _mm512_unpackhi_ps(p[2 * k], p[2 * k + 1]));
    for (int k = 0; k < 4; ++k) {  // per 128-bit lane: keys 4k .. 4k+3
        const __m512d x = _mm512_castps_pd(s1[2 * k]), y = _mm512_castps_pd(s1[2 * k + 1]);
        s2[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; ++k)  // 128-bit lanes: keys 8k..8k+3 (twice), 8k+4..8k+7 (twice)
        s3[k] = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                              _mm512_shuffle_f32x4(s2[2 * k], s2[2 * k + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// One key row dotted with one head's query: q as DV f32 vectors (f32 keys), or as DV/2 vectors
// of bf16 pairs (bf16 keys, unscaled: the products are exact, the caller scales the sums).
template <typename T, int DV>
static inline __m512 row_dot(const __m512* qv, const __m512i* qb, const T* k) {
    __m512 d = _mm512_setzero_ps();
    if constexpr (kPairScores<T>) {
        for (int v = 0; v < DV / 2; ++v)  // the key read by the instruction itself (the intrinsic
            // makes GCC 12 bounce the key through the stack)
            asm("vdpbf16ps %2, %1, %0" : "+v"(d) : "v"(qb[v]), "m"(*reinterpret_cast<const __m512i*>(k + 32 * v)));
    } else {
        for (int v = 0; v < DV; ++v) d = _mm512_fmadd_ps(qv[v], load16(k + 16 * v), d);
    }
    return d;
}

// The scores of `cnt` (1..16) consecutive key rows as one vector (lane i: row i; dead lanes 0).
template <typename T, int DV>
static inline __m512 tile_scores(const __m512* qv, const __m512i* qb, const T* k, int64_t stride, int cnt) {
    __m512 dots[16];
    if (cnt == 16) {
        for (int i = 0; i < 16; ++i) dots[i] = row_dot<T, DV>(qv, qb, k + i * stride);
    } else {
        for (int i = 0; i < 16; ++i) dots[i] = i < cnt ? row_dot<T, DV>(qv, qb, k + i * stride) : _mm512_setzero_ps();
    }
    return sum16(dots);
}

static inline __mmask16 first_lanes(int64_t count) {
    return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

constexpr int64_t kSegment = 512;  // positions whose scores are held at once
constexpr int64_t kAhead = 2;      // blocks prefetched ahead within an item
constexpr int64_t kItemsAhead = 1;  // the work item whose blocks go to L2 while this one computes
constexpr int64_t kMaxHeads = 16;   // query heads one work item may cover
constexpr int64_t kWarmLines = 32;   // lines of the next op's weights warmed per tile of scores and block of values

// One row's `heads` heads from their `parts` spans, merged in order: src holds, per span and head,
// the running max, the sum and D = 16 * DV unnormalised value sums; dst the heads' D outputs each.
template <typename T, int DV>
static void merge_spans(const float* src, int64_t parts, int64_t heads, T* dst) {
    constexpr int64_t D = DV * 16;
    for (int64_t j = 0; j < heads; ++j, dst += D) {
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < parts; ++c) top = std::max(top, src[(c * heads + j) * (D + 2)]);
        __m512 sum[DV];
        for (int v = 0; v < DV; ++v) sum[v] = _mm512_setzero_ps();
        float l = 0.f;
        for (int64_t c = 0; c < parts; ++c) {
            const float* p = src + (c * heads + j) * (D + 2);
            if (p[1] == 0.f) continue;  // an empty span (its max -inf)
            const float w = std::exp(p[0] - top);
            l += p[1] * w;
            for (int v = 0; v < DV; ++v) sum[v] = _mm512_fmadd_ps(_mm512_loadu_ps(p + 2 + 16 * v), _mm512_set1_ps(w), sum[v]);
        }
        const __m512 inv = _mm512_set1_ps(l > 0.f ? 1.f / l : 0.f);
        for (int v = 0; v < DV; ++v) store16(dst + 16 * v, _mm512_mul_ps(sum[v], inv));
    }
}

// G query heads per kv head, DV: the head size in 16-float vectors (4, 8 or 16); a work item is one
// row and `kh` consecutive kv heads (kh divides hkv, G * kh <= kMaxHeads). Same contract as
// `decode`. Per segment: scores (per tile of 16 keys, each kv head in turn and each of its G
// heads with its query in registers, so the tile is read from memory once and again from L1),
// softmax, values (a block at a time, each kv head's G accumulators in registers).
//
// Prefetching, all into L2, a block at a time: keys kAhead blocks on and the next item's keys
// while the scores are computed, values kAhead blocks on and the next item's values while the
// values are summed. An item of all of a row's kv heads reads each block's rows front to back:
// its keys (or values) are one run of bytes. Into L1 instead, or keys and values together, the
// prefetches came in bursts that stalled the core once its miss buffers filled (perf: a quarter
// of the kernel's samples on prefetch instructions); 64 sequences of 100-630 positions, int8
// rows, two threads: 24.1 -> 20.6 ms a step for 30 layers (13.0 ms with every block in L2).
//
// Split (parts > 1: few items for the threads, see position_parts): each item's positions are cut
// into `parts` spans of whole blocks, one work item each; a span leaves its heads' running max,
// sum and unnormalised values in `partial`, and the thread that finishes a row's last span merges
// them, span by span in order (the same bits whichever thread it is; no second fork, which costs
// ~0.85 us on a team).
template <typename T, typename C, int G, int DV>
static void decode_avx512(const T* q, const C* cache, const int64_t* tables, const int64_t* lens, T* out, int64_t n,
                          const int64_t* rows, int64_t hkv, int64_t bs, int64_t nb, int64_t tb, int64_t window, float scale,
                          int64_t kh, int64_t parts) {
    constexpr int64_t D = DV * 16, R = row_elems<C>(D);
    constexpr int kValueVecs = DV > 8 ? 8 : DV;  // value vectors per pass over a block's rows
    const int64_t h = G * hkv, groups = hkv / kh;
    const int64_t half = nb * bs * hkv * R;
    const int64_t stride = hkv * R;  // between a head's consecutive positions
    const int64_t run = kh * R * static_cast<int64_t>(sizeof(C));  // bytes an item reads of a row
    const int64_t pitch = stride * static_cast<int64_t>(sizeof(C));
    // an item: (row, group of kv heads, span of positions); the span's positions [lo, hi)
    auto row_of = [&](int64_t item) { return rows != nullptr ? rows[item / parts / groups] : item / parts / groups; };
    auto span_of = [&](int64_t item, int64_t& lo, int64_t& hi) {
        const int64_t len = lens[row_of(item)], first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        if (parts == 1) {
            lo = first, hi = len;
            return;
        }
        const int64_t blocks = (len - 1) / bs - first / bs + 1, per = (blocks + parts - 1) / parts, part = item % parts;
        lo = std::max(first, (first / bs + part * per) * bs);
        hi = std::min(len, (first / bs + (part + 1) * per) * bs);
        hi = std::max(lo, hi);
    };
    auto cost = [&](int64_t item) {  // positions read, plus a constant for the rest of an item
        int64_t lo, hi;
        span_of(item, lo, hi);
        return kh * (hi - lo) + 32;
    };
    // parts > 1: per item, each head's running max and sum, then its D unnormalised sums; per
    // (row, group), its spans done (the thread that finishes the last one merges them)
    const int64_t heads = G * kh;
    // (not zeroed: every span writes its own)
    std::unique_ptr<float[]> partial(parts > 1 ? new float[n * groups * parts * heads * (D + 2)] : nullptr);
    std::unique_ptr<std::atomic<int64_t>[]> spans_done(parts > 1 ? new std::atomic<int64_t>[n * groups] : nullptr);
    for (int64_t i = 0; parts > 1 && i < n * groups; ++i) spans_done[i].store(0, std::memory_order_relaxed);
    balanced::balanced_for(n * groups * parts, cost, [&](int64_t item, int64_t end) {
        alignas(64) float score[kMaxHeads][kSegment + 16];  // scores, then softmax weights (a short
                                                            // tile's dead lanes may spill past the segment)
        alignas(64) float acc[kMaxHeads][D];   // weighted sums of values
        alignas(64) uint16_t staged[16 * D];   // kStagedPairs: a tile's int8 keys as bf16
        alignas(64) int8_t qparts[kMaxHeads][2][D];  // kVnniScores: each head's query in two int8 parts,
        float qstep[kMaxHeads][2];                   // their steps
        int32_t qsum[kMaxHeads][2];                  // and 128 * their sums
        const int64_t s = row_of(item), kv0 = item / parts % groups * kh;
        int64_t first, len;  // the item's positions
        span_of(item, first, len);
        // the thread's item kItemsAhead on: its blocks are prefetched into L2 while this one
        // computes, one block of it per block of this one
        const int64_t ahead = item + kItemsAhead;
        const bool has_ahead = ahead < end;
        const int64_t ns = has_ahead ? row_of(ahead) : 0;
        const int64_t nkv0 = ahead / parts % groups * kh;
        int64_t nfirst = 0, nlen = 0;
        if (has_ahead) span_of(ahead, nfirst, nlen);
        const int64_t* ntable = tables + ns * tb;
        const int64_t* table = tables + s * tb;
        // block b's counterpart in the next item (as far into it as b is into this one) to L2: its
        // keys (half 0) or values (half 1)
        auto prefetch_next_item = [&](int64_t b, int64_t which) {
            const int64_t at_b = nfirst / bs + (b - first / bs);
            if (has_ahead && at_b * bs < nlen)
                prefetch_rows<_MM_HINT_T1>(cache + which * half + ntable[at_b] * bs * stride + nkv0 * R, bs, pitch, run);
        };
        const C* kbase = cache + kv0 * R;
        const C* vbase = cache + half + kv0 * R;
        const T* qbase = q + s * h * D + kv0 * G * D;  // the item's heads' queries, one after another
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if constexpr (kVnniScores<T, C>)
            for (int64_t j = 0; j < heads; ++j) split_query<T, DV>(qbase + j * D, qparts[j][0], qparts[j][1], qstep[j], qsum[j]);
#endif
        float m[kMaxHeads], l[kMaxHeads];
        for (int64_t j = 0; j < heads; ++j) {
            m[j] = -std::numeric_limits<float>::infinity();
            l[j] = 0.f;
            for (int v = 0; v < DV; ++v) _mm512_store_ps(acc[j] + 16 * v, _mm512_setzero_ps());
        }
        for (int64_t s0 = first; s0 < len; s0 += kSegment) {
            const int64_t s1 = std::min(len, s0 + kSegment);
            for (int64_t p0 = s0; p0 < s1;) {  // tiles of up to 16 positions, never across a block
                const int64_t b = p0 / bs, at = table[b] * bs - b * bs;  // position p's row: at + p
                const int cnt = static_cast<int>(std::min<int64_t>({16, s1 - p0, (b + 1) * bs - p0}));
                if (p0 == std::max(s0, b * bs)) {  // entering block b
                    prefetch_next_item(b, 0);
                    if ((b + kAhead) * bs < s1) prefetch_rows<_MM_HINT_T1>(kbase + table[b + kAhead] * bs * stride, bs, pitch, run);
                }
                for (int64_t kk = 0; kk < kh; ++kk) {  // each kv head of the tile, its G heads' scores
                    const C* tile = kbase + (at + p0) * stride + kk * R;
                    __m512 key_scale = _mm512_set1_ps(1.f);  // int8 rows: each row's scale in its lane
                    if constexpr (kInt8Rows<C>) {
                        alignas(64) float sc[16] = {};
                        for (int i = 0; i < cnt; ++i) sc[i] = row_scale(tile + i * stride, D);
                        key_scale = _mm512_load_ps(sc);
                    }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                    if constexpr (kVnniScores<T, C>) {
                        __m512i cols[DV / 4][16];  // cols[h][c]: dims 64h+4c .. +3 of the 16 keys, as unsigned bytes
                        const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
                        for (int hh = 0; hh < DV / 4; ++hh) {
                            __m512i r[16];
                            for (int i = 0; i < 16; ++i)  // dead rows: zeros (their lanes are never read)
                                r[i] = i < cnt ? _mm512_xor_si512(_mm512_loadu_si512(tile + i * stride + 64 * hh), flip)
                                               : _mm512_setzero_si512();
                            transpose16(r, cols[hh]);
                        }
                        for (int j = 0; j < G; ++j) {
                            const int64_t hj = kk * G + j;
                            __m512i d1 = _mm512_setzero_si512(), d2 = _mm512_setzero_si512();
                            for (int hh = 0; hh < DV / 4; ++hh)
                                for (int c = 0; c < 16; ++c) {
                                    d1 = dot_quad(d1, cols[hh][c], qparts[hj][0] + 64 * hh + 4 * c);
                                    d2 = dot_quad(d2, cols[hh][c], qparts[hj][1] + 64 * hh + 4 * c);
                                }
                            const __m512 dot = _mm512_fmadd_ps(
                                _mm512_cvtepi32_ps(_mm512_sub_epi32(d2, _mm512_set1_epi32(qsum[hj][1]))),
                                _mm512_set1_ps(qstep[hj][1]),
                                _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(d1, _mm512_set1_epi32(qsum[hj][0]))),
                                              _mm512_set1_ps(qstep[hj][0])));
                            _mm512_storeu_ps(&score[hj][p0 - s0], _mm512_mul_ps(_mm512_mul_ps(dot, key_scale), _mm512_set1_ps(scale)));
                        }
                        continue;
                    }
#endif
                    if constexpr (kStagedPairs<T, C>) {
                        for (int i = 0; i < cnt; ++i)
                            for (int v = 0; v < DV / 2; ++v) {
                                const C* r = tile + i * stride + 32 * v;
                                _mm512_store_si512(staged + i * D + 32 * v, reinterpret_cast<__m512i>(
                                                       _mm512_cvtne2ps_pbh(load16(r + 16), load16(r))));
                            }
                    }
                    for (int j = 0; j < G; ++j) {  // every head's scores while the tile's keys are in L1
                        const T* src = qbase + (kk * G + j) * D;
                        __m512 qv[DV];     // f32 keys: the query, scaled
                        __m512i qb[DV / 2];  // bf16 keys: the query as it is (scaled after the dot)
                        constexpr bool pairs = kPairScores<C> || kStagedPairs<T, C>;
                        if constexpr (pairs) {
                            for (int v = 0; v < DV / 2; ++v) qb[v] = _mm512_loadu_si512(src + 32 * v);
                        } else {
                            for (int v = 0; v < DV; ++v) qv[v] = _mm512_mul_ps(load16(src + 16 * v), _mm512_set1_ps(scale));
                        }
                        __m512 sc;
                        if constexpr (kStagedPairs<T, C>)
                            sc = tile_scores<c10::BFloat16, DV>(qv, qb, reinterpret_cast<const c10::BFloat16*>(staged), D, cnt);
                        else
                            sc = tile_scores<C, DV>(qv, qb, tile, stride, cnt);
                        if constexpr (pairs) sc = _mm512_mul_ps(sc, _mm512_set1_ps(scale));
                        if constexpr (kInt8Rows<C>) sc = _mm512_mul_ps(sc, key_scale);
                        _mm512_storeu_ps(&score[kk * G + j][p0 - s0], sc);  // dead lanes: overwritten or never read
                    }
                }
                team::warm(kWarmLines);  // in a program: this thread's share of the next op's weights
                p0 += cnt;
            }
            const int64_t cnt = s1 - s0;
            for (int64_t j = 0; j < heads; ++j) {  // softmax over the segment, carrying the running max and sum
                __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
                for (int64_t i = 0; i < cnt; i += 16)
                    top = _mm512_mask_max_ps(top, first_lanes(cnt - i), top, _mm512_loadu_ps(&score[j][i]));
                const float t = std::max(m[j], _mm512_reduce_max_ps(top));
                __m512 sum = _mm512_setzero_ps();
                for (int64_t i = 0; i < cnt; i += 16) {
                    const __m512 w = _mm512_maskz_mov_ps(
                        first_lanes(cnt - i), exp16(_mm512_sub_ps(_mm512_load_ps(&score[j][i]), _mm512_set1_ps(t))));
                    _mm512_store_ps(&score[j][i], w);
                    sum = _mm512_add_ps(sum, w);
                }
                if (t > m[j]) {  // rescale what came before (by 0 after the first segment's: m = -inf)
                    const float rescale = std::exp(m[j] - t);
                    for (int v = 0; v < DV; ++v)
                        _mm512_store_ps(acc[j] + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc[j] + 16 * v),
                                                                       _mm512_set1_ps(rescale)));
                    l[j] *= rescale;
                    m[j] = t;
                }
                l[j] += _mm512_reduce_add_ps(sum);
            }
            for (int64_t p0 = s0; p0 < s1;) {  // values, a block at a time: each row converted once, added to G accumulators
                const int64_t b = p0 / bs, p1 = std::min(s1, (b + 1) * bs);
                prefetch_next_item(b, 1);
                team::warm(kWarmLines);
                if (const int64_t ahead_b = b + kAhead; ahead_b * bs < s1)
                    prefetch_rows<_MM_HINT_T1>(vbase + table[ahead_b] * bs * stride, std::min(s1 - ahead_b * bs, bs), pitch, run);
                for (int64_t kk = 0; kk < kh; ++kk) {
                    const C* vb = vbase + (table[b] * bs - b * bs) * stride + kk * R;
                    for (int v0 = 0; v0 < DV; v0 += kValueVecs) {  // a head size of 256: two passes, G * 8 accumulators each
                        __m512 a[G][kValueVecs];
                        for (int j = 0; j < G; ++j)
                            for (int v = 0; v < kValueVecs; ++v) a[j][v] = _mm512_load_ps(acc[kk * G + j] + 16 * (v0 + v));
                        for (int64_t p = p0; p < p1; ++p) {
                            __m512 val[kValueVecs];
                            for (int v = 0; v < kValueVecs; ++v) val[v] = load16(vb + p * stride + 16 * (v0 + v));
                            const float vs = row_scale(vb + p * stride, D);
                            for (int j = 0; j < G; ++j) {
                                const float wj = score[kk * G + j][p - s0];
                                const __m512 w = _mm512_set1_ps(kInt8Rows<C> ? wj * vs : wj);
                                for (int v = 0; v < kValueVecs; ++v) a[j][v] = _mm512_fmadd_ps(w, val[v], a[j][v]);
                            }
                        }
                        for (int j = 0; j < G; ++j)
                            for (int v = 0; v < kValueVecs; ++v) _mm512_store_ps(acc[kk * G + j] + 16 * (v0 + v), a[j][v]);
                    }
                }
                p0 = p1;
            }
        }
        if (parts > 1) {  // the span's running max, sum and sums; the last of its row's spans merges them
            float* dst = partial.get() + item * heads * (D + 2);
            for (int64_t j = 0; j < heads; ++j, dst += D + 2) {
                dst[0] = m[j], dst[1] = l[j];
                std::memcpy(dst + 2, acc[j], D * sizeof(float));
            }
            if (spans_done[item / parts].fetch_add(1, std::memory_order_acq_rel) == parts - 1) {
                const int64_t first_span = item / parts * parts;
                merge_spans<T, DV>(partial.get() + first_span * heads * (D + 2), parts, heads,
                                   out + s * h * D + kv0 * G * D);
            }
            return;
        }
        for (int64_t j = 0; j < heads; ++j) {
            T* dst = out + s * h * D + kv0 * G * D + j * D;
            const __m512 inv = _mm512_set1_ps(l[j] > 0.f ? 1.f / l[j] : 0.f);
            for (int v = 0; v < DV; ++v) store16(dst + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc[j] + 16 * v), inv));
        }
    });
}

// Kv heads per work item: every one of a row's (each block's rows then read front to back, once)
// where the rows alone make enough items for the threads; one otherwise (batch 1: the kv heads
// are the only parallel work). A head's result does not depend on it (the same operations in the
// same order either way).
static int64_t heads_per_item(int64_t n, int64_t g, int64_t hkv) {
    if (n < 8 * team::threads()) return 1;
    int64_t kh = hkv;
    while (kh > 1 && (hkv % kh != 0 || g * kh > kMaxHeads)) --kh;
    return kh;
}

// Spans of positions per item: 1 (each item reads all of its row's positions) unless `split` and
// the items do not share out evenly over the threads (batch 1: SmolLM2's 3 kv heads on 2 threads,
// one thread computing two items while the other waits; one kv head: one thread for the whole
// attention). Then up to as many spans as make the items a multiple of the threads, and no more
// than two items a thread, while the longest row's spans are each worth kMinSpanWork (positions x
// head size x query heads per kv head): a span costs a few microseconds of its own where the
// caches are cold (and a fork where there was one item), so a split pays only on enough work
// (benchmarks/results/decode_attention_xeon.json, 2-core Xeon, 30 layers' calls: SmolLM2's 3 kv
// heads 1.12x at 1,024 positions, 1.22x at 4,096; Gemma 3 1B's one kv head 1.56x at 256; with
// spans of at least 128 positions, SmolLM2 was 0.91x at 256: commit 5cb0334, no result file kept).
// A row's result depends on its spans (the merge rounds differently), so split is off where a
// request's tokens must not depend on its batch, and for f32 rows (see decode).
constexpr int64_t kMinSpanWork = 1 << 16;
static int64_t position_parts(bool split, int64_t n, int64_t items, const int64_t* lens, const int64_t* rows, int64_t window,
                              int64_t work_per_position) {
    const int64_t threads = team::threads();
    if (!split || items >= 2 * threads || items % threads == 0) return 1;
    int64_t longest = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t len = lens[rows != nullptr ? rows[i] : i];
        longest = std::max(longest, window > 0 ? std::min(len, window) : len);
    }
    const int64_t even = std::min(threads / std::gcd(items, threads), (2 * threads + items - 1) / items);
    return std::max<int64_t>(1, std::min(even, longest * work_per_position / kMinSpanWork));
}

template <typename T, typename C, int DV>
static bool decode_heads(const T* q, const C* cache, const int64_t* tables, const int64_t* lens, T* out, int64_t n,
                         const int64_t* rows, int64_t g, int64_t hkv, int64_t bs, int64_t nb, int64_t tb, int64_t window, float scale,
                         bool split) {
    const int64_t kh = heads_per_item(n, g, hkv);
    const int64_t parts = position_parts(split, n, n * (hkv / kh), lens, rows, window, DV * 16 * g);
    switch (g) {
#define DEEPFUSE_G(G) \
    case G: decode_avx512<T, C, G, DV>(q, cache, tables, lens, out, n, rows, hkv, bs, nb, tb, window, scale, kh, parts); return true;
        DEEPFUSE_G(1) DEEPFUSE_G(2) DEEPFUSE_G(3) DEEPFUSE_G(4) DEEPFUSE_G(5) DEEPFUSE_G(6) DEEPFUSE_G(7) DEEPFUSE_G(8)
#undef DEEPFUSE_G
        default: return false;
    }
}
#endif

// Runs the vector kernel where it applies (AVX-512, head size 64, 128 or 256, 1 to 8 query heads per
// kv head); false otherwise.
template <typename T, typename C>
static bool decode_fast(const T* q, const C* cache, const int64_t* tables, const int64_t* lens, T* out, int64_t n,
                        const int64_t* rows, int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t nb, int64_t tb, int64_t window,
                        float scale, bool split) {
#if defined(__AVX512F__)
    if (d == 64) return decode_heads<T, C, 4>(q, cache, tables, lens, out, n, rows, h / hkv, hkv, bs, nb, tb, window, scale, split);
    if (d == 128) return decode_heads<T, C, 8>(q, cache, tables, lens, out, n, rows, h / hkv, hkv, bs, nb, tb, window, scale, split);
    if (d == 256) return decode_heads<T, C, 16>(q, cache, tables, lens, out, n, rows, h / hkv, hkv, bs, nb, tb, window, scale, split);
#endif
    return false;
}

template <typename T, typename C>
static void decode_plain(const T* q, const C* cache, const int64_t* tables, const int64_t* lens, T* out, int64_t n,
                   const int64_t* rows, int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t nb, int64_t tb, int64_t window,
                   float scale) {
    const int64_t g = h / hkv;
    const int64_t r = row_elems<C>(d), half = nb * bs * hkv * r;  // elements of the k half; the v half follows
    team::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qf(g * d), acc(g * d), score(g * bs), m(g), l(g), row(d);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t s = rows != nullptr ? rows[item / hkv] : item / hkv, kv = item % hkv, len = lens[s];
            // the thread's next item: its blocks are prefetched into L2 while this one computes,
            // one block of it per block of this one
            const bool has_next = item + 1 < end;
            const int64_t ns = has_next ? (rows != nullptr ? rows[(item + 1) / hkv] : (item + 1) / hkv) : 0;
            const int64_t nkv = (item + 1) % hkv, nlen = has_next ? lens[ns] : 0;
            const int64_t nfirst = window > 0 ? std::max<int64_t>(0, nlen - window) : 0;
            const int64_t* ntable = tables + ns * tb;
            const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
            for (int64_t j = 0; j < g; ++j) {
                const T* src = q + s * h * d + (kv * g + j) * d;
                for (int64_t e = 0; e < d; ++e) qf[j * d + e] = static_cast<float>(src[e]) * scale;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
            std::fill(l.begin(), l.end(), 0.f);
            for (int64_t b = first / bs; b * bs < len; ++b) {
                const int64_t block = tables[s * tb + b];
                const int64_t lo = std::max(first, b * bs) - b * bs, hi = std::min(len, (b + 1) * bs) - b * bs;
                const C* kb = cache + (block * bs * hkv + kv) * r;
                const C* vb = cache + half + (block * bs * hkv + kv) * r;
                for (int64_t p = lo; p < hi; ++p) {  // scores: each key row converted once, dotted with g queries
                    const C* kp = kb + p * hkv * r;
                    const float ks = row_scale(kp, d);
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) row[e] = to_float(kp[e]) * ks;
                    for (int64_t j = 0; j < g; ++j) {
                        const float* qj = qf.data() + j * d;
                        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                        for (int64_t e = 0; e < d; ++e) dot += qj[e] * row[e];
                        score[j * bs + p] = dot;
                    }
                }
                for (int64_t j = 0; j < g; ++j) {  // online softmax: rescale what came before
                    float top = m[j];
                    for (int64_t p = lo; p < hi; ++p) top = std::max(top, score[j * bs + p]);
                    const float rescale = std::exp(m[j] - top);  // 0 on the first block (m = -inf)
                    float* aj = acc.data() + j * d;
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) aj[e] *= rescale;
                    float sum = l[j] * rescale;
                    for (int64_t p = lo; p < hi; ++p) {
                        const float w = std::exp(score[j * bs + p] - top);
                        score[j * bs + p] = w;
                        sum += w;
                    }
                    m[j] = top;
                    l[j] = sum;
                }
                for (int64_t p = lo; p < hi; ++p) {  // values: each row converted once, added to g accumulators
                    const C* vp = vb + p * hkv * r;
                    const float vs = row_scale(vp, d);
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) row[e] = to_float(vp[e]) * vs;
                    for (int64_t j = 0; j < g; ++j) {
                        const float w = score[j * bs + p];
                        float* aj = acc.data() + j * d;
#pragma omp simd
                        for (int64_t e = 0; e < d; ++e) aj[e] += w * row[e];
                    }
                }
            }
            for (int64_t j = 0; j < g; ++j) {
                T* dst = out + s * h * d + (kv * g + j) * d;
                const float inv = l[j] > 0.f ? 1.f / l[j] : 0.f;
                for (int64_t e = 0; e < d; ++e) dst[e] = static_cast<T>(acc[j * d + e] * inv);
            }
        }
    });
}

// decode_amx.cpp: whether the AMX kernel takes these shapes; the spans of rows it would run
// together (first row, count); and the kernel itself over a list of spans
bool amx_decode_applies(int64_t d, int64_t bs, int64_t g);
std::vector<std::pair<int64_t, int64_t>> decode_spans(const int64_t* tables, const int64_t* lens, int64_t n, int64_t tb,
                                                      int64_t bs, int64_t g);
void paged_decode_amx(const c10::BFloat16* q, const c10::BFloat16* cache, const int64_t* tables, const int64_t* lens,
                      c10::BFloat16* out, const std::vector<std::pair<int64_t, int64_t>>& spans, int64_t h, int64_t hkv,
                      int64_t d, int64_t bs, int64_t nb, int64_t tb, int64_t window, float scale);

// Rows in spans of at least amx_rows rows (a verify chunk's, a prompt chunk's) on AMX tiles
// where they apply (bf16); the other rows on the vector kernel (faster for a lone row).
template <typename T, typename C>
static void decode(const T* q, const C* cache, const int64_t* tables, const int64_t* lens, T* out, int64_t n,
                   int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t nb, int64_t tb, int64_t window,
                   float scale, int64_t amx_rows, bool batch_invariant) {
    std::vector<int64_t> rest;  // rows left to the vector kernel (all of them when empty and not `split`)
    bool on_amx = false;  // some rows went to AMX: the vector kernel takes `rest`
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, T>) {
        if (amx_rows > 0 && n > 0 && amx_decode_applies(d, bs, h / hkv)) {
            std::vector<std::pair<int64_t, int64_t>> amx;
            for (const auto& span : decode_spans(tables, lens, n, tb, bs, h / hkv)) {
                if (span.second >= amx_rows) {
                    amx.push_back(span);
                } else {
                    for (int64_t r = span.first; r < span.first + span.second; ++r) rest.push_back(r);
                }
            }
            if (!amx.empty()) {
                paged_decode_amx(q, cache, tables, lens, out, amx, h, hkv, d, bs, nb, tb, window, scale);
                on_amx = true;
                if (rest.empty()) return;
            }
        }
    }
    const int64_t* rows = on_amx ? rest.data() : nullptr;
    const int64_t count = on_amx ? static_cast<int64_t>(rest.size()) : n;
    // positions split over the threads for bf16 rows only: an f32 build's verify rows must compute
    // what its single-row steps compute (speculation keeps the output of decoding without drafts)
    const bool split = !batch_invariant && std::is_same_v<T, c10::BFloat16>;
    if (!decode_fast<T, C>(q, cache, tables, lens, out, count, rows, h, hkv, d, bs, nb, tb, window, scale, split))
        decode_plain<T, C>(q, cache, tables, lens, out, count, rows, h, hkv, d, bs, nb, tb, window, scale);
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor tables, torch::Tensor lens,
                           int64_t num_heads, int64_t window, double scale, torch::Tensor out, int64_t amx_rows,
                           bool batch_invariant) {
    TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && tables.stride(1) == 1 && lens.is_contiguous() &&
                out.is_contiguous(), "paged_decode: operands must be contiguous (tables: along a row)");
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2, "paged_decode: cache must be [2, NB, BS, Hkv, D]");
    const bool int8 = cache.scalar_type() == torch::kInt8;
    TORCH_CHECK((int8 || q.scalar_type() == cache.scalar_type()) && out.scalar_type() == q.scalar_type(),
                "paged_decode: q and out must share a dtype, the cache that dtype or int8");
    TORCH_CHECK(tables.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64,
                "paged_decode: tables and lens must be int64");
    const int64_t n = q.size(0), nb = cache.size(1), bs = cache.size(2), hkv = cache.size(3);
    const int64_t d = int8 ? cache.size(4) - 4 : cache.size(4);
    TORCH_CHECK(q.size(1) == num_heads * d && num_heads % hkv == 0, "paged_decode: q must be [N, H*D]");
    TORCH_CHECK(tables.size(0) == n && lens.size(0) == n, "paged_decode: one table row and length per query row");
    const int64_t* tab = tables.data_ptr<int64_t>();
    for (int64_t s = 0; s < n; ++s) {  // every block a sequence reads must exist
        const int64_t len = lens.data_ptr<int64_t>()[s];
        TORCH_CHECK(len >= 1 && len <= tables.size(1) * bs, "paged_decode: sequence length outside its block table");
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        for (int64_t b = first / bs; b * bs < len; ++b)
            TORCH_CHECK(tab[s * tables.stride(0) + b] >= 0 && tab[s * tables.stride(0) + b] < nb,
                        "paged_decode: block id outside the cache");
    }
    auto run = [&](auto* qp) {
        using T = std::remove_pointer_t<decltype(qp)>;
        const int64_t* tp = tables.data_ptr<int64_t>();
        const int64_t* lp = lens.data_ptr<int64_t>();
        T* op = out.data_ptr<T>();
        const float sc = static_cast<float>(scale);
        if (int8)
            decode<T, int8_t>(qp, cache.data_ptr<int8_t>(), tp, lp, op, n, num_heads, hkv, d, bs, nb, tables.stride(0),
                              window, sc, amx_rows, batch_invariant);
        else
            decode<T, T>(qp, cache.data_ptr<T>(), tp, lp, op, n, num_heads, hkv, d, bs, nb, tables.stride(0), window,
                         sc, amx_rows, batch_invariant);
    };
    if (q.scalar_type() == torch::kFloat32)
        run(q.data_ptr<float>());
    else if (q.scalar_type() == torch::kBFloat16)
        run(q.data_ptr<c10::BFloat16>());
    else
        TORCH_CHECK(false, "paged_decode: f32 or bf16 only");
    return out;
}

