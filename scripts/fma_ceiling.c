/* The machine's multiply-add ceiling: twelve independent chains of 8-lane FMAs per thread, nothing else.
 *
 *   cc -O3 -mavx2 -mfma -fopenmp scripts/fma_ceiling.c -o /tmp/fma_ceiling && /tmp/fma_ceiling
 *
 * Prints GFLOP/s on 1 and 2 threads. Each chain is a different recurrence (a = w * a + b from its own start), so the
 * compiler cannot merge chains: an earlier loop that multiplied the same constants into twelve accumulators was
 * folded by gcc into three chains and reported 128 GFLOP/s a core, against 94.5 measured here (2 FMAs a cycle at
 * ~2.95 GHz, AMD EPYC Zen 3). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

__attribute__((noinline)) static float chains(long iters, float seed) {
    __m256 a[12];
    for (int r = 0; r < 12; r++) a[r] = _mm256_set1_ps(seed * (float)r);
    __m256 w = _mm256_set1_ps(1.0000001f), b = _mm256_set1_ps(seed);
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int r = 0; r < 12; r++) a[r] = _mm256_fmadd_ps(w, a[r], b);
    }
    __m256 s = a[0];
    for (int r = 1; r < 12; r++) s = _mm256_add_ps(s, a[r]);
    float out[8];
    _mm256_storeu_ps(out, s);
    return out[0];
}

int main(void) {
    long iters = 200000000;
    for (int threads = 1; threads <= 2; threads++) {
        float sink = 0;
        double start = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
        sink += chains(iters, 1e-3f * (float)(omp_get_thread_num() + 1));
        double seconds = now() - start;
        printf("%d thread%s: %.1f GFLOP/s (%g)\n", threads, threads > 1 ? "s" : "", threads * iters * 12 * 16 / seconds / 1e9,
               sink);
    }
    return 0;
}
