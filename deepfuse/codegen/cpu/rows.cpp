// Row-wise kernels of the CPU step that torch runs as several passes with temporaries.
//
//   swiglu(x [T, 2F], out)                   -> [T, F] = silu(x[:, :F]) * x[:, F:]  (f32 / bf16)
//   rope_cache(qkv [T, (H + 2 Hkv) hd], pos [T], cos [P, hd], sin [P, hd], cache [2, NB, BS, Hkv, hd],
//              slots [T], num_heads, q_out [T, H hd], k_out [T, Hkv hd])
//       rotary embedding (rotate-half) on q and k, and k, v written into the paged cache at
//       slots; q_out and k_out get the rotated rows (f32 / bf16 rows; cos and sin f32; sin
//       sign-folded: [-sin | sin], so rotate_half(x) * sin == swap_halves(x) * sin_folded); an int8
//       cache [2, NB, BS, Hkv, hd + 4] gets each head's row quantized (quantize_kv_row)
//   select_rows(table [V, ...], ids [T] int64, out [T, ...])   out[t] = table[ids[t]] (index_select on
//       dim 0), a row copy each (over the threads past 64 KB of rows), every id checked before any
//       is copied; table and out contiguous, of one dtype, apart in memory (selects_rows says
//       whether an out of this dtype and shape may; it allocates nothing, so the run checks again)
//   argmax(x [T, V] f32, out)                -> [T] int64 (into out if given), the first index of each row's largest
//       value, a NaN counting as -inf (the sample op's greedy rule: torch.argmax of nan_to_num(x, nan=-inf))
//
// Every value is computed in float and rounded once to the row dtype.
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "row_ops.h"

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void swiglu_rows(const T* x, T* y, int64_t t, int64_t f, int64_t ldx, int64_t ldy) {
    team::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            row_ops::swiglu_row(x + r * ldx, x + r * ldx + f, y + r * ldy, f);
        }
    });
}

template <typename T>
void rope_rows(const T* src, const float* cos, const float* sin, T* dst, int64_t heads, int64_t hd) {
    const int64_t half = hd / 2;
#if defined(__AVX512F__)
    if (half % 16 == 0) {
        for (int64_t h = 0; h < heads; ++h)
            for (int64_t i = 0; i < half; i += 16) {
                const T* x = src + h * hd + i;
                const __m512 a = load16(x), b = load16(x + half);
                store16(dst + h * hd + i, _mm512_fmadd_ps(a, _mm512_loadu_ps(cos + i), _mm512_mul_ps(b, _mm512_loadu_ps(sin + i))));
                store16(dst + h * hd + half + i, _mm512_fmadd_ps(b, _mm512_loadu_ps(cos + half + i),
                                                                 _mm512_mul_ps(a, _mm512_loadu_ps(sin + half + i))));
            }
        return;
    }
#endif
    for (int64_t h = 0; h < heads; ++h) {
        const T* x = src + h * hd;
        T* y = dst + h * hd;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i)
            y[i] = static_cast<T>(to_float(x[i]) * cos[i] + to_float(x[i + half]) * sin[i]);
#pragma omp simd
        for (int64_t i = half; i < hd; ++i)
            y[i] = static_cast<T>(to_float(x[i]) * cos[i] + to_float(x[i - half]) * sin[i]);
    }
}

// One row of hd values as int8 and, in the 4 bytes after them, its f32 scale: bit for bit
// ir.opdefs_llm.quantize_kv_rows (inv = 127 / amax, q = round-half-even(x * inv), scale = amax / 127).
// With AVX-512 and hd a multiple of 16, 16 values at a time: the same products, rounded by
// vcvtps2dq in the default (half-even) mode as nearbyint rounds them (a prompt step writes
// ~400k values a layer; the scalar loop had cost ~0.2 s of the throughput workload).
template <typename T>
void quantize_kv_row(const T* x, int8_t* dst, int64_t hd) {
    float amax = 0.f;
#if defined(__AVX512F__)
    if (hd % 16 == 0) {
        __m512 top = _mm512_setzero_ps();
        for (int64_t e = 0; e < hd; e += 16) top = _mm512_max_ps(top, _mm512_abs_ps(load16(x + e)));
        amax = _mm512_reduce_max_ps(top);
        const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
        const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
        for (int64_t e = 0; e < hd; e += 16) {
            const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + e), inv));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e), _mm512_cvtepi32_epi8(_mm512_max_epi32(_mm512_min_epi32(q, hi), lo)));
        }
        const float scale = amax / 127.f;
        std::memcpy(dst + hd, &scale, sizeof(float));
        return;
    }
#endif
    for (int64_t e = 0; e < hd; ++e) amax = std::max(amax, std::fabs(to_float(x[e])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t e = 0; e < hd; ++e)
        dst[e] = static_cast<int8_t>(std::clamp(std::nearbyint(to_float(x[e]) * inv), -127.f, 127.f));
    const float scale = amax / 127.f;
    std::memcpy(dst + hd, &scale, sizeof(float));
}

