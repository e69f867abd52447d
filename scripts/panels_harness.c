/* A step's products (one row) of all 120 of SmolLM2's decoder matrices from memory, float32 (ARG 0) or widened
 * bfloat16 (ARG 1), best of 15 rounds, 2 threads: for comparing builds that run steps four panels at a time or two
 * (FOUR_PANELS in native.c, a bit per form: 1 float32, 2 bfloat16, 4 int8). Alternate two builds:
 *
 *   for f in 4 7; do cc -O3 -mavx2 -mfma -fopenmp -DFOUR_PANELS=$f scripts/panels_harness.c -o /tmp/ph$f -lm; done
 *   for r in 1 2 3 4 5; do /tmp/ph4 1; /tmp/ph7 1; done    (0: float32) */
#include "../src/dflash/models/native.c"
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
int main(int argc, char **argv) {
    int bf16 = argc > 1 ? atoi(argv[1]) : 0, threads = 2;
    const int64_t shapes[4][2] = {{1728, 576}, {576, 576}, {3072, 576}, {576, 1536}};
    enum { MATS = 120 };
    void *w[MATS]; int64_t N[MATS], K[MATS]; double bytes = 0;
    for (int i = 0; i < MATS; i++) {
        int64_t n = shapes[i % 4][0], k = shapes[i % 4][1], panels = (n + PANEL - 1) / PANEL;
        size_t b = (size_t)(panels * PANEL * k * (bf16 ? 2 : 4));
        N[i] = n, K[i] = k; bytes += b;
        w[i] = aligned_alloc(64, (b + 63) / 64 * 64); memset(w[i], 0, b);
        if (bf16) { uint16_t *p = w[i]; for (size_t j = 0; j < b / 2; j++) p[j] = f32_to_bf16(1e-3f * (float)(j % 13)); }
        else { float *p = w[i]; for (size_t j = 0; j < b / 4; j++) p[j] = 1e-3f * (float)(j % 13); }
    }
    float *x = malloc(4 * 1536), *y = malloc(4 * 3072); uint16_t *xb = malloc(2 * 1536), *yb = malloc(2 * 3072);
    for (int i = 0; i < 1536; i++) x[i] = 0.01f * (float)(i % 17), xb[i] = f32_to_bf16(x[i]);
    double best = 1e9;
    for (int round = 0; round < 15; round++) {
        double start = now();
        for (int i = 0; i < MATS; i++)
            if (bf16) dflash_linear_bf16(w[i], xb, NULL, yb, 1, N[i], K[i], threads, 0, 0);
            else dflash_linear_f32(w[i], x, NULL, y, 1, N[i], K[i], threads);
        double s = now() - start; best = s < best ? s : best;
    }
    printf("%s FOUR_PANELS=%d: %.2f ms (%.1f GB/s)\n", bf16 ? "bf16" : "f32 ", FOUR_PANELS, best * 1e3, bytes / best / 1e9);
    return 0;
}
