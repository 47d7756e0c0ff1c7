// The activation rows that the int8-activation GEMMs (i8_gemm.cpp, q4a8_gemm.cpp) quantize: x's own
// rows, or rows a fused prologue makes as they are quantized (the SwiGLU of [gate | up], or the
// RMSNorm of x, or of x + res), bit for bit the rows the unfused ops write (row_ops.h).
//
//   row(r, buf, first) -> a pointer to row r of the activation (X [K]): x's own row, or `buf` (X
//   [2K], the calling thread's) filled with the prologue's. first: this thread is the one that
//   writes the norm's sum_out (other threads that make the same row keep the sum in buf's tail).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>

#include "row_ops.h"

namespace prologue_rows {

inline void check_rows(const char* op, const torch::Tensor& t, const torch::Tensor& x, const char* what) {
    TORCH_CHECK(t.dim() == 2 && t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.stride(1) == 1,
                op, ": ", what, " must be [M, K] rows of x's dtype with unit column stride");
}

// The arguments of a norm prologue: x [M, K] and (res, sum_out) rows with unit column stride, w [K].
inline void check_norm(const char* op, const torch::Tensor& x, const std::optional<torch::Tensor>& res,
                       const torch::Tensor& w, const std::optional<torch::Tensor>& sum_out) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be [M, K] rows with unit column stride");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
                op, ": w must be [K] of x's dtype");
    TORCH_CHECK(res.has_value() == sum_out.has_value(), op, ": res and sum_out go together");
    if (res.has_value()) {
        check_rows(op, *res, x, "res");
        check_rows(op, *sum_out, x, "sum_out");
    }
}

// x's rows (x [M, K], unit column stride)
template <typename X>
auto plain(const torch::Tensor& x) {
    const X* xp = x.data_ptr<X>();
    const int64_t ldx = x.stride(0);
    return [xp, ldx](int64_t r, X*, bool) { return xp + r * ldx; };
}

// silu(gate) * up of x = [gate | up] (x [M, 2K], unit column stride)
template <typename X>
auto swiglu(const torch::Tensor& x) {
    const X* xp = x.data_ptr<X>();
    const int64_t ldx = x.stride(0), k = x.size(1) / 2;
    return [xp, ldx, k](int64_t r, X* buf, bool) {
        row_ops::swiglu_row(xp + r * ldx, xp + r * ldx + k, buf, k);
        return static_cast<const X*>(buf);
    };
}

// rms_norm(x (+ res)) * w, the sum written to sum_out by the `first` thread (check_norm first)
template <typename X>
auto norm(const torch::Tensor& x, const std::optional<torch::Tensor>& res, const torch::Tensor& w,
          const std::optional<torch::Tensor>& sum_out, double eps) {
    const X* xp = x.data_ptr<X>();
    const X* rp = res.has_value() ? res->data_ptr<X>() : nullptr;
    X* sp = sum_out.has_value() ? sum_out->data_ptr<X>() : nullptr;
    const X* wp = w.data_ptr<X>();
    const int64_t k = x.size(1), lx = x.stride(0), lr = rp != nullptr ? res->stride(0) : 0;
    const int64_t ls = sp != nullptr ? sum_out->stride(0) : 0;
    const float e = static_cast<float>(eps);
    return [=](int64_t r, X* buf, bool first) {
        X* sum = sp == nullptr ? nullptr : first ? sp + r * ls : buf + k;
        row_ops::norm_row(xp + r * lx, rp != nullptr ? rp + r * lr : nullptr, wp, sum, buf, k, e);
        return static_cast<const X*>(buf);
    };
}

}  // namespace prologue_rows
