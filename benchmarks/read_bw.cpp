// Read bandwidth of this machine's memory, as a decode step reads its weights: each thread sums
// its share of a buffer much larger than the caches with 512-bit loads (AVX-512; 256-bit AVX2
// elsewhere), best of 7 passes.
//
//   g++ -O2 -march=native -fopenmp read_bw.cpp -o read_bw && ./read_bw MEBIBYTES
// prints "read <GB/s>" (10^9 bytes a second over all threads).
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  const size_t mib = argc > 1 ? std::strtoul(argv[1], nullptr, 10) : 1024;
  const size_t n = mib * 1024 * 1024 / sizeof(float);
  float* a = static_cast<float*>(std::aligned_alloc(64, n * sizeof(float)));
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) a[i] = static_cast<float>(i & 1023);  // faulted in by the thread that reads it
  double best = 0, sink = 0;
  for (int pass = 0; pass < 7; ++pass) {
    const auto t0 = std::chrono::steady_clock::now();
    double total = 0;
#pragma omp parallel reduction(+ : total)
    {
#ifdef __AVX512F__
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
      for (size_t b = 0; b < n; b += 64) {  // 64 floats: four cache lines a round
        s0 = _mm512_add_ps(s0, _mm512_load_ps(a + b));
        s1 = _mm512_add_ps(s1, _mm512_load_ps(a + b + 16));
        s2 = _mm512_add_ps(s2, _mm512_load_ps(a + b + 32));
        s3 = _mm512_add_ps(s3, _mm512_load_ps(a + b + 48));
      }
      total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
#else
      float s = 0;
#pragma omp for schedule(static)
      for (size_t i = 0; i < n; ++i) s += a[i];
      total += s;
#endif
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    sink += total;
    if (n * sizeof(float) / secs > best) best = n * sizeof(float) / secs;
  }
  std::printf("read %.2f\n", best / 1e9);
  std::fprintf(stderr, "(checksum %g)\n", sink);
  std::free(a);
  return 0;
}
