// A step's kernels as one native call: StepProgram holds the step's launches, each bound to its
// tensors (planned buffers, weights, step inputs), and runs them in order with no Python between
// them (program.py builds it from a bound step, codegen/cpu/bound.py).
//
//   p = StepProgram(); p.q4_gemm(x, nibbles, scales, mins, n, out, amx); ...; p.run_step()
//
// Guards (guard_below) are checked first: run_step() says so, having run nothing, when one fails
// (the caller binds the step again); run() -> bool is true when every op ran. Each op calls the same C++ entry point its Python-bound form
// calls, or the same ATen op, with the same arguments, so a program computes what those calls do
// (index_select: a native row copy where the tensors allow, the same rows).
//
// A step's outputs are tensors its caller keeps, so a program allocates them anew on each run:
// output(shape, dtype) names one by its slot, and the *_to ops write into a slot. A stop
// (stop_unless_below, stop_unless_at_most) holds the run at its place unless its tensor's values
// pass (where the native sampler is refused: a sampled row, a draft to verify; the ops from there
// on run from Python instead).
// run_step() -> (status, outputs): status -1 when a guard failed (nothing ran), else how many
// stops held, in order (all of them: every op ran); outputs: this run's slot tensors.
// profile(True) times each op from then on: op_ns() -> (nanoseconds per op, summed over the runs
// since, in the order added; how many runs got past the guards, a run a stop held counting with
// 0 ns for the ops after the stop, one whose op threw not counted); profile(False) stops and clears
// it. Not while a run is in progress (run() releases the GIL).
// A run of at least kTeamOps consecutive native ops (every op but the ATen ones and generated
// kernels) runs in one OpenMP region: this thread runs the ops as the team's thread 0 and the kernels' parallel parts
// fork to the other threads through team::parallel_for (team.h) in place of a region per kernel
// call. The chunks are those of the same calls outside a program.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels.h"
#include "team.h"

#include <omp.h>

namespace {

using Tensor = torch::Tensor;
using Opt = std::optional<torch::Tensor>;
using Entry = void (*)(const int64_t*);  // a generated kernel's extern "C" entry (generated.py)

using Slots = std::shared_ptr<std::vector<Tensor>>;  // this run's outputs, by slot

// whether pass(v) holds for every value v of t (contiguous, of type T): guards and stops
template <typename T, typename Pass>
bool every(const Tensor& t, Pass pass) {
    const T* v = t.data_ptr<T>();
    for (int64_t i = 0, n = t.numel(); i < n; ++i)
        if (!pass(v[i])) return false;
    return true;
}

// The fewest native ops in a row that share a team: a shorter run (between ATen ops) forks op by
// op as outside a program, since a region for one or two ops saves nothing and costs one where
// the ops run inline (a row's norm)
constexpr size_t kTeamOps = 3;

class StepProgram {
  public:
    // on_team: the op's kernels fork through team::parallel_for (ours), so a run of such ops
    // shares one thread team; ATen ops, generated kernels and any kernel with its own OpenMP
    // region (prefill_attention.cpp's) open their own regions: on_team false
    void add(std::function<void()> op, bool on_team = true) {
        ops_.push_back(std::move(op));
        on_team_.push_back(on_team);
        streams_.emplace_back();
        if (profile_) op_ns_.push_back(0);
    }

    // the op last added streams `weights` in `items` work items of `item_bytes` (the last one
    // may be shorter) split as team::parallel_for(0, items, grain) splits them: the op before it
    // warms each thread's share (team.h)
    void streams(const Tensor& weights, int64_t item_bytes, int64_t items, int64_t grain) {
        TORCH_CHECK(!streams_.empty(), "StepProgram.streams: no op yet");
        streams_.back() = team::Stream{static_cast<const char*>(weights.data_ptr()), item_bytes, items, grain,
                                       static_cast<int64_t>(weights.nbytes())};
    }

    // a tensor of this shape and dtype allocated by each run; returns its slot
    int64_t output(std::vector<int64_t> shape, at::ScalarType dtype) {
        specs_.emplace_back(std::move(shape), dtype);
        return static_cast<int64_t>(specs_.size()) - 1;
    }
    const Slots& slots() const { return slots_; }
    void check_slot(int64_t k) const {
        TORCH_CHECK(k >= 0 && k < static_cast<int64_t>(specs_.size()), "StepProgram: no output slot ", k);
    }
    void check_slot(int64_t k, at::IntArrayRef sizes) const {
        check_slot(k);
        TORCH_CHECK(sizes.vec() == specs_[k].first, "StepProgram: slot ", k, " is ", at::IntArrayRef(specs_[k].first), ", not ", sizes);
    }
    at::ScalarType slot_dtype(int64_t k) const { return specs_[k].second; }
    at::IntArrayRef slot_sizes(int64_t k) const { return specs_[k].first; }
    void release_slots() { slots_->clear(); }  // the run's outputs are the caller's now

