/* native.c's product outside the model: GFLOP/s of its 16-row kernel on a chunk already in L1, and of whole
 * products of SmolLM2's gate/up shape (3072 x 576) read from L3 (one matrix, again and again) or from memory (30
 * distinct matrices, 212 MB in float32).
 *
 *   cc -O3 -mavx2 -mfma -fopenmp scripts/product_harness.c -o /tmp/product_harness -lm && /tmp/product_harness [ROWS]
 *
 * Compare with scripts/fma_ceiling.c. Best of 7 timings each; the machine's noise still shows between runs. */
#include "../src/dflash/models/native.c"
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void chunk_in_l1(void) {
    int64_t k8 = 576, count = CHUNK;
    float *w = aligned_alloc(64, sizeof(float) * PANEL * k8), *x = aligned_alloc(64, sizeof(float) * 16 * k8);
    float out[16 * PANEL];
    for (int64_t i = 0; i < PANEL * k8; i++) w[i] = 1e-3f * (float)(i % 7);
    for (int64_t i = 0; i < 16 * k8; i++) x[i] = 1e-3f * (float)(i % 5);
    long reps = 2000000;
    double start = now();
    for (long r = 0; r < reps; r++)
        for (int g = 0; g < 4; g++) panel_f32_4(w, x + g * 4 * k8, k8, count, out + g * 4 * PANEL, NULL, 0, 0);
    double seconds = now() - start;
    printf("16 rows against one %ld-input chunk in L1, 1 thread: %.1f GFLOP/s (%g)\n", (long)count,
           reps * 4.0 * count * 4 * PANEL * 2 / seconds / 1e9, out[0]);
    free(w), free(x);
}

int main(int argc, char **argv) {
    int64_t n = 3072, k = 576, m = argc > 1 ? atoi(argv[1]) : 16, mats = 30;
    size_t size = (size_t)(n * k);
    chunk_in_l1();
    float *w = aligned_alloc(64, 4 * size * mats), *x = aligned_alloc(64, 4 * m * k), *y = aligned_alloc(64, 4 * m * n);
    uint16_t *wb = aligned_alloc(64, 2 * size * mats), *xb = aligned_alloc(64, 2 * m * k), *yb = aligned_alloc(64, 2 * m * n);
    for (size_t i = 0; i < size * mats; i++) w[i] = 1e-3f * (float)(i % 7), wb[i] = f32_to_bf16(w[i]);
    for (int64_t i = 0; i < m * k; i++) x[i] = 1e-3f * (float)(i % 5), xb[i] = f32_to_bf16(x[i]);
    for (int threads = 1; threads <= 2; threads++)
        for (int bf16 = 0; bf16 < 2; bf16++)
            for (int resident = 0; resident < 2; resident++) {
                int64_t count = resident ? 1 : mats;
                double best = 1e9;
                for (int rep = 0; rep < 7; rep++) {
                    double start = now();
                    for (int r = 0; r < (resident ? mats : 1); r++)
                        for (int64_t j = 0; j < count; j++) {
                            if (bf16) dflash_linear_bf16(wb + j * size, xb, NULL, yb, m, n, k, threads, dflash_bf16_pairs(), 0);
                            else dflash_linear_f32(w + j * size, x, NULL, y, m, n, k, threads);
                        }
                    double seconds = (now() - start) / mats;
                    best = seconds < best ? seconds : best;
                }
                printf("%ld rows, %d thread%s, %s, from %s: %.3f ms a product, %.1f GFLOP/s, %.1f GB/s\n", (long)m,
                       threads, threads > 1 ? "s" : " ", bf16 ? "bf16" : "f32 ", resident ? "L3    " : "memory", best * 1e3,
                       2.0 * m * size / best / 1e9, size * (bf16 ? 2 : 4) / best / 1e9);
            }
    return 0;
}
