/* native.c's product over weights on 4 KB pages against the same weights on 2 MB pages (models/memory.py), one
 * input row and 16, 2 threads: 30 distinct gate/up matrices of SmolLM2 (3072 x 576, 212 MB in float32) read from
 * memory, the two kinds alternating, 15 rounds, the order flipping each round.
 *
 *   cc -O3 -mavx2 -mfma -fopenmp scripts/pages_harness.c -o /tmp/pages_harness -lm && /tmp/pages_harness
 *
 * It prints the system's AnonHugePages after the set-up: 0 there means the kernel gave no huge pages. */
#include "../src/dflash/models/native.c"
#include <stdio.h>
#include <time.h>
#include <sys/mman.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static float *alloc(size_t bytes, int huge) {
    size_t align = 2u << 20;
    char *p = mmap(NULL, bytes + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    char *a = (char *)(((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1));
    madvise(a, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    return (float *)a;
}
int main(void) {
    int64_t n = 3072, k = 576, mats = 30;
    size_t size = (size_t)(n * k);
    float *w[2];
    for (int h = 0; h < 2; h++) { w[h] = alloc(4 * size * mats, h); for (size_t i = 0; i < size * mats; i++) w[h][i] = 1e-3f * (float)(i % 7); }
    system("grep AnonHuge /proc/meminfo");
    float *x = aligned_alloc(64, 4 * 16 * k), *y = aligned_alloc(64, 4 * 16 * n);
    for (int64_t i = 0; i < 16 * k; i++) x[i] = 1e-3f * (float)(i % 5);
    int ms[2] = {1, 16};
    for (int mi = 0; mi < 2; mi++) {
        int m = ms[mi];
        double t[2][15];
        for (int rep = 0; rep < 15; rep++)
            for (int hh = 0; hh < 2; hh++) {
                int h = rep % 2 ? 1 - hh : hh;
                double start = now();
                for (int64_t j = 0; j < mats; j++) dflash_linear_f32(w[h] + j * size, x, NULL, y, m, n, k, 2);
                t[h][rep] = (now() - start) / mats;
            }
        double r[15];
        for (int rep = 0; rep < 15; rep++) r[rep] = t[1][rep] / t[0][rep];
        for (int a = 0; a < 15; a++) for (int b = a + 1; b < 15; b++) if (r[b] < r[a]) { double s = r[a]; r[a] = r[b]; r[b] = s; }
        double b0 = 1e9, b1 = 1e9;
        for (int rep = 0; rep < 15; rep++) { b0 = t[0][rep] < b0 ? t[0][rep] : b0; b1 = t[1][rep] < b1 ? t[1][rep] : b1; }
        printf("%d rows, 2 threads, f32 from memory: 4K pages best %.3f ms (%.1f GB/s), huge best %.3f ms (%.1f GB/s); huge/4K median %.3f (%.2f-%.2f)\n",
               m, b0 * 1e3, size * 4 / b0 / 1e9, b1 * 1e3, size * 4 / b1 / 1e9, r[7], r[0], r[14]);
    }
    return 0;
}
