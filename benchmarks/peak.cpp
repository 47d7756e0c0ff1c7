// Instruction peaks of this CPU's dot-product instructions, in multiply-adds per second over all
// threads: `vdpbf16ps` (32 bf16 products a 512-bit instruction) and `vpdpbusd` (64 u8 x s8).
// Each thread runs chains of independent accumulators from registers (no memory traffic), so
// the figure is the most a GEMM built on that instruction can do here.
//
//   g++ -O2 -march=native -fopenmp peak.cpp -o peak && ./peak ITERATIONS
// prints "bf16 <G multiply-adds/s>" and "int8 <G multiply-adds/s>", the best of 5 trials.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

constexpr int CHAINS = 12;  // enough independent accumulators to cover the instruction's latency

// `iters` rounds of CHAINS independent accumulators, each round one `step` on every one;
// returns their sum (so the work stays live). V: the register type.
template <class V, class Step, class Add>
static V chains(long iters, V start, Step step, Add add) {
  V acc[CHAINS];
  for (int c = 0; c < CHAINS; ++c) acc[c] = start;
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < CHAINS; ++c) acc[c] = step(acc[c]);
  }
  V s = acc[0];
  for (int c = 1; c < CHAINS; ++c) s = add(s, acc[c]);
  return s;
}

static float bf16_chains(long iters, float seed) {
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80), b = (__m512bh)_mm512_set1_epi16(0x3c00);
  return _mm512_reduce_add_ps(chains(iters, _mm512_set1_ps(seed), [&](__m512 x) { return _mm512_dpbf16_ps(x, a, b); },
                                     [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); }));
}

static float int8_chains(long iters, float seed) {
  const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
  return (float)_mm512_reduce_add_epi32(chains(iters, _mm512_set1_epi32((int)seed),
                                               [&](__m512i x) { return _mm512_dpbusd_epi32(x, a, b); },
                                               [](__m512i x, __m512i y) { return _mm512_add_epi32(x, y); }));
}

// G multiply-adds/s of `macs_per_instruction`-wide chains run by every thread at once, best of 5.
template <class F>
static double best_rate(F chains, long iters, double macs_per_instruction) {
  double best = 0, sink = 0;
  for (int trial = 0; trial < 5; ++trial) {
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel reduction(+ : sink)
    sink += chains(iters, (float)omp_get_thread_num());
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    double rate = macs_per_instruction * CHAINS * iters * omp_get_max_threads() / s / 1e9;
    if (rate > best) best = rate;
  }
  if (sink == 1234.5) std::printf("#\n");  // keeps the chains' results alive
  return best;
}

int main(int argc, char** argv) {
  long iters = argc > 1 ? std::atol(argv[1]) : 20000000;
  std::printf("bf16 %.1f\n", best_rate(bf16_chains, iters, 32));
  std::printf("int8 %.1f\n", best_rate(int8_chains, iters, 64));
  return 0;
}