    // the run holds here unless every value of t (int64) is below limit
    void stop_unless_below(Tensor t, int64_t limit) {
        TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.is_cpu(),
                    "stop_unless_below: a contiguous CPU int64 tensor");
        stops_.emplace_back(ops_.size(),
                            [t, limit] { return every<int64_t>(t, [limit](int64_t v) { return v < limit; }); });
    }

    // the run holds here unless no value of t (f32) is above limit (a NaN is not)
    void stop_unless_at_most(Tensor t, double limit) {
        TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.is_cpu(),
                    "stop_unless_at_most: a contiguous CPU f32 tensor");
        stops_.emplace_back(ops_.size(),
                            [t, limit] { return every<float>(t, [limit](float v) { return !(v > limit); }); });
    }

    // run() refuses to start unless every value of t (int64, contiguous) is below limit
    void guard_below(Tensor t, int64_t limit) {
        TORCH_CHECK(t.scalar_type() == torch::kInt64 && t.is_contiguous() && t.is_cpu(),
                    "guard_below: a contiguous CPU int64 tensor");
        guards_.emplace_back(std::move(t), limit);
    }

    // -1: a guard failed (nothing ran); else how many stops held (every op ran when all did)
    int64_t run_ops() {
        c10::InferenceMode mode;  // the step's tensors are inference tensors
        for (const auto& [t, limit] : guards_)
            if (!every<int64_t>(t, [limit = limit](int64_t v) { return v < limit; })) return -1;
        slots_->clear();
        for (const auto& [shape, dtype] : specs_) slots_->push_back(at::empty(shape, at::TensorOptions().dtype(dtype)));
        std::vector<int64_t> took(profile_ ? ops_.size() : 0, 0);  // profiling: this run's ns per op
        size_t stop = 0;
        // the stops before op i, then op i (none at the end): false when a stop held
        auto step = [&](size_t i) {
            for (; stop < stops_.size() && stops_[stop].first == i; ++stop)
                if (!stops_[stop].second()) return false;
            if (i < ops_.size()) run_op(i, took);
            return true;
        };
        const bool teams = at::get_num_threads() > 1 && !at::in_parallel_region();
        bool held = false;
        for (size_t i = 0; i <= ops_.size() && !held;) {
            size_t end = i;
            while (end < ops_.size() && on_team_[end]) ++end;
            if (teams && end - i >= kTeamOps) {
                held = !on_team(i, end, step);
                i = end;
            } else {
                held = !step(i++);
            }
        }
        finish_profile(took);
        return static_cast<int64_t>(stop);
    }

    void profile(bool on) {
        profile_ = on;
        op_ns_.assign(on ? ops_.size() : 0, 0);
        profiled_runs_ = 0;
    }
    std::pair<std::vector<int64_t>, int64_t> op_ns() const { return {op_ns_, profiled_runs_}; }

    bool run() { return run_ops() == static_cast<int64_t>(stops_.size()); }

    size_t size() const { return ops_.size(); }

  private:
    void run_op(size_t i, std::vector<int64_t>& took) {
        if (!profile_) {
            ops_[i]();
            return;
        }
        const auto start = std::chrono::steady_clock::now();
        ops_[i]();
        took[i] = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
    }

    // step(from) .. step(to - 1) on this thread as thread 0 of a team (one OpenMP region): false
    // when a stop held; an op's exception is rethrown once the region has closed
    template <typename Step>
    bool on_team(size_t from, size_t to, Step& step) {
        team::Team crew(omp_get_max_threads());
        bool passed = true;
        std::exception_ptr error;
#pragma omp parallel
        {
            if (omp_get_thread_num() == 0) {
                team::Lead lead(crew, omp_get_num_threads());
                try {
                    for (size_t i = from; i < to && passed; ++i) {
                        crew.warm_next(i + 1 < to && streams_[i + 1] ? &*streams_[i + 1] : nullptr);
                        passed = step(i);
                    }
                } catch (...) {
                    error = std::current_exception();
                }
            } else {
                crew.serve(omp_get_thread_num());
            }
        }
        if (error) std::rethrow_exception(error);
        return passed;
    }

    void finish_profile(const std::vector<int64_t>& took) {  // the run's times, once it ended without throwing
        if (!profile_) return;
        for (size_t i = 0; i < took.size(); ++i) op_ns_[i] += took[i];
        ++profiled_runs_;
    }

    bool profile_ = false;
    std::vector<int64_t> op_ns_;
    int64_t profiled_runs_ = 0;
    std::vector<std::function<void()>> ops_;
    std::vector<bool> on_team_;  // by op: see add
    std::vector<std::optional<team::Stream>> streams_;  // by op: see streams
    std::vector<std::pair<Tensor, int64_t>> guards_;
    std::vector<std::pair<size_t, std::function<bool()>>> stops_;  // (the op it stands before, its check)
    std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> specs_;
    Slots slots_ = std::make_shared<std::vector<Tensor>>();
};

