// The `sample` op's kernel for f32 logits rows (ir/sampling.py defines the draw, which every target computes):
//
//   sample(x [S, V] f32, temperature [S] f32, top_k [S] int64, top_p [S] f32, seeds [S] int64, out)
//       -> [S] int64 (into out if given). A row with temperature T > 0: z = x / T; the top-k and
//       top-p thresholds found exactly by radix selection, byte by byte from the top, over the
//       order-preserving keys of z (a count) and over the bits of p = exp(z - max z) (a mass);
//       then Gumbel-max over the kept tokens with the counter-based hash of the row's seed, the
//       noise computed only for tokens that could still win. Any other row: argmax_row (rows.cpp).
//       A NaN logit counts as -inf. exp and log are torch's own (SLEEF's, lane by lane, where
//       AVX-512 is built; else the C library's), so the tokens are the reference's but where two
//       scores tie within rounding. The top-p masses are summed in double (the reference sums in
//       f32): the kept sets can differ only where a head's mass lies within rounding of its target.
//       With top-k, top-p and the draw run over the list of the k kept tokens (ties included).
//   sample_available() -> true (the self-check may refuse it: sampled rows then run the op's reference)
//   spec_verify(tokens [R] int64, drafts [R] int64, out) -> [R] int64 (into out if given): the
//       spec_verify op, tokens with -1 at every row after its sequence's first rejected draft (a
//       sequence's rows are consecutive, its last one has draft -1; a row keeps its token while
//       every earlier row of its sequence had a draft equal to its token)
//
// Rows run in parallel; each thread keeps its scratch (z, p, candidate lists) between calls.
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#include <sleef.h>  // torch's own vector exp and log (the op's reference computes with them)
#endif

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kGumbelMax = 17.0f;  // above every -log(-log(u)) for u <= 1 - 2^-24 (16.64)

inline uint32_t fmix32(uint32_t h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

inline uint32_t bits_of(float f) {
    uint32_t b;
    std::memcpy(&b, &f, sizeof b);
    return b;
}

// the order-preserving u32 image of z: negative values have all bits flipped, others the sign bit set
inline uint32_t order_key(float z) {
    const uint32_t b = bits_of(z);
    return (b >> 31) ? ~b : (b | 0x80000000u);
}

// u in (0, 1) of token v under the row's key (exact in f32)
inline float uniform(uint32_t row_key, uint32_t v) {
    const uint32_t h = fmix32(row_key ^ (v * 0x9E3779B1u));
    return static_cast<float>(((h >> 9) << 1) | 1u) * 0x1p-24f;
}

struct Item {
    uint32_t key;
    float weight;
};

// The largest t such that the items with key >= t weigh enough (enough(sum) over weights summed in
// double), found one byte at a time from the top: each pass keeps the items of the byte where the
// sum gets there. Where no t gets there (a sum within rounding of its target), the smallest key
// (every item kept).
template <typename Enough>
uint32_t threshold(std::vector<Item>& items, Enough enough) {
    double above = 0;  // the weight of the items above the current bucket
    uint32_t t = 0;
    for (int shift = 24; shift >= 0 && !items.empty(); shift -= 8) {
        double hist[256] = {};
        for (const Item& it : items) hist[(it.key >> shift) & 255u] += it.weight;
        uint32_t b = 255;
        while (b > 0 && !enough(above + hist[b])) above += hist[b--];
        if (b == 0 && !enough(above + hist[0])) {
            uint32_t smallest = items[0].key;
            for (const Item& it : items) smallest = std::min(smallest, it.key);
            return smallest;
        }
        t |= b << shift;
        size_t kept = 0;
        for (const Item& it : items)
            if (((it.key >> shift) & 255u) == b) items[kept++] = it;
        items.resize(kept);
    }
    return t;
}

struct Scratch {
    std::vector<float> z, p, g;       // z and p over the vocabulary; g (and p) over a list
    std::vector<int32_t> list;        // token ids, increasing
    std::vector<Item> items;
};

#if defined(__AVX512F__)
inline __mmask16 lanes_below(int64_t i, int64_t v) {
    return v - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (v - i)) - 1);
}

inline __m512i iota16(int64_t v0) {
    return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(v0)),
                            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

inline __m512i mul32(__m512i a, uint32_t b) { return _mm512_mullo_epi32(a, _mm512_set1_epi32(static_cast<int>(b))); }

inline __m512 negate(__m512 x) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)));
}

