// The native CPU kernels' entry points, as bindings.cpp exposes them to Python and program.cpp
// appends them to a StepProgram; each kernel's source includes this too, so a definition that
// drifts from its declaration fails the build.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor tables, torch::Tensor lens,
                           int64_t num_heads, int64_t window, double scale, torch::Tensor out, int64_t amx_rows,
                           bool batch_invariant);
void paged_prefill(const torch::Tensor& q, const torch::Tensor& cache, const torch::Tensor& tables,
                   const torch::Tensor& rows, const torch::Tensor& qlens, const torch::Tensor& lens, int64_t num_heads,
                   int64_t window, double scale, torch::Tensor out, bool amx);
bool paged_prefill_available();
torch::Tensor pack_panels(const torch::Tensor& w);
torch::Tensor panel_gemm(torch::Tensor x, const torch::Tensor& panels, int64_t n, std::optional<torch::Tensor> out);
bool amx_available();
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps, std::optional<torch::Tensor> out);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& res, const torch::Tensor& w,
                                                      double eps, std::optional<torch::Tensor> sum_out,
                                                      std::optional<torch::Tensor> norm_out);
torch::Tensor pack_vnni(const torch::Tensor& w);
bool bf16_gemm_available();
torch::Tensor bf16_gemm(torch::Tensor x, const torch::Tensor& panels, int64_t n, std::optional<torch::Tensor> out,
                        bool amx);
torch::Tensor q4_gemm(torch::Tensor x, const torch::Tensor& nibbles, const torch::Tensor& scales,
                      const torch::Tensor& mins, int64_t n, std::optional<torch::Tensor> out, bool amx);
bool i8_gemm_available();
torch::Tensor pack_w8(const torch::Tensor& wq);
torch::Tensor i8_gemm(torch::Tensor x, const torch::Tensor& panels, const torch::Tensor& scale, int64_t n,
                      int64_t group, std::optional<torch::Tensor> out);
torch::Tensor i8_gemm_swiglu(torch::Tensor x, const torch::Tensor& panels, const torch::Tensor& scale, int64_t n,
                             int64_t group, std::optional<torch::Tensor> out);
torch::Tensor i8_gemm_norm(const torch::Tensor& x, std::optional<torch::Tensor> res, const torch::Tensor& w, double eps,
                           std::optional<torch::Tensor> sum_out, const torch::Tensor& panels, const torch::Tensor& scale,
                           int64_t n, int64_t group, std::optional<torch::Tensor> out);
bool q4a8_gemm_available();
torch::Tensor q4a8_gemm(torch::Tensor x, const torch::Tensor& blocks, int64_t n, std::optional<torch::Tensor> out);
torch::Tensor q4a8_gemm_swiglu(torch::Tensor x, const torch::Tensor& blocks, int64_t n,
                               std::optional<torch::Tensor> out);
torch::Tensor q4a8_gemm_norm(const torch::Tensor& x, std::optional<torch::Tensor> res, const torch::Tensor& w,
                             double eps, std::optional<torch::Tensor> sum_out, const torch::Tensor& blocks, int64_t n,
                             std::optional<torch::Tensor> out);
torch::Tensor swiglu(const torch::Tensor& x, std::optional<torch::Tensor> out);
void rope_cache(const torch::Tensor& qkv, const torch::Tensor& pos, const torch::Tensor& cos, const torch::Tensor& sin,
                torch::Tensor cache, const torch::Tensor& slots, int64_t num_heads, torch::Tensor q_out,
                torch::Tensor k_out);
bool selects_rows(const torch::Tensor& table, const torch::Tensor& ids, at::ScalarType out_dtype,
                  at::IntArrayRef out_sizes);
void select_rows(const torch::Tensor& table, const torch::Tensor& ids, const torch::Tensor& out);
torch::Tensor argmax(const torch::Tensor& x, std::optional<torch::Tensor> out);
int64_t argmax_row(const float* x, int64_t v);  // one row of argmax (sample.cpp's greedy rows)
bool sample_available();
torch::Tensor sample(const torch::Tensor& x, const torch::Tensor& temperature, const torch::Tensor& top_k,
                     const torch::Tensor& top_p, const torch::Tensor& seeds, std::optional<torch::Tensor> out);
torch::Tensor spec_verify(const torch::Tensor& tokens, const torch::Tensor& drafts, std::optional<torch::Tensor> out);