// What a bound step depends on in its inputs (codegen/cpu/bound.py, layout_key): each tensor's
// address, dtype, rank, sizes and strides, as the bytes of one int64 array.
py::bytes layout_key(const std::vector<Tensor>& tensors) {
    std::vector<int64_t> key;
    key.reserve(tensors.size() * 8);
    for (const auto& t : tensors) {
        key.push_back(reinterpret_cast<int64_t>(t.data_ptr()));
        key.push_back(static_cast<int64_t>(t.scalar_type()));
        key.push_back(t.dim());
        key.insert(key.end(), t.sizes().begin(), t.sizes().end());
        key.insert(key.end(), t.strides().begin(), t.strides().end());
    }
    return py::bytes(reinterpret_cast<const char*>(key.data()), key.size() * sizeof(int64_t));
}

// A q4a8 op's weights as its threads read them: pairs of panels (q4a8_gemm.cpp)
void q4a8_streams(StepProgram& p, const Tensor& blocks) {
    if (blocks.dim() == 3 && blocks.is_contiguous())
        p.streams(blocks, 2 * blocks.size(1) * blocks.size(2), (blocks.size(0) + 1) / 2, 1);
}

// out = table's rows at ids, into the tensor out() gives at run time (the out given with the op,
// or a slot of the run) of this dtype, shape and contiguity: a native row copy where the tensors allow
// (selects_rows), else ATen's index_select. After a step's weights have streamed through the
// caches ATen's call took ~36 us to the native one's ~14 (2-core Xeon, a one-op program after a
// 128 MB read; no result file).
template <typename Out>
void add_select_rows(StepProgram& p, const Tensor& table, const Tensor& ids, at::ScalarType dtype,
                     at::IntArrayRef sizes, bool contiguous, Out out) {
    if (contiguous && selects_rows(table, ids, dtype, sizes))
        p.add([=] { select_rows(table, ids, out()); });
    else
        p.add([=] {
            Tensor o = out();
            at::index_select_out(o, table, 0, ids);
        }, false);
}

// Which thread runs each item of team::parallel_for(0, n, grain) (where: int64 [n], each item's
// at::get_thread_num()); the item fail_at raises where it runs; teamed (int64 [1], if given) gets 1
// when the call led a program's team, else 0. A diagnostic of the split (the same in a program,
// on its team, and outside one, on at::parallel_for) and of a chunk's error.
void thread_map(int64_t grain, const Tensor& where, int64_t fail_at, const Opt& teamed) {
    TORCH_CHECK(where.scalar_type() == torch::kInt64 && where.dim() == 1 && where.is_contiguous(),
                "thread_map: where must be a contiguous int64 [n]");
    TORCH_CHECK(!teamed || (teamed->scalar_type() == torch::kInt64 && teamed->numel() == 1 && teamed->is_contiguous()),
                "thread_map: teamed must be a contiguous int64 [1]");
    if (teamed) teamed->data_ptr<int64_t>()[0] = team::led != nullptr;
    int64_t* w = where.data_ptr<int64_t>();
    team::parallel_for(0, where.size(0), grain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            TORCH_CHECK(i != fail_at, "thread_map: item ", i, " fails, as asked");
            w[i] = at::get_thread_num();
        }
    });
}

}  // namespace