// C: the cache's element, T (rows copied) or int8_t (rows quantized, `row` = hd + 4 bytes each)
template <typename T, typename C>
void rope_cache_rows(const T* qkv, const int64_t* pos, const float* cos, const float* sin, C* cache, const int64_t* slots,
                     T* q_out, T* k_out, int64_t t, int64_t h, int64_t hkv, int64_t hd, int64_t ldqkv, int64_t row,
                     int64_t cache_half) {
    team::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T* src = qkv + r * ldqkv;
            const float* c = cos + pos[r] * hd;
            const float* s = sin + pos[r] * hd;
            C* kc = cache + slots[r] * hkv * row;
            rope_rows(src, c, s, q_out + r * h * hd, h, hd);
            rope_rows(src + h * hd, c, s, k_out + r * hkv * hd, hkv, hd);
            const T* v = src + (h + hkv) * hd;
            if constexpr (std::is_same_v<C, int8_t>) {
                for (int64_t j = 0; j < hkv; ++j) {
                    quantize_kv_row(k_out + (r * hkv + j) * hd, kc + j * row, hd);
                    quantize_kv_row(v + j * hd, kc + cache_half + j * row, hd);
                }
            } else {
                std::copy(k_out + r * hkv * hd, k_out + (r + 1) * hkv * hd, kc);
                std::copy(v, v + hkv * hd, kc + cache_half);
            }
        }
    });
}

void check_rows(const torch::Tensor& x, const char* what) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, ": rows must be [T, N] with unit column stride");
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16, what, ": f32 or bf16 only");
}

}  // namespace

int64_t argmax_row(const float* x, int64_t v) {
    // the sample op's greedy rule: the first largest value, a NaN counting as -inf
    int64_t i = 0;
    float best = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(best);
    for (; i + 16 <= v; i += 16)
        top = _mm512_max_ps(_mm512_loadu_ps(x + i), top);  // a NaN in the first operand gives the second
    best = _mm512_reduce_max_ps(top);
#endif
    for (; i < v; ++i)
        if (x[i] > best) best = x[i];  // false for a NaN
    if (best == -std::numeric_limits<float>::infinity()) return 0;  // -inf and NaN only: all tie at -inf
    for (int64_t j = 0; j < v; ++j)
        if (x[j] == best) return j;
    return 0;
}

torch::Tensor swiglu(const torch::Tensor& x, std::optional<torch::Tensor> out) {
    check_rows(x, "swiglu");
    TORCH_CHECK(x.size(1) % 2 == 0, "swiglu: x must be [T, 2F]");
    const int64_t t = x.size(0), f = x.size(1) / 2;
    auto y = out.has_value() ? *out : torch::empty({t, f}, x.options());
    TORCH_CHECK(y.dim() == 2 && y.size(0) == t && y.size(1) == f && y.stride(1) == 1 && y.scalar_type() == x.scalar_type(),
                "swiglu: out must be [T, F] of x's dtype with unit column stride");
    if (x.scalar_type() == torch::kFloat32)
        swiglu_rows(x.data_ptr<float>(), y.data_ptr<float>(), t, f, x.stride(0), y.stride(0));
    else
        swiglu_rows(x.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), t, f, x.stride(0), y.stride(0));
    return y;
}