// the noise of 16 tokens: -log(-log(u)) with torch's own log (SLEEF, as the op's reference computes it)
inline __m512 gumbel16(uint32_t row_key, __m512i v) {
    __m512i h = _mm512_xor_si512(_mm512_set1_epi32(static_cast<int>(row_key)), mul32(v, 0x9E3779B1u));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = mul32(h, 0x85EBCA6Bu);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = mul32(h, 0xC2B2AE35u);
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    const __m512i odd = _mm512_or_si512(_mm512_slli_epi32(_mm512_srli_epi32(h, 9), 1), _mm512_set1_epi32(1));
    const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(odd), _mm512_set1_ps(0x1p-24f));  // < 2^24: exact
    return negate(Sleef_logf16_u10(negate(Sleef_logf16_u10(u))));
}

inline double sum16(__m512 x) {
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
    return _mm512_reduce_add_pd(_mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(x)), _mm512_cvtps_pd(hi)));
}
#endif

inline float gumbel(uint32_t row_key, int64_t v) {  // one token's noise (a bound here, not a score)
    return -std::log(-std::log(uniform(row_key, static_cast<uint32_t>(v))));
}

// z = x / t (a NaN, from x or from inf / inf, -> -inf) into z; returns max z
float scaled(const float* x, float t, int64_t v, float* z) {
    int64_t i = 0;
    float m = -kInf;
#if defined(__AVX512F__)
    const __m512 tv = _mm512_set1_ps(t), ninf = _mm512_set1_ps(-kInf);
    __m512 top = ninf;
    for (; i + 16 <= v; i += 16) {
        __m512 zv = _mm512_div_ps(_mm512_loadu_ps(x + i), tv);
        zv = _mm512_mask_mov_ps(zv, _mm512_cmp_ps_mask(zv, zv, _CMP_UNORD_Q), ninf);  // NaN (also inf / inf)
        _mm512_storeu_ps(z + i, zv);
        top = _mm512_max_ps(top, zv);
    }
    m = _mm512_reduce_max_ps(top);
#endif
    for (; i < v; ++i) {
        z[i] = x[i] / t;
        if (std::isnan(z[i])) z[i] = -kInf;
        if (z[i] > m) m = z[i];
    }
    return m;
}

// y[i] = exp(x[i] - m) for n values; returns their sum (double)
double exp_sum(const float* x, float m, int64_t n, float* y) {
    double total = 0;
#if defined(__AVX512F__)
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 lanes = lanes_below(i, n);
        const __m512 e = _mm512_maskz_mov_ps(
            lanes, Sleef_expf16_u10(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + i), _mm512_set1_ps(m))));
        _mm512_mask_storeu_ps(y + i, lanes, e);
        total += sum16(e);
    }
#else
    for (int64_t i = 0; i < n; ++i) total += y[i] = std::exp(x[i] - m);
#endif
    return total;
}

// the ids i with pred(i), in order, into list
template <typename Pred>
void list_where(int64_t v, Pred pred, std::vector<int32_t>& list) {
    list.clear();
    for (int64_t i = 0; i < v; ++i)
        if (pred(i)) list.push_back(static_cast<int32_t>(i));
}

// top-k (0 < k < v): the ids whose key(z) reaches the k-th largest, ties included, into list.
// Only the tokens at or above a cut c that k tokens reach take part (c = m - d, d doubling from
// max(1, |m| 2^-20), so that c < m from the first; -inf at once where fewer than k are finite).
void top_k_list(const float* z, int64_t v, float m, int64_t k, Scratch& s) {
    auto count_at_least = [z, v](float c) {
        int64_t n = 0, i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= v; i += 16)
            n += __builtin_popcount(_mm512_cmp_ps_mask(_mm512_loadu_ps(z + i), _mm512_set1_ps(c), _CMP_GE_OQ));
#endif
        for (; i < v; ++i) n += z[i] >= c;
        return n;
    };
    const float d0 = std::max(1.f, std::fabs(m) * 0x1p-20f);
    float c = count_at_least(std::numeric_limits<float>::lowest()) < k ? -kInf : m - d0;
    for (float d = 2.f * d0; c != -kInf && count_at_least(c) < k; d *= 2.f) c = m - d;  // d reaches inf
    list_where(v, [&](int64_t i) { return z[i] >= c; }, s.list);
    s.items.clear();
    for (int32_t i : s.list) s.items.push_back({order_key(z[i]), 1.f});
    const uint32_t tk = threshold(s.items, [k](double count) { return count >= static_cast<double>(k); });
    size_t kept = 0;
    for (int32_t i : s.list)
        if (order_key(z[i]) >= tk) s.list[kept++] = i;
    s.list.resize(kept);
}

