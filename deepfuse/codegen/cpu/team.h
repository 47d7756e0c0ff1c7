// team::parallel_for, the CPU kernels' fork and join. Inside a StepProgram run (program.cpp) it
// hands the chunks to the run's thread team: the program opens one OpenMP region for a run of
// native ops, its thread 0 runs the ops one after another and its other threads wait for chunks
// in a spin loop. A fork and join then costs ~0.2 µs where an OpenMP region per kernel call (what
// at::parallel_for opens) costs ~0.9 µs back to back and 1.3-1.9 µs after a kernel's memory
// sweep (2-core Xeon VM; a batch-1 decode step makes ~180 such calls). Elsewhere it is
// at::parallel_for. Either way the chunks are at::parallel_for's (its OpenMP backend's): the same
// items on the same thread numbers, so a kernel computes the same bits in a program and out.
//
//   team::parallel_for(begin, end, grain, f)   f(chunk_begin, chunk_end) on each thread's chunk
//   team::threads()                            the threads a parallel_for splits over
//
//   team::Team crew;                  // shared by the region's threads
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
#include <utility>

namespace team {

using Chunk = void (*)(const void* body, int64_t begin, int64_t end);

class Team {
  public:
    // thread 0: the team's size (threads 0 .. size-1), before its first job
    void open(int64_t size) { size_ = size; }
    int64_t size() const { return size_; }

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
        const int64_t parts = grain > 0 ? std::min(size_, (n + grain - 1) / grain) : size_;
        begin_ = begin, end_ = end, step_ = (n + parts - 1) / parts, chunk_ = chunk, body_ = body;
        pending_.store(size_ - 1, std::memory_order_relaxed);
        epoch_.fetch_add(1, std::memory_order_release);
        running_ = true;
        work(0);
        running_ = false;
        while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
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
            while ((e = epoch_.load(std::memory_order_acquire)) == seen) _mm_pause();
            seen = e;
            if (closed_) return;
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
    bool running_ = false, closed_ = false;  // running_: thread 0 is in its chunk (a nested call runs inline)
    std::atomic<bool> failed_{false};
    std::exception_ptr error_;
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
