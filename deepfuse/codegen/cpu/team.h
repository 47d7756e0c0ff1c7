// team::parallel_for, the CPU kernels' fork and join. Inside a StepProgram run (program.cpp) it
// hands the chunks to the run's thread team: the program opens one OpenMP region for a run of
// native ops, its thread 0 runs the ops one after another and its other threads wait for chunks
// in a spin loop. An OpenMP region per kernel call (what at::parallel_for opens) took 1.3-1.9 µs
// after a kernel's memory sweep (2-core Xeon VM; a batch-1 decode step makes ~180 such calls);
// with teams the int4-a8 decode ran 1.15x faster (benchmarks/results/native_ab_team_xeon.json).
// Back to back with a trivial body (the diagnostic thread_map, two items; a program of 200 such
// ops against one alternating them with an ATen add, same VM, no result file) a team's fork and
// join and a region cost the same, ~0.85 µs: most of it is the other core fetching the job and
// the body's captures, and the join's way back. Elsewhere it is
// at::parallel_for. Either way the chunks are at::parallel_for's (its OpenMP backend's): the same
// items on the same thread numbers, so a kernel computes the same bits in a program and out.
//
//   team::parallel_for(begin, end, grain, f)   f(chunk_begin, chunk_end) on each thread's chunk
//   team::threads()                            the threads a parallel_for splits over
//
// A team's threads also warm the next op's weights: the program names, before an op, the bytes
// the op after it streams (Team::warm_next), and each thread pulls its own share of them (what
// its chunk of that op will read) toward its L2 while it waits for work or for the others, and
// where a kernel that computes more than it reads calls team::warm() in its loops (decode
// attention).
//
//   team::Team crew(omp_get_max_threads());   // one region's, shared by its threads
//   #pragma omp parallel
//   if (omp_get_thread_num() == 0) { team::Lead lead(crew, omp_get_num_threads()); ...; }   // closes it
//   else crew.serve(omp_get_thread_num());
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/ParallelGuard.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <thread>
#include <utility>
#include <vector>

namespace team {

using Chunk = void (*)(const void* body, int64_t begin, int64_t end);

constexpr int64_t kWarmBytes = 256 << 10;  // the most of its share a thread warms (of a 1-2 MB L2)
constexpr int64_t kSpinsBeforeYield = 1 << 16;  // a waiting thread then yields its core on each try

// Bytes a thread pulls toward its L2, a line at a time: addresses [at, end), as integers (a
// prefetch never faults; no pointer is formed past the weights)
struct Span {
    uintptr_t at = 0, end = 0;
};

// The calling thread's share of the next op's weights not yet warmed, and the warm_next call it
// came from
inline thread_local Span warming;
inline thread_local uint64_t warming_from = 0;

// Prefetches up to `lines` more cache lines of the calling thread's share into L2; false when
// none was left
inline bool warm(int64_t lines) {
    Span& w = warming;
    if (w.at >= w.end) return false;
    for (int64_t i = 0; i < lines && w.at < w.end; ++i, w.at += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w.at), _MM_HINT_T1);
    return true;
}

// How many chunks at::parallel_for cuts n items into with `grain` on `threads` threads (its
// OpenMP backend; 1: it runs them inline)
inline int64_t parts(int64_t n, int64_t grain, int64_t threads) {
    if (n <= grain || n == 1 || threads == 1) return 1;
    return grain > 0 ? std::min(threads, (n + grain - 1) / grain) : threads;
}

// One wait-loop turn: warm a line of the thread's share, else pause (yield after long waits)
inline void idle(int64_t& spins) {
    if (warm(1)) return;
    if (++spins < kSpinsBeforeYield)
        _mm_pause();
    else
        std::this_thread::yield();
}

// What an op streams: `items` work items of `item_bytes` each from `base` (the last one may be
// shorter: `bytes` in all), split over threads as team::parallel_for(0, items, grain) splits them
struct Stream {
    const char* base;
    int64_t item_bytes, items, grain, bytes;
};

// One region's team (a Team is not reused: made before the region, its threads leave at close())
class Team {
  public:
    // capacity: the most threads the region may have (omp_get_max_threads(), before it opens)
    explicit Team(int64_t capacity) : next_(std::max<int64_t>(1, capacity)) {}

    // thread 0: the team's size (threads 0 .. size-1), before its first job
    void open(int64_t size) noexcept { size_ = std::min<int64_t>(size, static_cast<int64_t>(next_.size())); }
    int64_t size() const { return size_; }

