// Paged decode attention for the CPU target: query rows that each attend to a prefix of their
// sequence, keys and values read in place from the paged cache (no gather into a padded copy).
// A decoding sequence has one row; a verify chunk (last token + drafts) one row per token, each
// limited to its own position, so a whole decode/verify step is one call.
//
//   q       [N, H*D]            query rows (f32 or bf16)
//   cache   [2, NB, BS, Hkv, D] the layer's paged k/v cache (same dtype as q)
//   tables  [N, B] int64        each row's sequence's block ids (rows may be strided, entries not)
//   lens    [N] int64           each row's causal length (its keys: positions 0 .. len-1)
//   window  0, or attend only to the last `window` positions before len
//   out     [N, H*D]            written
//
// Work item: (row, kv head); its H/Hkv query heads share every key and value read.
// Scores of one block at a time, then an online softmax (running max and sum) in float.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename T>
static void decode(const T* q, const T* cache, const int64_t* tables, const int64_t* lens, T* out, int64_t n,
                   int64_t h, int64_t hkv, int64_t d, int64_t bs, int64_t nb, int64_t tb, int64_t window,
                   float scale) {
    const int64_t g = h / hkv;
    const int64_t half = nb * bs * hkv * d;  // elements of the k half; the v half follows
    at::parallel_for(0, n * hkv, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qf(g * d), acc(g * d), score(g * bs), m(g), l(g), row(d);
        for (int64_t item = begin; item < end; ++item) {
            const int64_t s = item / hkv, kv = item % hkv, len = lens[s];
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
                const T* kb = cache + (block * bs * hkv + kv) * d;
                const T* vb = cache + half + (block * bs * hkv + kv) * d;
                for (int64_t p = lo; p < hi; ++p) {  // scores: each key row converted once, dotted with g queries
                    const T* kp = kb + p * hkv * d;
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) row[e] = static_cast<float>(kp[e]);
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
                    const T* vp = vb + p * hkv * d;
#pragma omp simd
                    for (int64_t e = 0; e < d; ++e) row[e] = static_cast<float>(vp[e]);
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

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor tables, torch::Tensor lens,
                           int64_t num_heads, int64_t window, double scale, torch::Tensor out) {
    TORCH_CHECK(q.is_contiguous() && cache.is_contiguous() && tables.stride(1) == 1 && lens.is_contiguous() &&
                out.is_contiguous(), "paged_decode: operands must be contiguous (tables: along a row)");
    TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2, "paged_decode: cache must be [2, NB, BS, Hkv, D]");
    TORCH_CHECK(q.scalar_type() == cache.scalar_type() && out.scalar_type() == q.scalar_type(),
                "paged_decode: q, cache and out must share a dtype");
    TORCH_CHECK(tables.scalar_type() == torch::kInt64 && lens.scalar_type() == torch::kInt64,
                "paged_decode: tables and lens must be int64");
    const int64_t n = q.size(0), nb = cache.size(1), bs = cache.size(2), hkv = cache.size(3), d = cache.size(4);
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
    if (q.scalar_type() == torch::kFloat32) {
        decode<float>(q.data_ptr<float>(), cache.data_ptr<float>(), tables.data_ptr<int64_t>(),
                      lens.data_ptr<int64_t>(), out.data_ptr<float>(), n, num_heads, hkv, d, bs, nb, tables.stride(0),
                      window, static_cast<float>(scale));
    } else if (q.scalar_type() == torch::kBFloat16) {
        using bf16 = c10::BFloat16;
        decode<bf16>(q.data_ptr<bf16>(), cache.data_ptr<bf16>(), tables.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr<bf16>(), n, num_heads, hkv, d, bs, nb, tables.stride(0),
                     window, static_cast<float>(scale));
    } else {
        TORCH_CHECK(false, "paged_decode: f32 or bf16 only");
    }
    return out;
}