void rope_cache(const torch::Tensor& qkv, const torch::Tensor& pos, const torch::Tensor& cos, const torch::Tensor& sin,
                torch::Tensor cache, const torch::Tensor& slots, int64_t num_heads, torch::Tensor q_out,
                torch::Tensor k_out) {
    check_rows(qkv, "rope_cache");
    const bool int8 = cache.scalar_type() == torch::kInt8;
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.is_contiguous() &&
                    (int8 || cache.scalar_type() == qkv.scalar_type()),
                "rope_cache: cache must be a contiguous [2, NB, BS, Hkv, hd] of qkv's dtype, or int8 [.., hd + 4]");
    const int64_t t = qkv.size(0), hkv = cache.size(3), row = cache.size(4), hd = int8 ? row - 4 : row, h = num_heads;
    TORCH_CHECK(hd % 2 == 0 && qkv.size(1) == (h + 2 * hkv) * hd, "rope_cache: qkv must be [T, (H + 2 Hkv) hd]");
    TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
                    sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == hd && sin.sizes() == cos.sizes(),
                "rope_cache: cos and sin must be contiguous f32 [P, hd]");
    TORCH_CHECK(pos.scalar_type() == torch::kInt64 && slots.scalar_type() == torch::kInt64 && pos.is_contiguous() &&
                    slots.is_contiguous() && pos.numel() == t && slots.numel() == t,
                "rope_cache: pos and slots must be contiguous int64 [T]");
    TORCH_CHECK(q_out.is_contiguous() && k_out.is_contiguous() && q_out.numel() == t * h * hd &&
                    k_out.numel() == t * hkv * hd && q_out.scalar_type() == qkv.scalar_type() &&
                    k_out.scalar_type() == qkv.scalar_type(),
                "rope_cache: q_out and k_out must be contiguous [T, H hd] and [T, Hkv hd] of qkv's dtype");
    const int64_t positions = cos.size(0), capacity = cache.size(1) * cache.size(2);
    for (int64_t r = 0; r < t; ++r) {  // nothing is written unless every row is in range
        TORCH_CHECK(pos.data_ptr<int64_t>()[r] >= 0 && pos.data_ptr<int64_t>()[r] < positions,
                    "rope_cache: a position outside the cos/sin table");
        TORCH_CHECK(slots.data_ptr<int64_t>()[r] >= 0 && slots.data_ptr<int64_t>()[r] < capacity,
                    "rope_cache: a slot outside the cache");
    }
    const int64_t half = capacity * hkv * row;
    auto run = [&](auto* rows) {
        using T = std::remove_pointer_t<decltype(rows)>;
        T* q = q_out.data_ptr<T>();
        T* k = k_out.data_ptr<T>();
        const float* c = cos.data_ptr<float>();
        const float* s = sin.data_ptr<float>();
        const int64_t* p = pos.data_ptr<int64_t>();
        const int64_t* sl = slots.data_ptr<int64_t>();
        if (int8)
            rope_cache_rows(rows, p, c, s, cache.data_ptr<int8_t>(), sl, q, k, t, h, hkv, hd, qkv.stride(0), row, half);
        else
            rope_cache_rows(rows, p, c, s, cache.data_ptr<T>(), sl, q, k, t, h, hkv, hd, qkv.stride(0), row, half);
    };
    if (qkv.scalar_type() == torch::kFloat32)
        run(qkv.data_ptr<float>());
    else
        run(qkv.data_ptr<c10::BFloat16>());
}

bool selects_rows(const torch::Tensor& table, const torch::Tensor& ids, at::ScalarType out_dtype,
                  at::IntArrayRef out_sizes) {
    if (table.dim() < 1 || !table.is_contiguous() || ids.dim() != 1 || ids.scalar_type() != torch::kInt64 ||
        !ids.is_contiguous() || out_dtype != table.scalar_type() || static_cast<int64_t>(out_sizes.size()) != table.dim() ||
        out_sizes[0] != ids.numel())
        return false;
    for (int64_t d = 1; d < table.dim(); ++d)
        if (out_sizes[d] != table.size(d)) return false;
    return true;
}

void select_rows(const torch::Tensor& table, const torch::Tensor& ids, const torch::Tensor& out) {
    TORCH_CHECK(selects_rows(table, ids, out.scalar_type(), out.sizes()) && out.is_contiguous(),
                "select_rows: a contiguous table, contiguous int64 ids [T] and a contiguous out [T, ...] of the "
                "table's dtype and row shape");
    const int64_t t = ids.numel(), v = table.size(0);
    const char* src = static_cast<const char*>(table.data_ptr());
    char* dst = static_cast<char*>(out.data_ptr());
    const auto at = [](const void* p) { return reinterpret_cast<uintptr_t>(p); };
    TORCH_CHECK(out.nbytes() == 0 || at(dst) + out.nbytes() <= at(src) || at(src) + table.nbytes() <= at(dst),
                "select_rows: out overlaps the table");
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < t; ++i)
        TORCH_CHECK(id[i] >= 0 && id[i] < v, "index_select: index ", id[i], " is out of range for ", v, " rows");
    const int64_t row = v > 0 ? table.nbytes() / v : 0;
    // over the threads once the rows pass kCopyChunk bytes (the grain: that many bytes of rows), so
    // a prompt's embedding rows split and a batch-1 decode step's one row is copied inline
    constexpr int64_t kCopyChunk = 64 << 10;
    team::parallel_for(0, t, std::max<int64_t>(1, kCopyChunk / std::max<int64_t>(row, 1)), [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) std::memcpy(dst + i * row, src + id[i] * row, row);
    });
}

torch::Tensor argmax(const torch::Tensor& x, std::optional<torch::Tensor> out) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32 && x.size(1) > 0,
                "argmax: x must be f32 [T, V] (V >= 1) with unit column stride");
    const int64_t t = x.size(0), v = x.size(1), ld = x.stride(0);
    auto idx = out ? *out : torch::empty({t}, x.options().dtype(torch::kInt64));
    TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.is_contiguous() && idx.numel() == t,
                "argmax: out must be a contiguous int64 [T]");
    const float* xp = x.data_ptr<float>();
    int64_t* ip = idx.data_ptr<int64_t>();
    team::parallel_for(0, t, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) ip[r] = argmax_row(xp + r * ld, v);
    });
    return idx;
}
