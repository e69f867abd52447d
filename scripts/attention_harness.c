/* native.c's attention outside the model: one kv head of SmolLM2's shape (3 query heads sharing it, heads of 64,
 * bfloat16 in pairs) after CONTEXT cached keys, for TOKENS tokens in work items of ATTEND_CHUNK tokens as a layer
 * runs them, on one thread with the cache already in L1/L2: the arithmetic alone (in a real pass the cache also
 * comes from memory after the weights have streamed through, see scripts/ab_native.py for whole passes).
 *
 *   cc -O3 -mavx2 -mfma -fopenmp -DNATIVE='"/tmp/old.c"' scripts/attention_harness.c -o /tmp/attention_old -lm
 *   cc -O3 -mavx2 -mfma -fopenmp scripts/attention_harness.c -o /tmp/attention_new -lm
 *   [FLUSH=1] /tmp/attention_new TOKENS CONTEXT [REPEATS] [float32]
 *
 * Prints the fastest of REPEATS (2000) in microseconds, and a checksum of the outputs: two builds with the same
 * arithmetic print the same checksum. Needs AVX512-BF16 for the pairs path (else it times the FMA path); `float32`
 * times a float32 model's cache and queries instead. FLUSH=1 writes 64 MB between repeats, so that the cache comes
 * from memory as it does in a pass (after the weights have streamed through). */
#ifndef NATIVE
#define NATIVE "../src/dflash/models/native.c"
#endif
#include NATIVE
#include <stdio.h>
#include <x86intrin.h>

static float uniform(void) { return rand() / (float)RAND_MAX - 0.5f; }

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s TOKENS CONTEXT [REPEATS] [float32]\n", argv[0]);
        return 2;
    }
    int64_t tokens = atoi(argv[1]), context = atoi(argv[2]), repeats = argc > 3 ? atoi(argv[3]) : 2000;
    int64_t d = 64, group = 3, capacity = context + tokens, longest = context + tokens;
    int bf16 = argc > 4 && !strcmp(argv[4], "float32") ? 0 : dflash_bf16_pairs() ? 2 : 1;
    void *keys = malloc(4 * capacity * d), *values = malloc(4 * capacity * d);
    for (int64_t i = 0; i < capacity * d; i++)
        if (bf16)
            ((uint16_t *)keys)[i] = f32_to_bf16(uniform()), ((uint16_t *)values)[i] = f32_to_bf16(uniform());
        else
            ((float *)keys)[i] = uniform(), ((float *)values)[i] = uniform();
    float *q = malloc(4 * tokens * group * d), *scores = malloc(4 * tokens * group * longest);
    float *out = malloc(4 * tokens * group * d), *block = malloc(4 * KEY_BLOCK * d);
    for (int64_t i = 0; i < tokens * group * d; i++) q[i] = bf16_to_f32(f32_to_bf16(uniform())); /* bf16 values */
    uint64_t best = ~0ull;
    size_t flush_bytes = getenv("FLUSH") ? (size_t)64 << 20 : 0; /* FLUSH=1: the cache from memory, as a pass finds it */
    char *flush = flush_bytes ? malloc(flush_bytes) : NULL;
    for (int64_t repeat = 0; repeat < repeats; repeat++) {
        if (flush) memset(flush, (int)repeat, flush_bytes);
        uint64_t started = __rdtsc();
        for (int64_t c = 0; c < tokens; c += ATTEND_CHUNK) {
            Rows R = {.q = q + c * group * d, .q_token = group * d, .scores = scores + c * group * longest,
                      .score_token = group * longest, .score_head = longest, .out = out + c * group * d,
                      .out_token = group * d};
            attend(R, MIN(ATTEND_CHUNK, tokens - c), group, keys, values, 0, capacity, d, context + c, 1, 0, 0.125f,
                   bf16, block, NULL, 0);
        }
        uint64_t ticks = __rdtsc() - started;
        best = ticks < best ? ticks : best;
    }
    /* the TSC's rate, measured against the monotonic clock */
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    uint64_t t0 = __rdtsc();
    do clock_gettime(CLOCK_MONOTONIC, &b);
    while ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec) < 2e7);
    double per_us = (__rdtsc() - t0) / (((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e3);
    double checksum = 0;
    for (int64_t i = 0; i < tokens * group * d; i++) checksum += out[i];
    printf("%lld tokens after %lld: %.2f us (%s; checksum %.6f)\n", (long long)tokens, (long long)context,
           best / per_us, bf16 == 2 ? "pairs" : bf16 ? "widened" : "float32", checksum);
    return 0;
}
