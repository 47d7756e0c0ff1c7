// RMS norms in one pass over each row, f32 math, for the CPU target (f32 and bf16): row_ops.h's
// norm_row over rows split between torch's threads.
//
//   rms_norm(x [T, D], w [D], eps, out)              -> out [T, D]
//   add_rms_norm(x, res, w, eps, sum_out, norm_out)  -> (s = x + res, rms_norm(s, w)) [T, D] each
//
// Rounding: see row_ops.h (the IR's reference, ir/opdefs_llm.py).
#include <torch/extension.h>

#include "kernels.h"
#include <ATen/Parallel.h>
#include "team.h"

#include <cmath>
#include <optional>
#include <tuple>

#include "row_ops.h"

namespace {

template <typename T>
void norm_rows(const torch::Tensor& x, const torch::Tensor* res, const torch::Tensor& w, torch::Tensor* sum,
               torch::Tensor& out, double eps) {
    const int64_t t = x.size(0), d = x.size(1);
    const T* xp = x.data_ptr<T>();
    const T* rp = res != nullptr ? res->data_ptr<T>() : nullptr;
    const T* wp = w.data_ptr<T>();
    T* sp = sum != nullptr ? sum->data_ptr<T>() : nullptr;
    T* op = out.data_ptr<T>();
    const int64_t lx = x.stride(0), lr = res != nullptr ? res->stride(0) : 0, ls = sum != nullptr ? sum->stride(0) : 0,
                  lo = out.stride(0);
    const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(d, 1));
    team::parallel_for(0, t, grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
            row_ops::norm_row<T>(xp + i * lx, rp != nullptr ? rp + i * lr : nullptr, wp, sp != nullptr ? sp + i * ls : nullptr,
                        op + i * lo, d, static_cast<float>(eps));
    });
}

void check_rows(const torch::Tensor& t, const torch::Tensor& x, const char* what) {
    TORCH_CHECK(t.dim() == 2 && t.sizes() == x.sizes() && t.scalar_type() == x.scalar_type() && t.stride(1) == 1,
                "rms_norm: ", what, " must be [T, D] rows of x's dtype with unit column stride");
}

torch::Tensor make_out(const std::optional<torch::Tensor>& out, const torch::Tensor& x, const char* what) {
    torch::Tensor o = out.has_value() ? *out : torch::empty_like(x, at::MemoryFormat::Contiguous);
    check_rows(o, x, what);
    return o;
}

void run(const torch::Tensor& x, const torch::Tensor* res, const torch::Tensor& w, torch::Tensor* sum,
         torch::Tensor& out, double eps) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, D] rows with unit column stride");
    TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type() && w.is_contiguous(),
                "rms_norm: w must be [D] of x's dtype");
    if (x.scalar_type() == torch::kFloat32) {
        norm_rows<float>(x, res, w, sum, out, eps);
    } else if (x.scalar_type() == torch::kBFloat16) {
        norm_rows<c10::BFloat16>(x, res, w, sum, out, eps);
    } else {
        TORCH_CHECK(false, "rms_norm: f32 or bf16 only");
    }
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, std::optional<torch::Tensor> out) {
    torch::Tensor o = make_out(out, x, "out");
    run(x, nullptr, w, nullptr, o, eps);
    return o;
}

std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& res,
                                                      const torch::Tensor& w, double eps,
                                                      std::optional<torch::Tensor> sum_out,
                                                      std::optional<torch::Tensor> norm_out) {
    check_rows(res, x, "res");
    torch::Tensor s = make_out(sum_out, x, "sum_out"), o = make_out(norm_out, x, "norm_out");
    run(x, &res, w, &s, o, eps);
    return {s, o};
}
