/* native.c's int8 products against its bfloat16 ones outside the model: all products of SmolLM2-135M's 30 decoder
 * layers (120 matrices, 212 MB in bfloat16, 106 MB in int8), each once, so they come from memory as in a pass; best of
 * 15 alternating rounds. In pairs (INT8_PAIRS against bfloat16 pairs) where the CPU has AVX512-BF16 and AVX512-VBMI,
 * else widened (INT8_WIDENED against the widening bfloat16 kernel); the bytes' values do not matter to the time.
 *
 *   cc -O3 -mavx2 -mfma -fopenmp scripts/int8_harness.c -o /tmp/int8_harness -lm && /tmp/int8_harness [ROWS] [THREADS]
 *
 * Add -DINT8_INLINE_ROWS=N to move where the kernel stops expanding bytes in registers and expands chunks instead. */
#include "../src/dflash/models/native.c"
#include <stdio.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    int m = argc > 1 ? atoi(argv[1]) : 1, threads = argc > 2 ? atoi(argv[2]) : 2;
    const int pairs = dflash_int8_pairs(), layouts[2] = {pairs ? 1 : 0, pairs ? 2 : 3}; /* dflash_linear_bf16's */
    const int64_t shapes[4][2] = {{1728, 576}, {576, 576}, {3072, 576}, {576, 1536}}; /* qkv, o, gate/up, down */
    enum { MATS = 120 };
    void *bf16[MATS], *int8[MATS];
    int64_t N[MATS], K[MATS];
    for (int i = 0; i < MATS; i++) {
        int64_t n = shapes[i % 4][0], k = shapes[i % 4][1], panels = (n + PANEL - 1) / PANEL;
        size_t pair_bytes = (size_t)(panels * PANEL * k * 2), int8_bytes = (size_t)(panels * PANEL * k + panels * PANEL * 4);
        N[i] = n, K[i] = k;
        bf16[i] = aligned_alloc(64, (pair_bytes + 63) / 64 * 64), int8[i] = aligned_alloc(64, (int8_bytes + 63) / 64 * 64);
        uint16_t *w = bf16[i];
        for (size_t j = 0; j < pair_bytes / 2; j++) w[j] = f32_to_bf16(1e-3f * (float)((j * 7) % 13) - 0.006f);
        int8_t *q = int8[i];
        for (size_t j = 0; j < (size_t)(panels * PANEL * k); j++) q[j] = (int8_t)((j * 7) % 255);
        float *scales = (float *)(q + panels * PANEL * k);
        for (int64_t j = 0; j < panels * PANEL; j++) scales[j] = 1e-3f;
    }
    uint16_t *x = malloc(2 * (size_t)m * 1536), *y = malloc(2 * (size_t)m * 3072);
    for (int i = 0; i < m * 1536; i++) x[i] = f32_to_bf16(0.01f * (float)(i % 17));
    double best[2] = {1e9, 1e9};
    for (int round = 0; round < 15; round++)
        for (int kind = 0; kind < 2; kind++) {
            double start = now();
            for (int i = 0; i < MATS; i++)
                dflash_linear_bf16(kind ? int8[i] : bf16[i], x, NULL, y, m, N[i], K[i], threads, layouts[kind], 0);
            double seconds = now() - start;
            best[kind] = seconds < best[kind] ? seconds : best[kind];
        }
    printf("%d rows, %d threads, %s: bfloat16 %.2f ms (%.1f GB/s), int8 %.2f ms (%.1f GB/s): int8 %.3fx the time\n",
           m, threads, pairs ? "in pairs" : "widened", best[0] * 1e3, 212e6 / best[0] / 1e9, best[1] * 1e3, 106e6 / best[1] / 1e9, best[1] / best[0]);
    return 0;
}