// top-p over the listed tokens: keeps those whose p = exp(z - m) is at or above the smallest p of
// the head that holds top_p of their mass
void top_p_of_list(const float* z, float m, float top_p, Scratch& s) {
    const int64_t n = static_cast<int64_t>(s.list.size());
    s.g.resize(n);
    s.p.resize(n);
    for (int64_t j = 0; j < n; ++j) s.g[j] = z[s.list[j]];
    const double target = static_cast<double>(top_p) * exp_sum(s.g.data(), m, n, s.p.data());
    s.items.clear();
    for (int64_t j = 0; j < n; ++j)
        if (s.p[j] > 0.f) s.items.push_back({bits_of(s.p[j]), s.p[j]});
    const uint32_t tp = threshold(s.items, [target](double mass) { return mass >= target && mass > 0; });
    size_t kept = 0;
    for (int64_t j = 0; j < n; ++j)
        if (bits_of(s.p[j]) >= tp) s.list[kept++] = s.list[j];
    s.list.resize(kept);
}

// top-p over the whole vocabulary: the ids kept, into list. Only the tokens at or above a cut c
// whose mass reaches the target take part (c = 2^-2, 2^-4, ...).
void top_p_list(const float* z, int64_t v, float m, float top_p, Scratch& s) {
    s.p.resize(v);
    const float* p = s.p.data();
    const double target = static_cast<double>(top_p) * exp_sum(z, m, v, s.p.data());
    auto enough = [target](double mass) { return mass >= target && mass > 0; };
    auto mass_at_least = [&](float c) {
        double mass = 0;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= v; i += 16) {
            const __m512 pv = _mm512_loadu_ps(p + i);
            mass += sum16(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(pv, _mm512_set1_ps(c), _CMP_GE_OQ), pv));
        }
#endif
        for (; i < v; ++i)
            if (p[i] >= c) mass += p[i];
        return mass;
    };
    float c = 0x1p-2f;
    while (c > 0.f && !enough(mass_at_least(c))) c = c > 0x1p-120f ? c * 0x1p-2f : 0.f;
    list_where(v, [&](int64_t i) { return p[i] > 0.f && p[i] >= c; }, s.list);
    s.items.clear();
    for (int32_t i : s.list) s.items.push_back({bits_of(p[i]), p[i]});
    const uint32_t tp = threshold(s.items, enough);  // p = 1 (the largest z) is an item: tp > 0
    size_t kept = 0;
    for (int32_t i : s.list)
        if (bits_of(p[i]) >= tp) s.list[kept++] = i;
    s.list.resize(kept);
}

// Gumbel-max over every token whose z reaches floor: the first of the largest z + noise
int64_t gumbel_max(const float* z, int64_t v, float floor, uint32_t key, int64_t best) {
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(-kInf);
    __m512i where = _mm512_set1_epi32(static_cast<int>(best));
    for (int64_t i = 0; i < v; i += 16) {
        const __mmask16 lanes = lanes_below(i, v);
        const __m512 zv = _mm512_maskz_loadu_ps(lanes, z + i);
        const __mmask16 cand = lanes & _mm512_cmp_ps_mask(zv, _mm512_set1_ps(floor), _CMP_GE_OQ);
        if (!cand) continue;
        const __m512i ids = iota16(i);
        const __m512 score = _mm512_add_ps(zv, gumbel16(key, ids));
        const __mmask16 better = cand & _mm512_cmp_ps_mask(score, top, _CMP_GT_OQ);
        top = _mm512_mask_mov_ps(top, better, score);
        where = _mm512_mask_mov_epi32(where, better, ids);
    }
    const float m = _mm512_reduce_max_ps(top);
    if (m == -kInf) return best;
    return _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(top, _mm512_set1_ps(m), _CMP_EQ_OQ), where);
#else
    float top = -kInf;
    int64_t where = best;
    for (int64_t i = 0; i < v; ++i) {
        if (!(z[i] >= floor)) continue;
        const float score = z[i] + gumbel(key, i);
        if (score > top) top = score, where = i;
    }
    return where;
#endif
}

// the same over the listed tokens (ids increasing)
int64_t gumbel_max_of_list(const float* z, float floor, uint32_t key, int64_t best, Scratch& s) {
    size_t n = 0;
    for (int32_t i : s.list)
        if (z[i] >= floor) s.list[n++] = i;
    s.g.resize(n);
#if defined(__AVX512F__)
    for (size_t j = 0; j < n; j += 16) {
        const __mmask16 lanes = lanes_below(static_cast<int64_t>(j), static_cast<int64_t>(n));
        _mm512_mask_storeu_ps(s.g.data() + j, lanes, gumbel16(key, _mm512_maskz_loadu_epi32(lanes, s.list.data() + j)));
    }
#else
    for (size_t j = 0; j < n; ++j) s.g[j] = gumbel(key, s.list[j]);
#endif
    float top = -kInf;
    int64_t where = best;
    for (size_t j = 0; j < n; ++j) {
        const float score = z[s.list[j]] + s.g[j];
        if (score > top) top = score, where = s.list[j];
    }
    return where;
}

