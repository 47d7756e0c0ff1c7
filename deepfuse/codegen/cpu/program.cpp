// A step's kernels as one native call: StepProgram holds the step's launches, each bound to its
// tensors (planned buffers, weights, step inputs), and runs them in order with no Python between
// them (program.py builds it from a bound step, codegen/cpu/bound.py).
//
//   p = StepProgram(); p.q4_gemm(x, nibbles, scales, mins, n, out, amx); ...; p.run() -> bool
//
// Guards (guard_below) are checked first: run() returns false, having run nothing, when one fails
// (the caller binds the step again). Each op calls the same C++ entry point its Python-bound form
// calls, or the same ATen op, with the same arguments, so a program computes what those calls do.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <functional>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"

namespace {

using Tensor = torch::Tensor;
using Opt = std::optional<torch::Tensor>;
using Entry = void (*)(const int64_t*);  // a generated kernel's extern "C" entry (generated.py)

class StepProgram {
  public:
    void add(std::function<void()> op) { ops_.push_back(std::move(op)); }

    // run() refuses to start unless every value of t (int64, contiguous) is below limit
    void guard_below(Tensor t, int64_t limit) {
        TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.is_cpu(),
                    "guard_below: a contiguous CPU int64 tensor");
        guards_.emplace_back(std::move(t), limit);
    }

    bool run() {
        c10::InferenceMode mode;  // the step's tensors are inference tensors
        for (const auto& [t, limit] : guards_) {
            const int64_t* v = t.data_ptr<int64_t>();
            for (int64_t i = 0, n = t.numel(); i < n; ++i)
                if (v[i] >= limit) return false;
        }
        for (auto& op : ops_) op();
        return true;
    }

    size_t size() const { return ops_.size(); }

  private:
    std::vector<std::function<void()>> ops_;
    std::vector<std::pair<Tensor, int64_t>> guards_;
};

}  // namespace

void bind_program(py::module& m) {
    using P = StepProgram;
    py::class_<P>(m, "StepProgram", "a step's bound launches, run in order by one native call (program.cpp)")
        .def(py::init<>())
        .def("__len__", &P::size)
        .def("run", &P::run, py::call_guard<py::gil_scoped_release>(),
             "runs every op in order; false (nothing run) when a guard fails")
        .def("guard_below", &P::guard_below)
        .def("rms_norm", [](P& p, Tensor x, Tensor w, double eps, Tensor out) {
            p.add([=] { rms_norm(x, w, eps, out); });
        })
        .def("add_rms_norm", [](P& p, Tensor x, Tensor res, Tensor w, double eps, Tensor sum_out, Tensor norm_out) {
            p.add([=] { add_rms_norm(x, res, w, eps, sum_out, norm_out); });
        })
        .def("swiglu", [](P& p, Tensor x, Tensor out) { p.add([=] { swiglu(x, out); }); })
        .def("panel_gemm", [](P& p, Tensor x, Tensor panels, int64_t n, Tensor out) {
            p.add([=] { panel_gemm(x, panels, n, out); });
        })
        .def("bf16_gemm", [](P& p, Tensor x, Tensor panels, int64_t n, Tensor out, bool amx) {
            p.add([=] { bf16_gemm(x, panels, n, out, amx); });
        })
        .def("q4_gemm", [](P& p, Tensor x, Tensor nib, Tensor scales, Tensor mins, int64_t n, Tensor out, bool amx) {
            p.add([=] { q4_gemm(x, nib, scales, mins, n, out, amx); });
        })
        .def("i8_gemm", [](P& p, Tensor x, Tensor panels, Tensor scale, int64_t n, int64_t group, Tensor out) {
            p.add([=] { i8_gemm(x, panels, scale, n, group, out); });
        })
        .def("q4a8_gemm", [](P& p, Tensor x, Tensor blocks, int64_t n, Tensor out) {
            p.add([=] { q4a8_gemm(x, blocks, n, out); });
        })
        .def("q4a8_gemm_swiglu", [](P& p, Tensor x, Tensor blocks, int64_t n, Tensor out) {
            p.add([=] { q4a8_gemm_swiglu(x, blocks, n, out); });
        })
        .def("q4a8_gemm_norm", [](P& p, Tensor x, Opt res, Tensor w, double eps, Opt sum_out, Tensor blocks, int64_t n,
                                  Tensor out) {
            p.add([=] { q4a8_gemm_norm(x, res, w, eps, sum_out, blocks, n, out); });
        })
        .def("i8_gemm_swiglu", [](P& p, Tensor x, Tensor panels, Tensor scale, int64_t n, int64_t group, Tensor out) {
            p.add([=] { i8_gemm_swiglu(x, panels, scale, n, group, out); });
        })
        .def("i8_gemm_norm", [](P& p, Tensor x, Opt res, Tensor w, double eps, Opt sum_out, Tensor panels, Tensor scale,
                                int64_t n, int64_t group, Tensor out) {
            p.add([=] { i8_gemm_norm(x, res, w, eps, sum_out, panels, scale, n, group, out); });
        })
        .def("rope_cache", [](P& p, Tensor qkv, Tensor pos, Tensor cos, Tensor sin, Tensor cache, Tensor slots,
                              int64_t heads, Tensor q, Tensor k) {
            p.add([=] { rope_cache(qkv, pos, cos, sin, cache, slots, heads, q, k); });
        })
        .def("paged_decode", [](P& p, Tensor q, Tensor cache, Tensor tables, Tensor lens, int64_t heads, int64_t window,
                                double scale, Tensor out, int64_t amx_rows) {
            p.add([=] { paged_decode(q, cache, tables, lens, heads, window, scale, out, amx_rows); });
        })
        // ATen ops, as the Python-bound forms call them (torch's int4 GEMM for steps of a few rows)
        .def("int4_mm", [](P& p, Tensor x, Tensor w, int64_t group, Tensor scale_zero, Tensor out) {
            p.add([=]() mutable { out.copy_(at::_weight_int4pack_mm_for_cpu(x, w, group, scale_zero)); });
        })
        .def("mm", [](P& p, Tensor x, Tensor w, Tensor out) {
            p.add([=]() mutable { at::mm_out(out, x, w.t()); });
        })
        .def("index_select", [](P& p, Tensor table, Tensor ids, Tensor out) {
            p.add([=]() mutable { at::index_select_out(out, table, 0, ids); });
        })
        .def("add", [](P& p, Tensor a, Tensor b, Tensor out) { p.add([=]() mutable { at::add_out(out, a, b); }); })
        // a generated kernel: its entry on its argument array (threads_at >= 0: that slot gets the
        // thread count before each call); the caller keeps the library and the array alive
        .def("generated", [](P& p, int64_t entry, int64_t args, int64_t threads_at) {
            auto fn = reinterpret_cast<Entry>(entry);
            auto* a = reinterpret_cast<int64_t*>(args);
            p.add([=] {
                if (threads_at >= 0) a[threads_at] = at::get_num_threads();
                fn(a);
            });
        });
}