void bind_program(py::module& m) {
    m.def("layout_key", &layout_key, "each tensor's address, dtype, rank, sizes and strides, as bytes (program.cpp)");
    m.def("thread_map", &thread_map, "which thread runs each item of a parallel_for: a diagnostic (program.cpp)",
          py::arg("grain"), py::arg("where"), py::arg("fail_at") = -1, py::arg("teamed") = py::none());
    using P = StepProgram;
    py::class_<P>(m, "StepProgram", "a step's bound launches, run in order by one native call (program.cpp)")
        .def(py::init<>())
        .def("__len__", &P::size)
        .def("run", &P::run, py::call_guard<py::gil_scoped_release>(),
             "runs every op in order; false when a guard failed (nothing ran) or a stop held the run")
        .def("run_step", [](P& p) {
            int64_t status;
            try {
                py::gil_scoped_release released;
                status = p.run_ops();
            } catch (...) {  // an op raised: this run's outputs go with it
                p.release_slots();
                throw;
            }
            auto outputs = py::make_tuple(status, *p.slots());
            p.release_slots();
            return outputs;
        }, "runs the ops -> (status, outputs): -1 when a guard failed, else how many stops held")
        .def("profile", &P::profile, "on: time each op from now on (op_ns); off: stop and clear")
        .def("op_ns", &P::op_ns, "(nanoseconds per op summed over the runs since profile(True), runs)")
        .def("guard_below", &P::guard_below)
        .def("output", &P::output, "a tensor allocated by each run: its slot")
        .def("stop_unless_below", &P::stop_unless_below)
        .def("stop_unless_at_most", &P::stop_unless_at_most)
        .def("thread_map", [](P& p, int64_t grain, Tensor where, int64_t fail_at, Opt teamed) {
            p.add([=] { thread_map(grain, where, fail_at, teamed); });
        }, py::arg("grain"), py::arg("where"), py::arg("fail_at") = -1, py::arg("teamed") = py::none())
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
            q4a8_streams(p, blocks);
        })
        .def("q4a8_gemm_swiglu", [](P& p, Tensor x, Tensor blocks, int64_t n, Tensor out) {
            p.add([=] { q4a8_gemm_swiglu(x, blocks, n, out); });
            q4a8_streams(p, blocks);
        })
        .def("q4a8_gemm_norm", [](P& p, Tensor x, Opt res, Tensor w, double eps, Opt sum_out, Tensor blocks, int64_t n,
                                  Tensor out) {
            p.add([=] { q4a8_gemm_norm(x, res, w, eps, sum_out, blocks, n, out); });
            q4a8_streams(p, blocks);
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
                                double scale, Tensor out, int64_t amx_rows, bool batch_invariant) {
            p.add([=] { paged_decode(q, cache, tables, lens, heads, window, scale, out, amx_rows, batch_invariant); });
        })
        // ATen ops, as the Python-bound forms call them (torch's int4 GEMM for steps of a few rows)
        .def("int4_mm", [](P& p, Tensor x, Tensor w, int64_t group, Tensor scale_zero, Tensor out) {
            p.add([=]() mutable { out.copy_(at::_weight_int4pack_mm_for_cpu(x, w, group, scale_zero)); }, false);
        })
        .def("mm", [](P& p, Tensor x, Tensor w, Tensor out) {
            p.add([=]() mutable { at::mm_out(out, x, w.t()); }, false);
        })
        .def("index_select", [](P& p, Tensor table, Tensor ids, Tensor out) {
            add_select_rows(p, table, ids, out.scalar_type(), out.sizes(), out.is_contiguous(), [out] { return out; });
        })
        .def("add", [](P& p, Tensor a, Tensor b, Tensor out) { p.add([=]() mutable { at::add_out(out, a, b); }, false); })
        // ops into an output slot (a tensor of this run)
        .def("index_select_to", [](P& p, Tensor table, Tensor ids, int64_t to) {
            p.check_slot(to);  // a slot: a fresh contiguous tensor
            add_select_rows(p, table, ids, p.slot_dtype(to), p.slot_sizes(to), true, [s = p.slots(), to] { return (*s)[to]; });
        })
        .def("i8_gemm_to", [](P& p, Tensor x, Tensor panels, Tensor scale, int64_t n, int64_t group, int64_t to) {
            p.check_slot(to);
            p.add([=, s = p.slots()] { i8_gemm(x, panels, scale, n, group, (*s)[to]); });
        })
        .def("copy_to", [](P& p, Tensor src, int64_t to) {  // src converted to the slot's dtype
            p.check_slot(to, src.sizes());
            p.add([=, s = p.slots()] { (*s)[to].copy_(src); }, false);
        })
        .def("argmax_to", [](P& p, int64_t from, int64_t to) {
            p.check_slot(from), p.check_slot(to);
            p.add([=, s = p.slots()] { argmax((*s)[from], (*s)[to]); });
        })
        .def("sample_to", [](P& p, int64_t from, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seeds,
                             int64_t to) {
            p.check_slot(from), p.check_slot(to);
            p.add([=, s = p.slots()] { sample((*s)[from], temperature, top_k, top_p, seeds, (*s)[to]); });
        })
        .def("spec_verify_to", [](P& p, int64_t from, Tensor drafts, int64_t to) {
            p.check_slot(from), p.check_slot(to);
            p.add([=, s = p.slots()] { spec_verify((*s)[from], drafts, (*s)[to]); });
        })
        // a generated kernel: its entry on its argument array (threads_at >= 0: that slot gets the
        // thread count before each call); the caller keeps the library and the array alive
        .def("generated", [](P& p, int64_t entry, int64_t args, int64_t threads_at) {
            auto fn = reinterpret_cast<Entry>(entry);
            auto* a = reinterpret_cast<int64_t*>(args);
            p.add([=] {
                if (threads_at >= 0) a[threads_at] = at::get_num_threads();
                fn(a);
            }, false);
        });
}