int64_t draw_row(const float* x, int64_t v, float t, int64_t k, float top_p, int64_t seed, Scratch& s) {
    s.z.resize(v);
    const float* z = s.z.data();
    const float m = scaled(x, t, v, s.z.data());
    if (m == kInf) {  // an infinite logit: the first one wins every draw
        for (int64_t i = 0; i < v; ++i)
            if (z[i] == kInf) return i;
    }
    if (m == -kInf) return 0;  // -inf and NaN only: every score is -inf
    bool listed = false;       // the kept tokens are s.list (else every token)
    if (k > 0 && k < v) {
        top_k_list(z, v, m, k, s);
        listed = true;
        if (top_p < 1.f) top_p_of_list(z, m, top_p, s);
    } else if (top_p < 1.f) {
        top_p_list(z, v, m, top_p, s);
        listed = true;
    }
    const uint64_t u = static_cast<uint64_t>(seed);
    const uint32_t key = fmix32(fmix32(static_cast<uint32_t>(u)) ^ static_cast<uint32_t>(u >> 32));
    // the first kept token of the largest z (its p is 1; top-k may drop a -0.0 maximum whose +0.0
    // ties it keeps): its score bounds the winner's from below
    int64_t best = 0;
    if (listed) {
        for (int32_t i : s.list)
            if (z[i] == m) {
                best = i;
                break;
            }
    } else {
        while (z[best] != m) ++best;
    }
    // a token below the best one's score minus the largest noise cannot win: only the rest draw noise
    const float floor = z[best] + gumbel(key, best) - kGumbelMax - 1.0f;
    return listed ? gumbel_max_of_list(z, floor, key, best, s) : gumbel_max(z, v, floor, key, best);
}

}  // namespace

bool sample_available() { return true; }

torch::Tensor sample(const torch::Tensor& x, const torch::Tensor& temperature, const torch::Tensor& top_k,
                     const torch::Tensor& top_p, const torch::Tensor& seeds, std::optional<torch::Tensor> out) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == torch::kFloat32 && x.size(1) > 0,
                "sample: logits must be f32 [S, V] (V >= 1) with unit column stride");
    const int64_t rows = x.size(0), v = x.size(1), ld = x.stride(0);
    TORCH_CHECK(v < std::numeric_limits<int32_t>::max(), "sample: at most 2^31 - 2 logits a row");
    auto vec = [rows](const torch::Tensor& t, torch::ScalarType dt) {
        return t.dim() == 1 && t.size(0) == rows && t.is_contiguous() && t.scalar_type() == dt;
    };
    TORCH_CHECK(vec(temperature, torch::kFloat32) && vec(top_p, torch::kFloat32) && vec(top_k, torch::kInt64) &&
                    vec(seeds, torch::kInt64),
                "sample: temperature and top_p must be contiguous f32 [S], top_k and seeds contiguous int64 [S]");
    auto idx = out ? *out : torch::empty({rows}, x.options().dtype(torch::kInt64));
    TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.is_contiguous() && idx.numel() == rows,
                "sample: out must be a contiguous int64 [S]");
    const float* xp = x.data_ptr<float>();
    const float* tp = temperature.data_ptr<float>();
    const float* pp = top_p.data_ptr<float>();
    const int64_t* kp = top_k.data_ptr<int64_t>();
    const int64_t* sp = seeds.data_ptr<int64_t>();
    int64_t* ip = idx.data_ptr<int64_t>();
    team::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        thread_local Scratch scratch;
        for (int64_t r = begin; r < end; ++r)
            ip[r] = tp[r] > 0.f ? draw_row(xp + r * ld, v, tp[r], kp[r], pp[r], sp[r], scratch)
                                : argmax_row(xp + r * ld, v);
    });
    return idx;
}

torch::Tensor spec_verify(const torch::Tensor& tokens, const torch::Tensor& drafts, std::optional<torch::Tensor> out) {
    auto vec = [](const torch::Tensor& t, int64_t n) {
        return t.dim() == 1 && t.size(0) == n && t.is_contiguous() && t.scalar_type() == torch::kInt64;
    };
    const int64_t rows = tokens.numel();
    TORCH_CHECK(vec(tokens, rows) && vec(drafts, rows), "spec_verify: tokens and drafts must be contiguous int64 [R]");
    auto kept = out ? *out : torch::empty_like(tokens);
    TORCH_CHECK(vec(kept, rows), "spec_verify: out must be a contiguous int64 [R]");
    const int64_t* tok = tokens.data_ptr<int64_t>();
    const int64_t* draft = drafts.data_ptr<int64_t>();
    int64_t* o = kept.data_ptr<int64_t>();
    bool keep = true;  // no earlier row of this row's sequence broke off
    for (int64_t i = 0; i < rows; ++i) {
        o[i] = keep ? tok[i] : -1;
        const bool last = draft[i] < 0;
        keep = last || (keep && tok[i] == draft[i]);  // the next row starts a sequence after a last row
    }
    return kept;
}