    // thread 0, between jobs: each thread's share of what the next op streams (nullptr: none),
    // which its following jobs warm
    void warm_next(const Stream* s) {
        static std::atomic<uint64_t> calls{0};  // tells a thread's later jobs of the same op from a new op's
        warm_from_ = calls.fetch_add(1, std::memory_order_relaxed) + 1;
        for (int64_t t = 0; t < size_; ++t) {
            next_[t] = Span{};
            if (s == nullptr) continue;
            const int64_t n = s->items, cuts = parts(n, s->grain, size_), step = (n + cuts - 1) / cuts;
            const int64_t first = t * step;
            if (first >= n) continue;
            const int64_t from = first * s->item_bytes;
            const int64_t to = std::min({s->bytes, (first + step) * s->item_bytes, from + kWarmBytes});
            const uintptr_t base = reinterpret_cast<uintptr_t>(s->base);
            next_[t] = Span{base + from, base + to};
        }
    }

    // thread 0: [begin, end) in at::parallel_for's chunks, its own here, the others' on their
    // threads; returns once every chunk ran, rethrowing the first exception one raised
    void run(int64_t begin, int64_t end, int64_t grain, Chunk chunk, const void* body) {
        const int64_t n = end - begin;
        if (n <= 0) return;
        if (n <= grain || n == 1 || size_ == 1 || running_) {  // at::parallel_for runs these inline
            c10::ParallelGuard guard(true);
            chunk(body, begin, end);
            return;
        }
        const int64_t cuts = parts(n, grain, size_);
        begin_ = begin, end_ = end, step_ = (n + cuts - 1) / cuts, chunk_ = chunk, body_ = body;
        pending_.store(size_ - 1, std::memory_order_relaxed);
        running_ = true;
        epoch_.fetch_add(1, std::memory_order_release);
        work(0);
        running_ = false;
        for (int64_t spins = 0; pending_.load(std::memory_order_acquire) != 0;) idle(spins);
        if (failed_.load(std::memory_order_relaxed)) {
            failed_.store(false, std::memory_order_relaxed);
            std::rethrow_exception(std::exchange(error_, nullptr));
        }
    }

    // threads 1 .. size-1: run their chunk of each job until close()
    void serve(int64_t tid) {
        at::internal::ThreadIdGuard id(static_cast<int>(tid));
        for (uint64_t seen = 0;;) {
            uint64_t e;
            for (int64_t spins = 0; (e = epoch_.load(std::memory_order_acquire)) == seen;) idle(spins);
            seen = e;
            if (closed_) {
                warming = Span{};
                return;
            }
            work(tid);
            pending_.fetch_sub(1, std::memory_order_release);
        }
    }

    // thread 0: the other threads leave serve()
    void close() {
        closed_ = true;
        epoch_.fetch_add(1, std::memory_order_release);
    }

  private:
    void work(int64_t tid) {
        if (warming_from != warm_from_) {  // the first job of an op: its thread's share of the next op's weights
            warming = tid < static_cast<int64_t>(next_.size()) ? next_[tid] : Span{};
            warming_from = warm_from_;
        }
        const int64_t b = begin_ + tid * step_;
        if (b >= end_) return;
        try {
            c10::ParallelGuard guard(true);
            chunk_(body_, b, std::min(end_, b + step_));
        } catch (...) {
            if (!failed_.exchange(true)) error_ = std::current_exception();
        }
    }

    alignas(64) std::atomic<uint64_t> epoch_{0};  // a new job (or the close) each time it moves
    alignas(64) std::atomic<int64_t> pending_{0};  // threads yet to finish the job
    alignas(64) int64_t size_ = 1, begin_ = 0, end_ = 0, step_ = 1;
    Chunk chunk_ = nullptr;
    const void* body_ = nullptr;
    bool closed_ = false;
    uint64_t warm_from_ = 0;  // the warm_next call next_ came from
    alignas(64) bool running_ = false;  // thread 0 is in its chunk (a nested call runs inline)
    std::atomic<bool> failed_{false};
    std::exception_ptr error_;
    std::vector<Span> next_;  // by thread (capacity): its share of the next op's weights
};

// The team the calling thread leads, if any
inline thread_local Team* led = nullptr;

// Thread 0 of a region leads `crew` (of `size` threads) while this lives, and closes it after
class Lead {
  public:
    Lead(Team& crew, int64_t size) : crew_(crew), outer_(led) {
        crew.open(size);
        led = &crew;
    }
    ~Lead() {
        led = outer_;
        warming = Span{};
        crew_.close();
    }
    Lead(const Lead&) = delete;
    Lead& operator=(const Lead&) = delete;

  private:
    Team& crew_;
    Team* outer_;
};

inline int64_t threads() { return led != nullptr ? led->size() : at::get_num_threads(); }

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
    if (led == nullptr) {
        at::parallel_for(begin, end, grain, f);
        return;
    }
    led->run(begin, end, grain, [](const void* body, int64_t b, int64_t e) { (*static_cast<const F*>(body))(b, e); }, &f);
}

}  // namespace team
