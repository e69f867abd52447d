/* y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for the few rows of a decode step or a verify pass, on AVX2 + FMA.
 *
 * Why: such a product is bound by reading w once from memory. oneDNN's and MKL's kernels reached 13-14 GB/s on
 * SmolLM2-135M's 1-7 MB matrices where a plain read of the same bytes reached 23 GB/s (2 threads, AMD EPYC); this
 * loop reaches 20-24 GB/s in float32 and 18-20 in bfloat16 (12 row by row).
 *
 * The weight is laid out once in "tiles" (native.py): padded with zeros to a multiple of 24 rows and 8 columns, then
 * cut into panels of 24 rows (output columns), each stored input by input (the 24 weights of input i side by side).
 * A panel is then read as ONE sequential stream, which the hardware prefetcher follows at full speed; rows read side
 * by side as separate short streams (1-2 KB each) were not. Up to four input rows run against a panel at once (twelve
 * accumulators), so it is read from memory once and a verify pass is bound by the FMAs. bfloat16 weights are
 * widened to float32 (a shift) and all sums are float32, like torch's own bfloat16 products; a bfloat16 result is
 * rounded once, to nearest even.
 * Threads split the output rows in chunks that each thread claims (one OpenMP region per call, below).
 * Built and loaded by native.py; every caller falls back to torch's kernels where this cannot be built.
 *
 * The second half runs a whole Llama/Qwen decoder layer over a few new tokens of a few sequences (dflash_layer).
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- threads: one OpenMP region per call, inside it work that any thread claims chunk by chunk -------------------
 * Why not a `parallel for` per loop: an OpenMP region ends in a barrier that waits for EVERY thread of its team,
 * including one the OS has descheduled because another process holds its core. A step opened ~180 regions, and
 * each waited a scheduler time slice: a 25 ms float32 step took 1.6 s beside one busy process (2 AMD EPYC cores).
 * So a call opens ONE region (with_workers): its first thread runs the call and publishes each parallel loop as a
 * job; every thread, the first included, claims chunks of it, and the first waits only for chunks another thread
 * has actually started. A thread that gets no core does no work, and the call waits for it once, at its end.
 * Measured on 2 AMD EPYC cores, float32 (scripts/bench_threads.py --beside): a step beside a running `dflash data`
 * job took 88 ms instead of 0.8-1.7 s, and as long as before on a quiet machine. The region runs on torch's own
 * OpenMP threads: a pool of our own threads, with no barrier at all, did better beside a busy process (49 ms), but
 * its 16-token passes were 10-30% slower on a quiet machine.
 * Which thread computes an item never changes its result (every output is computed whole by one thread), so
 * results stay bitwise the same at any thread count or load.
 *
 * A job is one 64-bit word: generation (20 bits) | items (22) | next unclaimed item (22). A claim is a
 * compare-and-swap on it, so a thread that looks late cannot claim from a job that is over; it reads the job's task
 * only after its claim succeeded, which holds the job open until that chunk is finished. */
typedef void (*Task)(void *ctx, int64_t begin, int64_t end);
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

#define ITEM_BITS 22
#define ITEM_MASK ((UINT64_C(1) << ITEM_BITS) - 1)
#define GEN_MASK ((UINT64_C(1) << 20) - 1)

static struct {
    _Atomic uint64_t word;
    _Atomic int64_t finished; /* items done in the current job */
    Task task;
    void *ctx;
    _Atomic int64_t grain;
    _Atomic int closing; /* the region's first thread is done: the others leave */
    uint64_t generation;
    pthread_mutex_t busy; /* one region at a time; a second caller meanwhile runs on its own thread */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER};
static _Thread_local int in_region; /* this thread opened the region and may publish jobs to it */

static void after_fork(void) { pthread_mutex_init(&pool.busy, NULL); }
__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(NULL, NULL, after_fork); }

/* Claims the next chunk of the job tagged `tag` (generation | items); 0 when that job has none left. */
static int claim(uint64_t tag, int64_t *begin, int64_t *end) {
    uint64_t word = atomic_load_explicit(&pool.word, memory_order_acquire);
    for (;;) {
        int64_t next = (int64_t)(word & ITEM_MASK), items = (int64_t)((word >> ITEM_BITS) & ITEM_MASK);
        if ((word >> ITEM_BITS) != tag || next >= items) return 0;
        int64_t grain = atomic_load_explicit(&pool.grain, memory_order_relaxed); /* a stale grain only sizes a chunk */
        int64_t stop = MIN(next + MAX(grain, 1), items);
        if (atomic_compare_exchange_weak_explicit(&pool.word, &word, (word & ~ITEM_MASK) | (uint64_t)stop,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *begin = next, *end = stop;
            return 1;
        }
    }
}

static void work_on(uint64_t tag) {
    int64_t begin, end;
    while (claim(tag, &begin, &end)) {
        pool.task(pool.ctx, begin, end);
        atomic_fetch_add_explicit(&pool.finished, end - begin, memory_order_release);
    }
}

/* task(ctx, begin, end) over items [0, items) in chunks of `grain`, on the region's threads where `threads` > 1 and
 * this thread opened a region; on this thread alone otherwise. */
static void parallel_for(int64_t items, int64_t grain, int threads, Task task, void *ctx) {
    if (threads <= 1 || !in_region || items <= grain || items > (int64_t)ITEM_MASK) {
        task(ctx, 0, items);
        return;
    }
    pool.task = task, pool.ctx = ctx;
    atomic_store_explicit(&pool.grain, grain, memory_order_relaxed);
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    pool.generation = pool.generation % GEN_MASK + 1; /* never 0: a thread entering the region has seen tag 0 */
    uint64_t tag = (pool.generation << ITEM_BITS) | (uint64_t)items;
    atomic_store_explicit(&pool.word, tag << ITEM_BITS, memory_order_release); /* publishes task, ctx, grain */
    work_on(tag);
    /* only chunks another thread is computing remain; yield now and then in case it waits for this core */
    for (int spins = 1; atomic_load_explicit(&pool.finished, memory_order_acquire) < items; spins++) {
        if (spins % 1024 == 0) sched_yield();
        else _mm_pause();
    }
}

/* body(arg) on this thread, with up to `threads` threads (this one included) taking part in its parallel loops */
static void with_workers(int threads, void (*body)(void *), void *arg) {
    if (threads <= 1 || in_region || pthread_mutex_trylock(&pool.busy) != 0) {
        body(arg);
        return;
    }
    atomic_store(&pool.closing, 0);
#pragma omp parallel num_threads(threads)
    {
        if (omp_get_thread_num() == 0) {
            in_region = 1;
            body(arg);
            in_region = 0;
            atomic_store(&pool.closing, 1);
        } else {
            for (uint64_t seen = 0; !atomic_load_explicit(&pool.closing, memory_order_acquire);) {
                uint64_t tag = atomic_load_explicit(&pool.word, memory_order_acquire) >> ITEM_BITS;
                if (tag != seen) work_on(seen = tag);
                else _mm_pause();
            }
        }
    }
    pthread_mutex_unlock(&pool.busy);
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256 widen_bf16(const uint16_t *p) {
    __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

static inline __m256 widen_int8(const int8_t *p) { /* eight int8 weights as float32 (exact) */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* The same eight at a time: f32_to_bf16's rounding (to nearest even, NaN kept quiet) on each lane, so a value
 * rounds alike whichever of the two loops reaches it. */
static inline __m256i bf16_bits8(__m256 v) { /* the rounded value's bits, low half zero */
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)), nan);
    return _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
}
static inline void store8(void *p, int64_t i, __m256 v, int bf16) {
    if (!bf16) {
        _mm256_storeu_ps((float *)p + i, v);
        return;
    }
    __m256i bits = _mm256_srli_epi32(bf16_bits8(v), 16);
    __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), packed);
}

/* ---- the product over panels ------------------------------------------------------------------------------
 * A panel is PANEL = 24 output columns (three AVX2 vectors) over all k8 inputs: for input i, the 24 weights w[c, i]
 * of its columns side by side. R input rows (1-4) run against a panel together: for each i, x[r, i] is broadcast
 * and multiplied into the panel's three vectors, twelve accumulators at R = 4. No horizontal sums, and per 12 FMAs
 * only 3 weight loads and 4 broadcasts. In a standalone harness on 2 AMD EPYC cores (16 rows, float32) SmolLM2's
 * down projection ran at 116-120 GFLOP/s against 90-91 for the earlier 4-row blocks dotted with three input rows
 * (which summed 12 vectors horizontally per block and re-read the inputs for every block), its gate/up at 117-137
 * against 109-129. The ceiling (scripts/fma_ceiling.c): twelve independent FMA chains run 94.5-96 GFLOP/s on one
 * core (two FMAs a cycle at ~2.95 GHz) and 170-186 on two; an earlier "255" came from a loop whose identical chains
 * gcc had merged. This kernel runs a chunk already in L1 at ~92 a core; what a whole product loses is the memory.
 * Up to four rows run two panels at a time instead (two_panels_rows below: two memory streams; not in pairs,
 * below). Each output is ONE chain of FMAs over i = 0..k8-1, whatever R is: a verify pass sums every output in
 * exactly the order a one-token step does, so verifying k tokens gives bitwise the logits of k steps. */
#define PANEL 24

/* Eight weights of a panel as float32, by the panel's `form`: 0 float32, 1 bfloat16 (a shift), 2 int8 (sign-extended
 * and converted: an int8 target's weights where the CPU lacks AVX512-BF16, INT8_WIDENED below; their columns' scales
 * multiply the sums afterwards). Each is exact, so a form changes only the bytes a panel takes from memory. */
static inline __m256 load_w(const void *w, int64_t at, int form) {
    return form == 2   ? widen_int8((const int8_t *)w + at)
           : form == 1 ? widen_bf16((const uint16_t *)w + at)
                       : _mm256_loadu_ps((const float *)w + at);
}

/* How far ahead, in inputs, widening a bfloat16 chunk requests the lines it will read next. */
#ifndef PREFETCH
#define PREFETCH 16
#endif

/* A group's share of the next chunk, requested while it works on this one: pf_step bytes per input (NULL: none) */
static inline __attribute__((always_inline)) void request_share(const char *pf, int64_t i, int64_t pf_step) {
    if (!pf) return;
    _mm_prefetch(pf + i * pf_step, _MM_HINT_T0);
    if (pf_step > 64) _mm_prefetch(pf + i * pf_step + 64, _MM_HINT_T0);
}

/* out[r * PANEL + c] = sum_i x[r * ldx + i] * w[i * PANEL + c], R and bf16 constants once inlined. The twelve
 * accumulators are named variables: gcc kept an array of them on the stack, storing all twelve every input. */
#define ACC_ZERO(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = a##r##0, a##r##2 = a##r##0;
#define ACC_LOAD(r)                                                                                                   \
    if (R > r && resume) {                                                                                            \
        a##r##0 = _mm256_loadu_ps(out + r * PANEL), a##r##1 = _mm256_loadu_ps(out + r * PANEL + 8);                   \
        a##r##2 = _mm256_loadu_ps(out + r * PANEL + 16);                                                              \
    }
#define ACC_FMA(r)                                                                                                    \
    if (R > r) {                                                                                                      \
        __m256 b = _mm256_broadcast_ss(x + r * ldx + i);                                                              \
        a##r##0 = _mm256_fmadd_ps(w0, b, a##r##0), a##r##1 = _mm256_fmadd_ps(w1, b, a##r##1);                        \
        a##r##2 = _mm256_fmadd_ps(w2, b, a##r##2);                                                                    \
    }
#define ACC_STORE(r)                                                                                                  \
    if (R > r) {                                                                                                      \
        _mm256_storeu_ps(out + r * PANEL, a##r##0), _mm256_storeu_ps(out + r * PANEL + 8, a##r##1);                   \
        _mm256_storeu_ps(out + r * PANEL + 16, a##r##2);                                                              \
    }
static inline __attribute__((always_inline)) void panel_rows(const void *w, int form, const float *x, int64_t ldx,
                                                             int64_t k8, const int R, float *out, const char *pf,
                                                             int64_t pf_step, int resume, float *keep) {
    ACC_ZERO(0) ACC_ZERO(1) ACC_ZERO(2) ACC_ZERO(3) ACC_ZERO(4) ACC_ZERO(5) ACC_ZERO(6) ACC_ZERO(7)
    ACC_LOAD(0) ACC_LOAD(1) ACC_LOAD(2) ACC_LOAD(3) ACC_LOAD(4) ACC_LOAD(5) ACC_LOAD(6) ACC_LOAD(7)
    for (int64_t i = 0; i < k8; i++) {
        request_share(pf, i, pf_step);
        __m256 w0 = load_w(w, i * PANEL, form), w1 = load_w(w, i * PANEL + 8, form);
        __m256 w2 = load_w(w, i * PANEL + 16, form);
        if (keep) {
            _mm256_storeu_ps(keep + i * PANEL, w0), _mm256_storeu_ps(keep + i * PANEL + 8, w1);
            _mm256_storeu_ps(keep + i * PANEL + 16, w2);
        }
        ACC_FMA(0) ACC_FMA(1) ACC_FMA(2) ACC_FMA(3) ACC_FMA(4) ACC_FMA(5) ACC_FMA(6) ACC_FMA(7)
    }
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5) ACC_STORE(6) ACC_STORE(7)
}

/* One or two input rows (R) against two panels (at w and w + size): six or twelve independent chains, the two
 * panels' streams interleaved. One panel's three chains waited on the FMA latency and left the memory idle, and
 * one stream at a time read ~15.6 GB/s on one EPYC core where two read ~20: a 2-token pass cost 1.12-1.31x a step
 * through the single-panel kernel, 0.94-1.15x this way (two threads, `scripts/step_verify.py float32 --widths
 * 1,2,3,4,8`; 3 and 4 rows gain less, and from 5 rows on, four rows against one panel win: pairs over two panels
 * made 8 rows 1.4x dearer, since
 * they load twice the weights per FMA from L1 where those widths are bound by arithmetic). Sums land at
 * out[(r * 2 + q) * PANEL] for row r and panel q; `resume` continues them (a chunk after the first). Each output is
 * still its one chain. */
#define TWO_ZERO(a) __m256 a##0 = _mm256_setzero_ps(), a##1 = a##0, a##2 = a##0;
#define TWO_LOAD(a, at)                                                                                             \
    a##0 = _mm256_loadu_ps(out + (at)), a##1 = _mm256_loadu_ps(out + (at) + 8),                                     \
    a##2 = _mm256_loadu_ps(out + (at) + 16);
#define TWO_STORE(a, at)                                                                                            \
    _mm256_storeu_ps(out + (at), a##0), _mm256_storeu_ps(out + (at) + 8, a##1),                                     \
    _mm256_storeu_ps(out + (at) + 16, a##2);
static inline __attribute__((always_inline)) void two_panels_rows(const void *w, int64_t size, int form,
                                                                  const float *x, int64_t ldx, int64_t k8,
                                                                  const int R, float *out, int resume) {
    TWO_ZERO(a) TWO_ZERO(b) TWO_ZERO(c) TWO_ZERO(d) /* a, b: row 0 on panels 0, 1; c, d: row 1 */
    if (resume) {
        TWO_LOAD(a, 0) TWO_LOAD(b, PANEL)
        if (R > 1) { TWO_LOAD(c, 2 * PANEL) TWO_LOAD(d, 3 * PANEL) }
    }
    for (int64_t i = 0; i < k8; i++) {
        __m256 u = _mm256_broadcast_ss(x + i), v = R > 1 ? _mm256_broadcast_ss(x + ldx + i) : u, t;
#define TWO_FMA(j, at)                                                                                              \
    t = load_w(w, at, form), a##j = _mm256_fmadd_ps(t, u, a##j);                                                    \
    if (R > 1) c##j = _mm256_fmadd_ps(t, v, c##j);                                                                  \
    t = load_w(w, size + (at), form), b##j = _mm256_fmadd_ps(t, u, b##j);                                           \
    if (R > 1) d##j = _mm256_fmadd_ps(t, v, d##j);
        TWO_FMA(0, i * PANEL) TWO_FMA(1, i * PANEL + 8) TWO_FMA(2, i * PANEL + 16)
#undef TWO_FMA
    }
    TWO_STORE(a, 0) TWO_STORE(b, PANEL)
    if (R > 1) { TWO_STORE(c, 2 * PANEL) TWO_STORE(d, 3 * PANEL) }
}
#define TWO_PANELS(NAME, FORM, R)                                                                                     \
    static void NAME(const void *w, int64_t size, const float *x, int64_t ldx, int64_t k8, float *out, int resume) { \
        two_panels_rows(w, size, FORM, x, ldx, k8, R, out, resume);                                                   \
    }
TWO_PANELS(two_panels_f32_1, 0, 1)
TWO_PANELS(two_panels_f32_2, 0, 2)
TWO_PANELS(two_panels_bf16_1, 1, 1)
TWO_PANELS(two_panels_bf16_2, 1, 2)
TWO_PANELS(two_panels_int8_1, 2, 1)
TWO_PANELS(two_panels_int8_2, 2, 2)
typedef void (*TwoPanels)(const void *w, int64_t size, const float *x, int64_t ldx, int64_t k8, float *out,
                          int resume);

#define PANEL_ROWS(NAME, FORM, R)                                                                                    \
    static void NAME(const void *w, const float *x, int64_t ldx, int64_t k8, float *out, const char *pf,             \
                     int64_t pf_step, int resume) {                                                                   \
        panel_rows(w, FORM, x, ldx, k8, R, out, pf, pf_step, resume, NULL);                                           \
    }
PANEL_ROWS(panel_f32_1, 0, 1)
PANEL_ROWS(panel_f32_2, 0, 2)
PANEL_ROWS(panel_f32_3, 0, 3)
PANEL_ROWS(panel_f32_4, 0, 4)
PANEL_ROWS(panel_bf16_1, 1, 1)
PANEL_ROWS(panel_bf16_2, 1, 2)
PANEL_ROWS(panel_bf16_3, 1, 3)
PANEL_ROWS(panel_bf16_4, 1, 4)
PANEL_ROWS(panel_int8w_1, 2, 1)
PANEL_ROWS(panel_int8w_2, 2, 2)
PANEL_ROWS(panel_int8w_3, 2, 3)
PANEL_ROWS(panel_int8w_4, 2, 4)
typedef void (*PanelRows)(const void *w, const float *x, int64_t ldx, int64_t k8, float *out, const char *pf,
                          int64_t pf_step, int resume);

/* The first group of rows over a bfloat16 or int8 chunk (FORM 1 or 2) that later groups read widened: it widens the
 * chunk in registers as it runs and stores the float32 weights at `keep` for them, so the chunk's bytes come from
 * memory while its FMAs run, and no separate pass over the chunk widens it first. */
#define PANEL_ROWS_KEEP(NAME, FORM, R)                                                                               \
    static void NAME(const void *w, const float *x, int64_t ldx, int64_t k8, float *out, const char *pf,             \
                     int64_t pf_step, int resume, float *keep) {                                                      \
        panel_rows(w, FORM, x, ldx, k8, R, out, pf, pf_step, resume, keep);                                           \
    }
PANEL_ROWS_KEEP(panel_bf16_keep_2, 1, 2)
PANEL_ROWS_KEEP(panel_bf16_keep_3, 1, 3)
PANEL_ROWS_KEEP(panel_bf16_keep_4, 1, 4)
PANEL_ROWS_KEEP(panel_int8w_keep_2, 2, 2)
PANEL_ROWS_KEEP(panel_int8w_keep_3, 2, 3)
PANEL_ROWS_KEEP(panel_int8w_keep_4, 2, 4)
typedef void (*PanelRowsKeep)(const void *w, const float *x, int64_t ldx, int64_t k8, float *out, const char *pf,
                              int64_t pf_step, int resume, float *keep);
static const PanelRowsKeep keep_kernels_of[2][3] = {{panel_bf16_keep_2, panel_bf16_keep_3, panel_bf16_keep_4},
                                                    {panel_int8w_keep_2, panel_int8w_keep_3, panel_int8w_keep_4}};

/* ---- bfloat16 weights in pairs, where the CPU multiplies bfloat16 itself (AVX512-BF16) --------------------------
 * Widening a bfloat16 weight costs a shift per eight, and then an FMA does eight multiply-adds: a verify pass of
 * 8-16 tokens is bound by those, and a bfloat16 pass ran no faster than a float32 one. VDPBF16PS does sixteen per
 * instruction, two adjacent inputs at a time, at the same rate (AMD EPYC Zen 4, one core, twelve independent
 * chains: 214 GFLOP/s against 114 for float32 FMAs). So where the CPU has it, a bfloat16 model's tiles hold its
 * weights in pairs of inputs ("pairs" layout, native.py): for input pair j, the 24 columns' (w[c, 2j], w[c, 2j+1])
 * side by side, 96 bytes, which is what one float32 input of a float32 panel takes. The inputs of a bfloat16 model's
 * products are bfloat16 values (rounded after every op), so they pair up exactly. Each output is then ONE chain of
 * VDPBF16PS over the pairs, in order, whatever the number of rows: as with FMAs, verifying k tokens gives bitwise
 * the logits of k steps. (The instruction's own rounding, denormals flushed, differs from an FMA chain in the last
 * bits: every pass of a model uses the one or the other, never both.) */
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 10)
#define PAIRS_BUILT 1
#define PAIRS_TARGET __attribute__((target("avx512f,avx512vl,avx512bf16")))
PAIRS_TARGET static inline __m256bh load_pairs(const uint32_t *w) {
    return (__m256bh)_mm256_loadu_si256((const __m256i *)w);
}
PAIRS_TARGET static inline __m256bh same_pair(const float *x, int64_t j) { /* input pair j, in every lane */
    uint32_t bits;
    memcpy(&bits, x + j, 4);
    return (__m256bh)_mm256_set1_epi32((int)bits);
}
/* R (1-8) rows of input pairs against one panel; x, ldx and k2 count pairs (x holds them as 32-bit words). AVX-512VL
 * code has 32 vector registers, so 8 rows' 24 accumulators fit beside the three weights and a broadcast: a pass of
 * 5 tokens ran in one group, where 4 rows and then one (three chains waiting on VDPBF16PS's latency) took 1.1-1.2x
 * as long (AMD EPYC Zen 4, 2 threads, thirty-third session) */
PAIRS_TARGET static inline __attribute__((always_inline)) void pair_panel_rows(const void *wp, const float *x,
                                                                               int64_t ldx, int64_t k2, const int R,
                                                                               float *out, const char *pf,
                                                                               int64_t pf_step, int resume) {
    const uint32_t *w = wp;
    ACC_ZERO(0) ACC_ZERO(1) ACC_ZERO(2) ACC_ZERO(3) ACC_ZERO(4) ACC_ZERO(5) ACC_ZERO(6) ACC_ZERO(7)
    ACC_LOAD(0) ACC_LOAD(1) ACC_LOAD(2) ACC_LOAD(3) ACC_LOAD(4) ACC_LOAD(5) ACC_LOAD(6) ACC_LOAD(7)
    for (int64_t i = 0; i < k2; i++) {
        request_share(pf, i, pf_step);
        __m256bh w0 = load_pairs(w + i * PANEL), w1 = load_pairs(w + i * PANEL + 8), w2 = load_pairs(w + i * PANEL + 16);
#define PAIR_DP(r)                                                                                                    \
    if (R > r) {                                                                                                      \
        __m256bh b = same_pair(x + r * ldx, i);                                                                       \
        a##r##0 = _mm256_dpbf16_ps(a##r##0, w0, b), a##r##1 = _mm256_dpbf16_ps(a##r##1, w1, b);                      \
        a##r##2 = _mm256_dpbf16_ps(a##r##2, w2, b);                                                                   \
    }
        PAIR_DP(0) PAIR_DP(1) PAIR_DP(2) PAIR_DP(3) PAIR_DP(4) PAIR_DP(5) PAIR_DP(6) PAIR_DP(7)
#undef PAIR_DP
    }
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3) ACC_STORE(4) ACC_STORE(5) ACC_STORE(6) ACC_STORE(7)
}
#define PAIR_PANEL_ROWS(NAME, R)                                                                                     \
    PAIRS_TARGET static void NAME(const void *w, const float *x, int64_t ldx, int64_t k2, float *out, const char *pf, \
                                  int64_t pf_step, int resume) {                                                      \
        pair_panel_rows(w, x, ldx, k2, R, out, pf, pf_step, resume);                                                  \
    }
PAIR_PANEL_ROWS(panel_pairs_1, 1)
PAIR_PANEL_ROWS(panel_pairs_2, 2)
PAIR_PANEL_ROWS(panel_pairs_3, 3)
PAIR_PANEL_ROWS(panel_pairs_4, 4)
PAIR_PANEL_ROWS(panel_pairs_5, 5)
PAIR_PANEL_ROWS(panel_pairs_6, 6)
PAIR_PANEL_ROWS(panel_pairs_7, 7)
PAIR_PANEL_ROWS(panel_pairs_8, 8)
/* int8 weights in pairs: y[c] = s[c] * (the pairs kernel's sum over the bfloat16 values of q[c, i]), with q an
 * integer in [-127, 127] and s its output column's float32 scale (applied with the bias, add_bias). Half the bytes of
 * bfloat16 weights, the same VDPBF16PS chains: with every s = 1 the sums are bitwise those of the pairs kernel on
 * bfloat16 tiles of q. q is stored as sign and magnitude (bit 7: negative), and each byte becomes its bfloat16 by
 * table, sixty-four at a time (AVX512-VBMI): the magnitude picks the high and the low byte of bf16(|q|) from two
 * 128-byte tables, the sign goes into the high one, and unpacking interleaves them into words: five instructions
 * per 64 weights where widening through float32 (sign-extend, convert, round to bfloat16) took twelve, and a step's
 * products ran no faster than bfloat16's from memory. The bytes of four units (4 x 48, an input pair of the panel's
 * 24 columns each) lie as three blocks of 64 in the order unpacking wants (native.py, int8_pair_tiles): the first
 * unpacks into units 0 and 1's columns 0-15, the second into units 2 and 3's, the third into all four's columns
 * 16-23. */
#define INT8_TARGET __attribute__((target("avx512f,avx512vl,avx512bf16,avx512bw,avx512vbmi")))
typedef struct {
    __m512i hi_a, hi_b, lo_a, lo_b, sign;
} Int8Tables;
static uint8_t int8_high[128], int8_low[128]; /* bf16(a)'s bytes for a = 0..127, made when the library loads */
__attribute__((constructor)) static void make_int8_tables(void) {
    for (int a = 0; a < 128; a++) {
        uint16_t bits = f32_to_bf16((float)a);
        int8_high[a] = (uint8_t)(bits >> 8), int8_low[a] = (uint8_t)bits;
    }
}
INT8_TARGET static inline Int8Tables int8_tables(void) { /* loaded per call (built per call: ~15% of a step) */
    Int8Tables T = {_mm512_loadu_si512(int8_high), _mm512_loadu_si512(int8_high + 64), _mm512_loadu_si512(int8_low),
                    _mm512_loadu_si512(int8_low + 64), _mm512_set1_epi8((char)0x80)};
    return T;
}
/* 64 weights' bytes -> their bfloat16 values, 32 words in each of w01 and w23 (their order: native.py) */
INT8_TARGET static inline __attribute__((always_inline)) void int8_block(const int8_t *p, const Int8Tables *T,
                                                                         __m512i *w01, __m512i *w23) {
    __m512i q = _mm512_loadu_si512(p); /* sign and magnitude; the tables' lookups read the magnitude's 7 bits */
    __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(T->hi_a, q, T->hi_b), q, T->sign, 0xF8);
    __m512i lo = _mm512_permutex2var_epi8(T->lo_a, q, T->lo_b); /* (0xF8 above: hi | (q & 0x80)) */
    *w01 = _mm512_unpacklo_epi8(lo, hi), *w23 = _mm512_unpackhi_epi8(lo, hi);
}
/* A row's sums: columns 0-15 of the panel in a zmm, 16-23 in a ymm: 16 registers for 8 rows, where 24 ymm left too
 * few beside the tables */
#define Z_ZERO(r) __m512 z##r = _mm512_setzero_ps(); __m256 y##r = _mm256_setzero_ps();
#define Z_LOAD(r)                                                                                                     \
    if (R > r && resume) z##r = _mm512_loadu_ps(out + r * PANEL), y##r = _mm256_loadu_ps(out + r * PANEL + 16);
#define Z_STORE(r)                                                                                                    \
    if (R > r) _mm512_storeu_ps(out + r * PANEL, z##r), _mm256_storeu_ps(out + r * PANEL + 16, y##r);
INT8_TARGET static inline __m512bh same_pair16(const float *x, int64_t j) { /* input pair j, in every lane */
    uint32_t bits;
    memcpy(&bits, x + j, 4);
    return (__m512bh)_mm512_set1_epi32((int)bits);
}
INT8_TARGET static inline __attribute__((always_inline)) void int8_pair_panel_rows(
    const void *wp, const float *x, int64_t ldx, int64_t k2, const int R, float *out, const char *pf, int64_t pf_step,
    int resume) {
    const int8_t *w = wp;
    const Int8Tables T = int8_tables();
    Z_ZERO(0) Z_ZERO(1) Z_ZERO(2) Z_ZERO(3) Z_ZERO(4) Z_ZERO(5) Z_ZERO(6) Z_ZERO(7)
    Z_LOAD(0) Z_LOAD(1) Z_LOAD(2) Z_LOAD(3) Z_LOAD(4) Z_LOAD(5) Z_LOAD(6) Z_LOAD(7)
    for (int64_t i = 0; i < k2; i += 4) { /* k2 is a multiple of 4 (inputs padded to 8) */
        for (int u = 0; u < 4; u++) request_share(pf, i + u, pf_step);
        const int8_t *g = w + i * 2 * PANEL;
        __m512i a, b;
#define Z_DP(vec, u)                                                                                                  \
    {                                                                                                                 \
        __m512bh v_ = (__m512bh)(vec);                                                                                \
        Z_ROW(0, u) Z_ROW(1, u) Z_ROW(2, u) Z_ROW(3, u) Z_ROW(4, u) Z_ROW(5, u) Z_ROW(6, u) Z_ROW(7, u)               \
    }
#define Z_ROW(r, u) if (R > r) z##r = _mm512_dpbf16_ps(z##r, v_, same_pair16(x + r * ldx, i + u));
#define Y_DP(vec, u)                                                                                                  \
    {                                                                                                                 \
        __m256bh v_ = (__m256bh)(vec);                                                                                \
        Y_ROW(0, u) Y_ROW(1, u) Y_ROW(2, u) Y_ROW(3, u) Y_ROW(4, u) Y_ROW(5, u) Y_ROW(6, u) Y_ROW(7, u)               \
    }
#define Y_ROW(r, u) if (R > r) y##r = _mm256_dpbf16_ps(y##r, v_, same_pair(x + r * ldx, i + u));
        int8_block(g, &T, &a, &b); /* units 0 and 1, columns 0-15 */
        Z_DP(a, 0) Z_DP(b, 1)
        int8_block(g + 64, &T, &a, &b); /* units 2 and 3, columns 0-15 */
        Z_DP(a, 2) Z_DP(b, 3)
        int8_block(g + 128, &T, &a, &b); /* columns 16-23: units 0 and 1 in a, 2 and 3 in b */
        Y_DP(_mm512_castsi512_si256(a), 0) Y_DP(_mm512_extracti64x4_epi64(a, 1), 1)
        Y_DP(_mm512_castsi512_si256(b), 2) Y_DP(_mm512_extracti64x4_epi64(b, 1), 3)
#undef Z_DP
#undef Z_ROW
#undef Y_DP
#undef Y_ROW
    }
    Z_STORE(0) Z_STORE(1) Z_STORE(2) Z_STORE(3) Z_STORE(4) Z_STORE(5) Z_STORE(6) Z_STORE(7)
}
#define INT8_PANEL_ROWS(NAME, R)                                                                                     \
    INT8_TARGET static void NAME(const void *w, const float *x, int64_t ldx, int64_t k2, float *out, const char *pf,  \
                                 int64_t pf_step, int resume) {                                                       \
        int8_pair_panel_rows(w, x, ldx, k2, R, out, pf, pf_step, resume);                                             \
    }
INT8_PANEL_ROWS(panel_int8_1, 1) INT8_PANEL_ROWS(panel_int8_2, 2) INT8_PANEL_ROWS(panel_int8_3, 3)
INT8_PANEL_ROWS(panel_int8_4, 4) INT8_PANEL_ROWS(panel_int8_5, 5) INT8_PANEL_ROWS(panel_int8_6, 6)
INT8_PANEL_ROWS(panel_int8_7, 7) INT8_PANEL_ROWS(panel_int8_8, 8)
/* A chunk of `count` int8 units (a multiple of 4) as the bfloat16 pairs kernel's units, into out (count * PANEL
 * words): wide passes expand each chunk once for all their groups of rows, rather than once per group in the
 * kernel above */
INT8_TARGET static void int8_expand(const void *wp, int64_t count, uint32_t *out) {
    const int8_t *w = wp;
    const Int8Tables T = int8_tables();
    for (int64_t i = 0; i < count; i += 4) {
        const int8_t *g = w + i * 2 * PANEL;
        uint32_t *u = out + i * PANEL; /* unit j's 24 words at u + j * PANEL */
        __m512i a, b;
        int8_block(g, &T, &a, &b);
        _mm512_storeu_si512(u, a), _mm512_storeu_si512(u + PANEL, b);
        int8_block(g + 64, &T, &a, &b);
        _mm512_storeu_si512(u + 2 * PANEL, a), _mm512_storeu_si512(u + 3 * PANEL, b);
        int8_block(g + 128, &T, &a, &b);
        _mm256_storeu_si256((__m256i *)(u + 16), _mm512_castsi512_si256(a));
        _mm256_storeu_si256((__m256i *)(u + PANEL + 16), _mm512_extracti64x4_epi64(a, 1));
        _mm256_storeu_si256((__m256i *)(u + 2 * PANEL + 16), _mm512_castsi512_si256(b));
        _mm256_storeu_si256((__m256i *)(u + 3 * PANEL + 16), _mm512_extracti64x4_epi64(b, 1));
    }
}
static int cpu_has_vbmi(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bw");
}
/* Eight logits of a bfloat16 head as the pairs kernel stores them, rows ids[] of w: each one chain of VDPBF16PS (the
 * same instruction, lane 0) over the pairs of w and of x (bfloat16 values), rounded to bfloat16. An odd k's last
 * pair holds a zero beside its last value, as the tiles' zero padding does (the kernel adds it like any pair; the
 * padding's further pairs add exact zeros). Eight chains side by side: one waits on the instruction's latency. */
PAIRS_TARGET static void chain_dot_pairs8(const uint16_t *w, const int64_t *ids, const float *x, int64_t k,
                                          float *out) {
    __m128 acc[8];
    for (int t = 0; t < 8; t++) acc[t] = _mm_setzero_ps();
    for (int64_t j = 0; j < k; j += 2) {
        int second = j + 1 < k; /* else the pair's second value is the padding's zero */
        __m128bh xj = (__m128bh)_mm_cvtsi32_si128(
            (int)((uint32_t)f32_to_bf16(x[j]) | (second ? (uint32_t)f32_to_bf16(x[j + 1]) << 16 : 0u)));
        for (int t = 0; t < 8; t++) {
            const uint16_t *r = w + ids[t] * k;
            uint32_t pair = (uint32_t)r[j] | (second ? (uint32_t)r[j + 1] << 16 : 0u);
            acc[t] = _mm_dpbf16_ps(acc[t], (__m128bh)_mm_cvtsi32_si128((int)pair), xj);
        }
    }
    for (int t = 0; t < 8; t++) out[t] = bf16_to_f32(f32_to_bf16(_mm_cvtss_f32(acc[t])));
}
/* x[0..n) (bfloat16 values) as a bfloat16 array, sixteen at a time by VCVTNEPS2BF16: exact for bfloat16 values but
 * for subnormals, which it flushes to zero as VDPBF16PS, the only reader, flushes them anyway */
PAIRS_TARGET static void bf16_array(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    for (; i + 8 <= n; i += 8) store8(out, i, _mm256_loadu_ps(x + i), 1);
    for (; i < n; i++) out[i] = f32_to_bf16(x[i]);
}
/* float32 panels in AVX-512VL code, where the CPU has it: the AVX2 kernel's FMA chains, each output the same one
 * chain, with up to 8 rows' 24 accumulators in 32 registers. Layers of 5-8 float32 tokens took 0.89-0.98x the time
 * of groups of 4 (AMD EPYC Zen 4, 2 threads, thirty-third session; 12-16 tokens 0.98-1.02x). */
#define F32_WIDE_TARGET __attribute__((target("avx512f,avx512vl")))
#define PANEL_ROWS_WIDE(NAME, R)                                                                                     \
    F32_WIDE_TARGET static void NAME(const void *w, const float *x, int64_t ldx, int64_t k8, float *out,              \
                                     const char *pf, int64_t pf_step, int resume) {                                   \
        panel_rows(w, 0, x, ldx, k8, R, out, pf, pf_step, resume, NULL);                                              \
    }
PANEL_ROWS_WIDE(panel_f32x_1, 1) PANEL_ROWS_WIDE(panel_f32x_2, 2) PANEL_ROWS_WIDE(panel_f32x_3, 3)
PANEL_ROWS_WIDE(panel_f32x_4, 4) PANEL_ROWS_WIDE(panel_f32x_5, 5) PANEL_ROWS_WIDE(panel_f32x_6, 6)
PANEL_ROWS_WIDE(panel_f32x_7, 7) PANEL_ROWS_WIDE(panel_f32x_8, 8)
/* float32 panels in 512-bit code (F32_ZMM), where the CPU has two 512-bit FMA units (Intel Xeon): a panel's
 * columns 0-15 in one zmm register and 16-23 in a ymm, so an input of a row takes two FMAs where 256-bit code takes
 * three. Each output is still the same one chain of FMAs in input order (a lane is a column): outputs are bitwise
 * those of the other float32 kernels. On AMD Zen 4 a zmm FMA takes two 256-bit halves, so nothing is saved there:
 * native.py times both when the library loads (`f32_kernel`). */
#define ZMM_ZERO(r) __m512 l##r = _mm512_setzero_ps(); __m256 h##r = _mm256_setzero_ps();
#define ZMM_LOAD(r)                                                                                                   \
    if (R > r && resume) l##r = _mm512_loadu_ps(out + r * PANEL), h##r = _mm256_loadu_ps(out + r * PANEL + 16);
#define ZMM_FMA(r)                                                                                                    \
    if (R > r) {                                                                                                      \
        __m512 b = _mm512_set1_ps(x[r * ldx + i]);                                                                    \
        l##r = _mm512_fmadd_ps(wl, b, l##r), h##r = _mm256_fmadd_ps(wh, _mm512_castps512_ps256(b), h##r);            \
    }
#define ZMM_STORE(r)                                                                                                  \
    if (R > r) _mm512_storeu_ps(out + r * PANEL, l##r), _mm256_storeu_ps(out + r * PANEL + 16, h##r);
F32_WIDE_TARGET static inline __attribute__((always_inline)) void panel_rows_zmm(const float *w, const float *x,
                                                                                 int64_t ldx, int64_t k8, const int R,
                                                                                 float *out, const char *pf,
                                                                                 int64_t pf_step, int resume) {
    ZMM_ZERO(0) ZMM_ZERO(1) ZMM_ZERO(2) ZMM_ZERO(3) ZMM_ZERO(4) ZMM_ZERO(5) ZMM_ZERO(6) ZMM_ZERO(7)
    ZMM_LOAD(0) ZMM_LOAD(1) ZMM_LOAD(2) ZMM_LOAD(3) ZMM_LOAD(4) ZMM_LOAD(5) ZMM_LOAD(6) ZMM_LOAD(7)
    for (int64_t i = 0; i < k8; i++) {
        request_share(pf, i, pf_step);
        __m512 wl = _mm512_loadu_ps(w + i * PANEL);
        __m256 wh = _mm256_loadu_ps(w + i * PANEL + 16);
        ZMM_FMA(0) ZMM_FMA(1) ZMM_FMA(2) ZMM_FMA(3) ZMM_FMA(4) ZMM_FMA(5) ZMM_FMA(6) ZMM_FMA(7)
    }
    ZMM_STORE(0) ZMM_STORE(1) ZMM_STORE(2) ZMM_STORE(3) ZMM_STORE(4) ZMM_STORE(5) ZMM_STORE(6) ZMM_STORE(7)
}
#define PANEL_ROWS_ZMM(NAME, R)                                                                                      \
    F32_WIDE_TARGET static void NAME(const void *w, const float *x, int64_t ldx, int64_t k8, float *out,              \
                                     const char *pf, int64_t pf_step, int resume) {                                   \
        panel_rows_zmm(w, x, ldx, k8, R, out, pf, pf_step, resume);                                                   \
    }
PANEL_ROWS_ZMM(panel_f32z_1, 1) PANEL_ROWS_ZMM(panel_f32z_2, 2) PANEL_ROWS_ZMM(panel_f32z_3, 3)
PANEL_ROWS_ZMM(panel_f32z_4, 4) PANEL_ROWS_ZMM(panel_f32z_5, 5) PANEL_ROWS_ZMM(panel_f32z_6, 6)
PANEL_ROWS_ZMM(panel_f32z_7, 7) PANEL_ROWS_ZMM(panel_f32z_8, 8)
static int cpu_has_avx512vl(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl");
}
static int cpu_has_pairs(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl");
}
#else
#define PAIRS_BUILT 0
#define panel_pairs_1 NULL
#define panel_pairs_2 NULL
#define panel_pairs_3 NULL
#define panel_pairs_4 NULL
#define panel_pairs_5 NULL
#define panel_pairs_6 NULL
#define panel_pairs_7 NULL
#define panel_pairs_8 NULL
#define panel_int8_1 NULL
#define panel_int8_2 NULL
#define panel_int8_3 NULL
#define panel_int8_4 NULL
#define panel_int8_5 NULL
#define panel_int8_6 NULL
#define panel_int8_7 NULL
#define panel_int8_8 NULL
static void chain_dot_pairs8(const uint16_t *w, const int64_t *ids, const float *x, int64_t k, float *out) {
    (void)w, (void)ids, (void)x, (void)k;
    for (int t = 0; t < 8; t++) out[t] = NAN;
}
static int cpu_has_pairs(void) { return 0; }
static int cpu_has_avx512vl(void) { return 0; }
static int cpu_has_vbmi(void) { return 0; }
static void int8_expand(const void *w, int64_t count, uint32_t *out) { (void)w, (void)count, (void)out; }
#define panel_f32x_1 NULL
#define panel_f32x_2 NULL
#define panel_f32x_3 NULL
#define panel_f32x_4 NULL
#define panel_f32x_5 NULL
#define panel_f32x_6 NULL
#define panel_f32x_7 NULL
#define panel_f32x_8 NULL
#define panel_f32z_1 NULL
#define panel_f32z_2 NULL
#define panel_f32z_3 NULL
#define panel_f32z_4 NULL
#define panel_f32z_5 NULL
#define panel_f32z_6 NULL
#define panel_f32z_7 NULL
#define panel_f32z_8 NULL
static void bf16_array(const float *x, int64_t n, uint16_t *out) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(out, i, _mm256_loadu_ps(x + i), 1);
    for (; i < n; i++) out[i] = f32_to_bf16(x[i]);
}
#endif

/* Whether this build and CPU run bfloat16 products in pairs (native.py lays such weights out for it then). */
int dflash_bf16_pairs(void) { return PAIRS_BUILT && cpu_has_pairs(); }

/* Whether this build and CPU run int8 weights in pairs (INT8_PAIRS: AVX512-BF16 and AVX512-VBMI) */
int dflash_int8_pairs(void) { return PAIRS_BUILT && cpu_has_pairs() && cpu_has_vbmi(); }

/* Kernels by weight kind: 0 float32, 1 bfloat16 widened, 2 bfloat16 in pairs, 3 (F32_WIDE) float32 in AVX-512VL
 * code, 4 (INT8_PAIRS) int8 in pairs, 5 (INT8_WIDENED) int8 widened to float32 in AVX2 code. Kinds 2-4 have 32
 * vector registers: up to 8 rows (24 accumulators) run against a panel at once, where AVX2's 16 registers hold 4
 * rows'.
 * INT8_WIDENED is an int8 target's products where the CPU lacks AVX512-BF16 (AVX2 machines: AMD Zen 2 and 3, most
 * Intel client chips): the float32 panel layout with a byte a weight (the integer q in [-127, 127]), each output
 * the float kernels' one chain of FMAs over float32(q) in input order, times its column's scale after the sum (as
 * INT8_PAIRS). Half the bytes of bfloat16 panels for the same instructions a weight (a sign extension and a
 * conversion where bfloat16 takes an extension and a shift): a step's products are bound by the memory. */
#define INT8_PAIRS 4
#define INT8_WIDENED 5
static const PanelRows panel_kernels_of[7][8] = {
    {panel_f32_1, panel_f32_2, panel_f32_3, panel_f32_4},
    {panel_bf16_1, panel_bf16_2, panel_bf16_3, panel_bf16_4},
    {panel_pairs_1, panel_pairs_2, panel_pairs_3, panel_pairs_4, panel_pairs_5, panel_pairs_6, panel_pairs_7,
     panel_pairs_8},
    {panel_f32x_1, panel_f32x_2, panel_f32x_3, panel_f32x_4, panel_f32x_5, panel_f32x_6, panel_f32x_7,
     panel_f32x_8},
    {panel_int8_1, panel_int8_2, panel_int8_3, panel_int8_4, panel_int8_5, panel_int8_6, panel_int8_7,
     panel_int8_8},
    {panel_int8w_1, panel_int8w_2, panel_int8w_3, panel_int8w_4},
    {panel_f32z_1, panel_f32z_2, panel_f32z_3, panel_f32z_4, panel_f32z_5, panel_f32z_6, panel_f32z_7,
     panel_f32z_8}};
/* float32 panels (and bfloat16 ones widened to them) run by the AVX-512VL kernels, in 256-bit (F32_WIDE) or 512-bit
 * code (F32_ZMM): kinds of the table above, not of a Product */
#define F32_WIDE 3
#define F32_ZMM 6
/* Which kernel runs float32 panels: 0 AVX2, 1 AVX-512VL (F32_WIDE), 2 512-bit (F32_ZMM); -1 not yet asked (then 1
 * where the CPU has AVX-512VL, else 0). All sum each output as the same one chain: only the time differs. */
static int f32_kernel = -1;
int dflash_f32_kernel(void) {
    if (f32_kernel < 0) f32_kernel = cpu_has_avx512vl();
    return f32_kernel;
}
/* Sets it (clamped to what the CPU runs: 0 without AVX-512VL); returns the kernel now in force. */
int dflash_set_f32_kernel(int which) {
    f32_kernel = cpu_has_avx512vl() ? MAX(0, MIN(2, which)) : 0;
    return f32_kernel;
}
static inline int run_kind(int kind) {
    if (kind != 0) return kind;
    int which = dflash_f32_kernel();
    return which == 2 ? F32_ZMM : which == 1 ? F32_WIDE : 0;
}
static inline int64_t group_rows_of(int kind) { return kind == 0 || kind == 1 || kind == INT8_WIDENED ? 4 : 8; }
/* by load_w's form: float32, bfloat16, int8 (AVX2 code, for kinds 0, 1 and INT8_WIDENED) */
static const TwoPanels two_panel_kernels_of[3][2] = {{two_panels_f32_1, two_panels_f32_2},
                                                     {two_panels_bf16_1, two_panels_bf16_2},
                                                     {two_panels_int8_1, two_panels_int8_2}};

/* yf[m, n] = xf[m, k8] . W^T + bias, all float32 but the panels. For more than four input rows a bfloat16 or int8
 * chunk is widened to float32 once (into L1), rather than once per four rows: on AVX2 by the first group of rows as
 * it runs over the chunk (FUSED_WIDEN). `kind`: 0 float32, 1 bfloat16
 * (widened), 2 bfloat16 in pairs, whose xf holds the inputs as pairs of bfloat16 (k8 / 2 words a row), INT8_PAIRS
 * and INT8_WIDENED (above). A panel's "unit" is what one step of its kernel reads: an input (float32, bfloat16,
 * int8) or a pair of inputs. */
typedef struct {
    const void *panels;
    int kind;
    const float *xf, *bias;
    float *yf;
    int64_t m, n, k8;
    int round; /* outputs rounded to bfloat16 values (a bfloat16 layer's) */
    const float *scales; /* int8 kinds: the output columns' scales, after the panels (native.py); else NULL */
} Product;

static inline int in_pairs(int kind) { return kind == 2 || kind == INT8_PAIRS; }
static inline int64_t units_of(const Product *W) { return in_pairs(W->kind) ? W->k8 / 2 : W->k8; }
static inline int64_t unit_bytes(const Product *W) { /* per panel column */
    return W->kind == INT8_WIDENED ? 1 : W->kind == 1 || W->kind == INT8_PAIRS ? 2 : 4;
}
static inline int int8_kind(int kind) { return kind == INT8_PAIRS || kind == INT8_WIDENED; }
static inline int form_of(int kind) { return kind == INT8_WIDENED ? 2 : kind; } /* load_w's, for kinds 0, 1, 5 */

/* *buffer with room for `floats`, grown (never shrunk) as needed; NULL when out of memory. */
static float *kept_buffer(float **buffer, int64_t *size, int64_t floats) {
    if (floats > *size) {
        float *grown = realloc(*buffer, sizeof(float) * (size_t)floats);
        if (!grown) return NULL;
        *buffer = grown, *size = floats;
    }
    return *buffer;
}

static float *widening_buffer(int64_t floats) { /* one per thread, kept: the largest chunk seen */
    static _Thread_local float *buffer;
    static _Thread_local int64_t size;
    return kept_buffer(&buffer, &size, floats);
}

static void widen_panel(const void *w, int64_t count, float *out) {
    const uint16_t *p = w;
    for (int64_t i = 0; i < count; i += 8) {
        if (i % 32 == 0) _mm_prefetch((const char *)(p + i + PREFETCH * PANEL), _MM_HINT_T0);
        _mm256_storeu_ps(out + i, widen_bf16(p + i));
    }
}
static void widen_int8_panel(const void *w, int64_t count, float *out) { /* INT8_WIDENED's bytes, likewise */
    const int8_t *p = w;
    for (int64_t i = 0; i < count; i += 8) {
        if (i % 64 == 0) _mm_prefetch((const char *)(p + i + PREFETCH * PANEL), _MM_HINT_T0);
        _mm256_storeu_ps(out + i, widen_int8(p + i));
    }
}

/* Inputs per chunk of a panel when several groups of four input rows run over it: a chunk (6 KB in float32) and
 * its inputs of 16 rows (4 KB) stay in L1 while every group runs over it, the sums carried from chunk to chunk in
 * `sums` (a float32 stored and reloaded is exact, so each output is still its one chain). */
#ifndef CHUNK
#define CHUNK 64
#endif
/* The same for bfloat16 in pairs, in pairs of inputs: 32 (3 KB) rather than 64. Layers of 16-token bfloat16 passes
 * after 300 tokens took 0.967x, 0.987x, 0.954x and 0.981x the time in four runs (`AB_PAIRS=61 ... ab_native.py old.c
 * new.c layers bfloat16 300`; after 1000 tokens 1.011x; 16 pairs: 1.082x 32's), while float32 with 32 took 1.011x
 * (AMD EPYC Zen 4, thirty-first session). */
#ifndef PAIR_CHUNK
#define PAIR_CHUNK 32
#endif

/* Rows x[0:rows] (at most SLICE) against one panel, over all inputs in chunks; sums[r * PANEL + c] on return. */
#define SLICE 16
/* The next group's rows, of `left` rows in `groups` groups of at most `most`: full groups, unless that would leave
 * a last group of under half as many, whose few chains wait on the instruction's latency; then groups as even as
 * can be (in pairs 9 rows as 5 + 4, not 8 + 1: 10 as 5 + 5 took 0.95x the time of 8 + 2, 11 as 6 + 5 0.97x 8 + 3).
 * Splitting evenly where the last group was at least half full measured no faster (12 rows in pairs as 6 + 6:
 * 0.99x 8 + 4) or slower (float32, 6 rows as 3 + 3: 1.07x 4 + 2). */
static inline int64_t group_size(int64_t rows, int64_t left, int64_t groups_left, int64_t most) {
    int64_t last = rows % most;
    return last != 0 && 2 * last < most ? (left + groups_left - 1) / groups_left : MIN(most, left);
}
/* Whether the first group of rows widens a bfloat16 or int8 chunk for the others as it runs (AVX2's float kernels;
 * 0: a pass of its own widens each chunk first). That pass read the chunk from memory while no FMA ran: the layers
 * of 5-, 8- and 16-token bfloat16 passes took 0.74x, 0.74x and 0.81x the time fused, int8's 0.66x, 0.69x and 0.81x,
 * 16 rows of a bfloat16 batch on one thread 0.85x (scripts/ab_native.py, AMD EPYC Zen 3, 2 threads). Outputs are
 * bitwise the same: the same weights enter the same chains. */
#ifndef FUSED_WIDEN
#define FUSED_WIDEN 1
#endif
/* Rows beyond which int8 weights are expanded a chunk at a time (int8_expand) rather than in the kernel: up to 8,
 * one group, in the kernel took 0.88-0.96x the time of expanding (5-8 rows), from 9 rows expanding once for all
 * groups 0.78x (16 rows; all products of SmolLM2's layers from memory, AMD EPYC Zen 4, 2 threads) */
#ifndef INT8_INLINE_ROWS
#define INT8_INLINE_ROWS 8
#endif
/* How passes of a few rows read the panels, set per machine by measurement (native.py, set_narrow_passes;
 * target.py, choose_narrow_passes): up to `two_panel_rows` rows (0-4) run two panels at a time (AVX2's float
 * kernels, two memory streams), and from `request_from_rows` rows a single group of rows requests the next chunk
 * while it works on this one. On AMD EPYC Zen 3 and Zen 4 two panels up to 4 rows and requests from 7 measured best
 * (the defaults; thirty-third session); on an Intel Xeon with AVX-512 (family 6 model 207, float32) one panel from
 * 2 rows, requesting from 2 rows, took 0.67-0.81x the time at 3-5 rows and 0.94x at 2 (forty-eighth session; a
 * step kept two panels). Each output is the same one chain either way. */
static int two_panel_rows = 4, request_from_rows = 7;
int dflash_set_narrow_passes(int two_panels, int request_from) {
    two_panel_rows = MAX(0, MIN(4, two_panels)), request_from_rows = MAX(1, request_from);
    return 0;
}
static void panel_slice(const Product *W, const char *stored, const float *x, int64_t rows, float *wide,
                        float *sums) {
    int widen = wide && (W->kind == 1 || W->kind == INT8_WIDENED) && rows > 4;
    int expand = wide && W->kind == INT8_PAIRS && rows > INT8_INLINE_ROWS;
    int kind = run_kind(widen ? 0 : expand ? 2 : W->kind);
    int64_t k8 = units_of(W), elem = unit_bytes(W), most = group_rows_of(kind), groups = (rows + most - 1) / most;
    /* A group of 7-8 rows in pairs alone also requests the next chunk while it works on this one (its arithmetic
     * nears the memory's time; 8 rows 0.95x the time, 5 rows 1.01-1.08x, AMD EPYC Zen 4): request_from_rows */
    int request = groups > 1 || rows >= request_from_rows;
    int64_t chunk = !request && !widen && !expand ? k8 : in_pairs(W->kind) ? PAIR_CHUNK : CHUNK;
    int keeps = widen && kind == 0 && FUSED_WIDEN; /* AVX2's float kernels: the first group widens for the rest */
    for (int64_t c0 = 0; c0 < k8; c0 += chunk) {
        int64_t count = MIN(chunk, k8 - c0);
        const char *at = stored + c0 * PANEL * elem, *ahead = at + count * PANEL * elem; /* the next chunk */
        const void *w = at;
        if (widen && !keeps) (W->kind == 1 ? widen_panel : widen_int8_panel)(w, count * PANEL, wide), w = wide;
        if (expand) int8_expand(w, count, (uint32_t *)wide), w = wide;
        /* with several groups each requests its share of the next chunk (after the last, the next panel's first:
         * panels lie back to back; past the last panel a request is harmless, prefetches never fault), so the
         * memory streams while the FMAs run over this one; one group leaves it to the hardware prefetcher
         * (explicit requests made float32 steps ~10% slower) */
        int64_t share = (count * PANEL * elem + groups - 1) / groups;
        for (int64_t j = 0, g = 0, size; j < rows; j += size, g++) {
            size = group_size(rows, rows - j, groups - g, most);
            const char *pf = request ? ahead + g * share : NULL;
            int64_t pf_step = (share + count - 1) / count;
            if (keeps && g == 0) {
                keep_kernels_of[W->kind == 1 ? 0 : 1][size - 2](at, x + j * k8 + c0, k8, count, sums + j * PANEL, pf,
                                                                pf_step, c0 > 0, wide);
                w = wide;
            } else
                panel_kernels_of[kind][size - 1](w, x + j * k8 + c0, k8, count, sums + j * PANEL, pf, pf_step, c0 > 0);
        }
    }
}

/* y[0:cols] = sums[0:cols] + bias[0:cols] (+ 0 without a bias: -0 becomes +0), rounded to bfloat16 values where
 * `round` (a bfloat16 layer's products), eight at a time where a whole panel lands; int8 weights' sums are first
 * multiplied by their columns' `scales` (NULL: none). One value at a time this was 6% of a 16-token bfloat16 pass;
 * the rounding, done after the product on the calling thread alone, 2% more while the other thread waited. */
static inline void add_bias(float *y, const float *sums, const float *bias, int64_t cols, int round,
                            const float *scales) {
    int64_t c = 0;
    if (cols == PANEL)
        for (; c < PANEL; c += 8) {
            __m256 sum = _mm256_loadu_ps(sums + c);
            if (scales) sum = _mm256_mul_ps(sum, _mm256_loadu_ps(scales + c));
            __m256 v = _mm256_add_ps(sum, bias ? _mm256_loadu_ps(bias + c) : _mm256_setzero_ps());
            _mm256_storeu_ps(y + c, round ? _mm256_castsi256_ps(bf16_bits8(v)) : v);
        }
    for (; c < cols; c++) {
        float v = (scales ? sums[c] * scales[c] : sums[c]) + (bias ? bias[c] : 0.0f);
        y[c] = round ? bf16_to_f32(f32_to_bf16(v)) : v;
    }
}

/* Rows x[0:rows] (at most two_panel_rows, 4) against panels p and p + 1, two rows at a time; beyond two rows in chunks
 * of CHUNK inputs, so that every pair after the first reads the chunk from L1. Writes those panels' outputs. */
static void two_panel_slice(const Product *W, const char *stored, int64_t p, float *sums) {
    int64_t m = W->m, n = W->n, k8 = units_of(W), size = PANEL * k8, elem = unit_bytes(W), chunk = m > 2 ? CHUNK : k8;
    for (int64_t c0 = 0; c0 < k8; c0 += chunk)
        for (int64_t j = 0; j < m; j += 2)
            two_panel_kernels_of[form_of(W->kind)][MIN(2, m - j) - 1](stored + c0 * PANEL * elem, size,
                                                                   W->xf + j * k8 + c0, k8, MIN(chunk, k8 - c0),
                                                                   sums + j * 2 * PANEL, c0 > 0);
    for (int64_t r = 0; r < m; r++)
        for (int64_t q = 0; q < 2; q++)
            add_bias(W->yf + r * n + PANEL * (p + q), sums + (r * 2 + q) * PANEL,
                     W->bias ? W->bias + PANEL * (p + q) : NULL, MIN(PANEL, n - PANEL * (p + q)), W->round,
                     W->scales ? W->scales + PANEL * (p + q) : NULL);
}

/* A step's row against four panels at once (p .. p + 3): four memory streams and twelve chains, where two panels'
 * streams read too few bytes an input to keep the memory busy. int8 (INT8_WIDENED, 24 bytes a stream an input): all
 * products of SmolLM2's layers from memory took 0.50-0.61x the widening bfloat16 kernel's time this way, 0.58-0.64x
 * two panels at a time (five alternating runs each of scripts/int8_harness.c, AMD EPYC Zen 3, 2 threads). Widened
 * bfloat16 (48 bytes): the same products 0.83-0.93x the time of two panels in 8 of 9 alternating runs; a bfloat16
 * model's layers at a step 0.92-0.94x, the step with its full head 0.86x (scripts/ab_native.py, AB_WIDTHS=1). float32
 * (96 bytes): no faster (5 of 9 runs slower), so it keeps two. Each output is still its one chain. */
static inline __attribute__((always_inline)) void four_panels_row(const void *w, int64_t size, int form,
                                                                  const float *x, int64_t k8, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0, c0 = a0, c1 = a0, c2 = a0, d0 = a0,
           d1 = a0, d2 = a0;
    for (int64_t i = 0; i < k8; i++) {
        __m256 u = _mm256_broadcast_ss(x + i);
        int64_t at = i * PANEL;
        a0 = _mm256_fmadd_ps(load_w(w, at, form), u, a0), b0 = _mm256_fmadd_ps(load_w(w, at + size, form), u, b0);
        c0 = _mm256_fmadd_ps(load_w(w, at + 2 * size, form), u, c0);
        d0 = _mm256_fmadd_ps(load_w(w, at + 3 * size, form), u, d0);
        a1 = _mm256_fmadd_ps(load_w(w, at + 8, form), u, a1);
        b1 = _mm256_fmadd_ps(load_w(w, at + size + 8, form), u, b1);
        c1 = _mm256_fmadd_ps(load_w(w, at + 2 * size + 8, form), u, c1);
        d1 = _mm256_fmadd_ps(load_w(w, at + 3 * size + 8, form), u, d1);
        a2 = _mm256_fmadd_ps(load_w(w, at + 16, form), u, a2);
        b2 = _mm256_fmadd_ps(load_w(w, at + size + 16, form), u, b2);
        c2 = _mm256_fmadd_ps(load_w(w, at + 2 * size + 16, form), u, c2);
        d2 = _mm256_fmadd_ps(load_w(w, at + 3 * size + 16, form), u, d2);
    }
    TWO_STORE(a, 0) TWO_STORE(b, PANEL) TWO_STORE(c, 2 * PANEL) TWO_STORE(d, 3 * PANEL)
}
#define FOUR_PANELS_ROW(NAME, FORM)                                                                                  \
    static void NAME(const void *w, int64_t size, const float *x, int64_t k8, float *out) {                         \
        four_panels_row(w, size, FORM, x, k8, out);                                                                   \
    }
FOUR_PANELS_ROW(four_panels_f32, 0)
FOUR_PANELS_ROW(four_panels_bf16, 1)
FOUR_PANELS_ROW(four_panels_int8, 2)
typedef void (*FourPanels)(const void *w, int64_t size, const float *x, int64_t k8, float *out);
static const FourPanels four_panel_kernels_of[3] = {four_panels_f32, four_panels_bf16, four_panels_int8};
#ifndef FOUR_PANELS /* the forms (load_w's) whose steps run four panels at a time: a bit each, 1 f32, 2 bf16, 4 int8 */
#define FOUR_PANELS 6
#endif
static inline int four_panels_for(const Product *W) {
    return W->m == 1 && !in_pairs(W->kind) && (FOUR_PANELS >> form_of(W->kind) & 1);
}
static void four_panel_step(const Product *W, const char *stored, int64_t p, float *sums) {
    int64_t n = W->n, k8 = W->k8;
    four_panel_kernels_of[form_of(W->kind)](stored, PANEL * k8, W->xf, k8, sums);
    for (int64_t q = 0; q < 4; q++)
        add_bias(W->yf + PANEL * (p + q), sums + q * PANEL, W->bias ? W->bias + PANEL * (p + q) : NULL,
                 MIN(PANEL, n - PANEL * (p + q)), W->round, W->scales ? W->scales + PANEL * (p + q) : NULL);
}

/* ---- bfloat16 pairs through AMX tiles, where the CPU has them (Intel Sapphire Rapids and later) -------------------
 * A verify pass of 8-16 bfloat16 tokens is bound by its multiply-adds even in pairs: VDPBF16PS does 16 an
 * instruction, and a 16-token pass of SmolLM2 took 1.9-2.9x a step (Intel Xeon, family 6 model 207, 2 threads). One
 * TDPBF16PS multiplies a tile of up to 16 rows by 16 input pairs against 16 pairs of 16 columns: 8192 multiply-adds.
 * The pairs layout is already what it reads: for 16 input pairs, a panel's columns 0-15 are a tile of 16 rows of 64
 * bytes, 96 bytes apart, and columns 16-23 one of 32-byte rows. So the same tiles serve both kernels, and a product
 * of 1-16 rows reads its weight once at about the memory's speed (a standalone harness over SmolLM2's 212 MB of
 * decoder products, 2 threads: 9.1-10.6 ms at 1-16 rows, where a plain read of the bytes took 9.9 and VDPBF16PS
 * 17-22 ms at one row and 45-86 at sixteen).
 * TDPBF16PS does not sum as a chain of VDPBF16PS: the 32 products of a block meet the sum once, not pair by pair
 * (measured: 40% of outputs differ in their last bits). So a model either runs ALL its products in pairs through
 * tiles or none (dflash_set_amx, switched between passes, never inside one), and every output is ONE sequence of
 * blocks of 16 input pairs, in order, whatever the number of rows: a row's sums never depend on the other rows of its
 * tile (tests/test_native.py), so verifying k tokens still gives bitwise the logits of k steps. Inputs past k (the
 * tiles' zero padding to 8, then zeros to a whole block) add exact zeros. The screen's survivors (chain_dot_amx8)
 * are summed by the same blocks. */
/* How far ahead, in input pairs, a product through tiles requests the weights it will read from memory (int8: the
 * stored bytes of the chunk that far on, not the chunk expanded into L1). 64 (6 KB of bfloat16 ahead, into the next
 * panel near a panel's end): SmolLM2's decoder products from memory in a standalone harness (2 threads, Intel Xeon
 * family 6 model 207) took 0.88-0.91x the time of the hardware prefetcher alone, 8.6-8.9 ms for 212 MB at 1-16
 * rows, where a plain read of the same bytes took 9.9; int8 passes of 1, 8 and 16 tokens 0.83-0.89x
 * (`AB_WIDTHS=1,8,16 scripts/ab_native.py OLD.c NEW.c verify int8 200`) */
#ifndef AMX_AHEAD
#define AMX_AHEAD 64
#endif
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define AMX_BUILT 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
/* gcc's tile intrinsics are asm statements that name only the addresses they load from and store to, not the memory
 * there: without a barrier that hands the compiler those addresses, it dropped a buffer's stores before a load and
 * read the sums before the store (zero-padded tails came out as garbage at -O3). Each tile access below sits behind
 * one. */
#define TOUCHES(p) __asm__ volatile("" : : "r"(p) : "memory")
/* tiles 0 and 1: a slice's sums over columns 0-15 and 16-23; 2: its input pairs, 16 at a time; 3 and 4: the weights
 * of those 16 pairs, columns 0-15 and 16-23 */
AMX_TARGET static void amx_configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[2] = (uint8_t)rows, c.rows[3] = c.rows[4] = 16;
    c.colsb[0] = 64, c.colsb[1] = 32, c.colsb[2] = 64, c.colsb[3] = 64, c.colsb[4] = 32;
    TOUCHES(&c);
    _tile_loadconfig(&c);
}
AMX_TARGET static void amx_release(void) { _tile_release(); }
AMX_TARGET static void amx_zero_sums(void) { _tile_zero(0); _tile_zero(1); }
AMX_TARGET static void amx_store_sums(float *sums) { /* rows of PANEL floats, as the panel kernels write them */
    _tile_stored(0, sums, PANEL * 4);
    _tile_stored(1, sums + 16, PANEL * 4);
    TOUCHES(sums);
}
/* the configured rows of input pairs x (ldx words a row) against `units` (a multiple of 16) pairs of a panel's
 * weights w, added to the sums' tiles */
AMX_TARGET static void amx_blocks(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t units, int ahead) {
    TOUCHES(w);
    TOUCHES(x);
    for (int64_t i = 0; i < units; i += 16) {
        if (ahead) /* a block's 16 pairs of 24 columns: 1536 bytes, 24 lines */
            for (int line = 0; line < 24; line++)
                _mm_prefetch((const char *)(w + (i + AMX_AHEAD) * PANEL) + 64 * line, _MM_HINT_T0);
        _tile_loadd(2, x + i, ldx * 4);
        _tile_loadd(3, w + i * PANEL, PANEL * 4);
        _tile_loadd(4, w + i * PANEL + 16, PANEL * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
}
/* the last `units` (under 16) pairs as one block padded with zeros, for `rows` rows */
static void amx_tail(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t units, int64_t rows) {
    uint32_t wt[16 * PANEL] = {0}, xt[16 * 16] = {0};
    memcpy(wt, w, sizeof(uint32_t) * (size_t)(units * PANEL));
    for (int64_t r = 0; r < rows; r++) memcpy(xt + r * 16, x + r * ldx, sizeof(uint32_t) * (size_t)units);
    amx_blocks(wt, xt, 16, 16, 0);
}
/* units [0, count) of a panel (words of pairs, PANEL a unit) against rows x (ldx words a row); `ahead`: w is read
 * from memory, so request it ahead */
static void amx_units(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t count, int64_t rows, int ahead) {
    int64_t whole = count / 16 * 16;
    amx_blocks(w, x, ldx, whole, ahead);
    if (whole < count) amx_tail(w + whole * PANEL, x + whole, ldx, count - whole, rows);
}
static int amx_on = 0; /* set by native.py (dflash_set_amx) where the CPU, the OS and a measurement allow */
static int cpu_has_amx_int8(void) {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return d >> 25 & 1;
}
static int cpu_has_amx(void) {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!(d >> 22 & 1) || !(d >> 24 & 1)) return 0; /* AMX-BF16, AMX-TILE */
    /* Linux hands out the tile state only to a process that asks for it (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
/* Eight logits of a bfloat16 head as its AMX product stores them, rows ids[] of w (k inputs a row): the rows are
 * gathered into a panel of their own (columns 0-7, the rest zero) and summed by the same blocks, one input row */
static void chain_dot_amx8(const uint16_t *w, const int64_t *ids, const float *x, int64_t k, float *out) {
    static _Thread_local uint32_t *panel, *pairs;
    static _Thread_local int64_t size, zeroed_for = -1; /* the k whose padding the panel holds as zeros */
    int64_t units = (k + 7) / 8 * 4, padded = (units + 15) / 16 * 16, whole = k / 2;
    if (padded > size) {
        free(panel), free(pairs);
        panel = malloc(sizeof(uint32_t) * (size_t)(padded * PANEL)), pairs = malloc(sizeof(uint32_t) * (size_t)padded);
        size = panel && pairs ? padded : 0, zeroed_for = -1;
        if (!size) {
            for (int t = 0; t < 8; t++) out[t] = NAN;
            return;
        }
    }
    /* Columns 8-23 and the pairs past k are zeros that no call writes: cleared once per k, not per call (a 27 KB
     * memset and a scalar merge of every weight into its pair took a sixth of a 16-row screen) */
    if (zeroed_for != k) {
        memset(panel, 0, sizeof(uint32_t) * (size_t)(padded * PANEL));
        memset(pairs, 0, sizeof(uint32_t) * (size_t)padded);
        zeroed_for = k;
    }
    for (int64_t m = 0; m < whole; m++)
        pairs[m] = (uint32_t)f32_to_bf16(x[2 * m]) | (uint32_t)f32_to_bf16(x[2 * m + 1]) << 16;
    if (k & 1) pairs[whole] = f32_to_bf16(x[k - 1]);
    for (int t = 0; t < 8; t++) { /* a row's consecutive bfloat16 pairs are the panel's words, PANEL apart */
        const uint16_t *row = w + ids[t] * k;
        for (int64_t m = 0; m < whole; m++)
            panel[m * PANEL + t] = (uint32_t)row[2 * m] | (uint32_t)row[2 * m + 1] << 16;
        if (k & 1) panel[whole * PANEL + t] = row[k - 1];
    }
    float sums[PANEL];
    amx_configure(1);
    amx_zero_sums();
    amx_blocks(panel, pairs, padded, padded, 0);
    amx_store_sums(sums);
    amx_release();
    for (int t = 0; t < 8; t++) out[t] = bf16_to_f32(f32_to_bf16(sums[t]));
}
#else
#define AMX_BUILT 0
static const int amx_on = 0;
static int cpu_has_amx(void) { return 0; }
static int cpu_has_amx_int8(void) { return 0; }
static void amx_configure(int rows) { (void)rows; }
static void amx_release(void) {}
static void amx_zero_sums(void) {}
static void amx_store_sums(float *sums) { (void)sums; }
static void amx_units(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t count, int64_t rows, int ahead) {
    (void)w, (void)x, (void)ldx, (void)count, (void)rows, (void)ahead;
}
static void chain_dot_amx8(const uint16_t *w, const int64_t *ids, const float *x, int64_t k, float *out) {
    (void)w, (void)ids, (void)x, (void)k;
    for (int t = 0; t < 8; t++) out[t] = NAN;
}
#endif

/* Whether this build, CPU and OS run products in pairs through AMX tiles (dflash_set_amx turns them on) */
int dflash_amx(void) { return AMX_BUILT && cpu_has_pairs() && cpu_has_amx(); }
/* Whether the int8 screen of more than one row can run (dflash_screen_tiles) and runs (dflash_set_screen_tiles, which
 * returns the old setting) through tiles: TDPBSUD, bitwise the VNNI kernels' sums; set by native.py */
static int screen_tiles = 0;
int dflash_int8_vnni(void);
int dflash_screen_tiles(void) { return AMX_BUILT && dflash_int8_vnni() && cpu_has_amx() && cpu_has_amx_int8(); }
int dflash_set_screen_tiles(int on) {
    int old = screen_tiles;
    screen_tiles = on && dflash_screen_tiles();
    return old;
}
int dflash_set_amx(int on) {
    int old = amx_on;
#if AMX_BUILT
    amx_on = on && dflash_amx();
#else
    (void)on;
#endif
    return old;
}

/* A product's panels [first, last) in pairs through tiles, SLICE rows at a time. int8 weights (INT8_PAIRS) are
 * expanded to their bfloat16 pairs a chunk at a time, into `wide`. */
static void amx_panels(const Product *W, int64_t first, int64_t last, uint32_t *wide) {
    int64_t m = W->m, n = W->n, k2 = units_of(W), elem = unit_bytes(W);
    const uint32_t *x = (const uint32_t *)W->xf;
    float sums[SLICE * PANEL];
    int64_t configured = 0;
    for (int64_t p = first; p < last; p++) {
        const char *stored = (const char *)W->panels + p * PANEL * k2 * elem;
        int64_t cols = MIN(PANEL, n - PANEL * p);
        for (int64_t j0 = 0; j0 < m; j0 += SLICE) {
            int64_t rows = MIN(SLICE, m - j0);
            if (rows != configured) amx_configure((int)rows), configured = rows;
            amx_zero_sums();
            if (W->kind == INT8_PAIRS)
                for (int64_t c0 = 0; c0 < k2; c0 += PAIR_CHUNK) {
                    int64_t count = MIN(PAIR_CHUNK, k2 - c0);
                    for (int line = 0; line < PAIR_CHUNK * PANEL * 2 / 64; line++) /* a chunk AMX_AHEAD pairs on */
                        _mm_prefetch(stored + (c0 + AMX_AHEAD) * PANEL * elem + 64 * line, _MM_HINT_T0);
                    int8_expand(stored + c0 * PANEL * elem, count, wide);
                    amx_units(wide, x + j0 * k2 + c0, k2, count, rows, 0);
                }
            else
                amx_units((const uint32_t *)stored, x + j0 * k2, k2, k2, rows, 1);
            amx_store_sums(sums);
            for (int64_t r = 0; r < rows; r++)
                add_bias(W->yf + (j0 + r) * n + PANEL * p, sums + r * PANEL, W->bias ? W->bias + PANEL * p : NULL, cols,
                         W->round, W->scales ? W->scales + PANEL * p : NULL);
        }
    }
    if (configured) amx_release();
}

static void product_panels(void *ctx, int64_t first, int64_t last) {
    const Product *W = ctx;
    if (amx_on && in_pairs(W->kind)) {
        uint32_t *expanded = W->kind == INT8_PAIRS ? (uint32_t *)widening_buffer(PANEL * PAIR_CHUNK) : NULL;
        if (W->kind != INT8_PAIRS || expanded) { /* (out of memory: the pairs kernel, in the last bits apart) */
            amx_panels(W, first, last, expanded);
            return;
        }
    }
    int64_t m = W->m, n = W->n, k8 = units_of(W), size = PANEL * k8, elem = unit_bytes(W);
    /* NULL: widen (expand) in the kernel */
    int widens = (W->kind == 1 || W->kind == INT8_WIDENED) && m > 4;
    int expands = W->kind == INT8_PAIRS && m > INT8_INLINE_ROWS;
    float *wide = widens || expands ? widening_buffer(PANEL * MIN(CHUNK, k8)) : NULL;
    float sums[SLICE * PANEL];
    for (int64_t p = first; p < last; p++) {
        const char *stored = (const char *)W->panels + p * size * elem;
        /* a step or a narrow pass: two panels at a time, but in pairs: there one panel's stream ran 1-4 rows in
         * 0.90-0.96x the time (AMD EPYC Zen 4, 2 threads, thirty-third session: VDPBF16PS's 2 a cycle leave the
         * single stream's three chains time to spare, and two streams did not read faster) */
        if (p + 3 < last && four_panels_for(W)) { /* a step: four panels at a time, where that measured faster */
            four_panel_step(W, stored, p, sums);
            p += 3;
            continue;
        }
        if (!in_pairs(W->kind) && m <= two_panel_rows && p + 1 < last) {
            two_panel_slice(W, stored, p, sums);
            p++;
            continue;
        }
        int64_t cols = MIN(PANEL, n - PANEL * p);
        for (int64_t j0 = 0; j0 < m; j0 += SLICE) {
            int64_t rows = MIN(SLICE, m - j0);
            panel_slice(W, stored, W->xf + j0 * k8, rows, wide, sums);
            for (int64_t r = 0; r < rows; r++)
                add_bias(W->yf + (j0 + r) * n + PANEL * p, sums + r * PANEL, W->bias ? W->bias + PANEL * p : NULL, cols,
                         W->round, W->scales ? W->scales + PANEL * p : NULL);
        }
    }
}

#ifndef CHUNKS_PER_THREAD /* 2: quicker than 16 at 16 rows (fewer claims, longer streams), and beside a busy process */
#define CHUNKS_PER_THREAD 2
#endif
typedef struct {
    Product W;
    int threads;
} ProductCall;

/* task(ctx, first, last) over the panels of n output rows, CHUNKS_PER_THREAD chunks a thread */
static void over_panels(int64_t n, int threads, Task task, void *ctx) {
    int64_t panels = (n + PANEL - 1) / PANEL, grain = panels / (CHUNKS_PER_THREAD * MAX(threads, 1));
    parallel_for(panels, MAX(grain, 1), threads, task, ctx);
}

static void product_body(void *arg) {
    ProductCall *C = arg;
    over_panels(C->W.n, C->threads, product_panels, &C->W);
}

/* A thread's buffer for a product's input pairs (kept, grown as needed); NULL when out of memory. A layer's caller
 * reserves the most its products need before the layer runs, so that they cannot fail inside it. */
static float *pairs_buffer(int64_t words) {
    static _Thread_local float *kept;
    static _Thread_local int64_t kept_size;
    return kept_buffer(&kept, &kept_size, words);
}

/* The float32 rows xf [m, k8] (bfloat16 values) as pairs of bfloat16, k8 / 2 words a row; NULL when out of memory. */
static void bf16_array(const float *x, int64_t n, uint16_t *out);
static const float *as_pairs(const float *xf, int64_t m, int64_t k8) { /* (x [m, k8]: k8 a multiple of 8) */
    uint32_t *pairs = (uint32_t *)pairs_buffer(m * k8 / 2);
    if (!pairs) return NULL;
    /* pair i, bf16(x[2i]) | bf16(x[2i + 1]) << 16, is the i-th word of x as a little-endian bfloat16 array (the
     * scalar loop was 3.6% of a 16-token bfloat16 pass; eight at a time through store8, run on the first thread
     * while the other waited for the product, 1.3% of all threads' time) */
    bf16_array(xf, m * k8, (uint16_t *)pairs);
    return (const float *)pairs;
}

/* `kind` as in Product, or PAIRS_GIVEN / INT8_PAIRS_GIVEN: kind 2 / INT8_PAIRS with xf in pairs already (the
 * layer's producer wrote them: layer_pairs); nonzero when out of memory (nothing written) */
#define PAIRS_GIVEN 3
#define INT8_PAIRS_GIVEN 6
static int run(const void *tiles, int kind, const float *xf, const float *bias, float *yf, int64_t m, int64_t n,
               int64_t k8, int threads, int round) {
    if (kind == PAIRS_GIVEN) kind = 2;
    else if (kind == INT8_PAIRS_GIVEN) kind = INT8_PAIRS;
    else if (in_pairs(kind) && !(xf = as_pairs(xf, m, k8))) return 1;
    /* an int8 layout's scales follow its panels: (n / PANEL rounded up) panels of k8 bytes a column (k8 / 2 units of
     * 2 * PANEL bytes in pairs, k8 of PANEL widened); PANEL float32 scales a panel */
    int64_t panels = (n + PANEL - 1) / PANEL;
    const float *scales = int8_kind(kind) ? (const float *)((const char *)tiles + panels * PANEL * k8) : NULL;
    ProductCall C = {{tiles, kind, xf, bias, yf, m, n, k8, round, scales}, threads};
    with_workers(threads, product_body, &C); /* inside a layer's region already: runs there */
    return 0;
}

/* The input as float32 rows of k8 columns, zero-padded; NULL when out of memory. */
static float *padded_input(const void *x, int bf16, int64_t m, int64_t k, int64_t k8) {
    float *xf = malloc(sizeof(float) * (size_t)(m * k8));
    if (!xf) return NULL;
    for (int64_t j = 0; j < m; j++)
        for (int64_t i = 0; i < k8; i++)
            xf[j * k8 + i] = i >= k ? 0.0f : bf16 ? bf16_to_f32(((const uint16_t *)x)[j * k + i]) : ((const float *)x)[j * k + i];
    return xf;
}

/* y[m, n] = x[m, k] . W^T + bias, W given as tiles. Returns nonzero when out of memory (nothing written). */
int dflash_linear_f32(const float *tiles, const float *x, const float *bias, float *y, int64_t m, int64_t n, int64_t k,
                      int threads) {
    int64_t k8 = (k + 7) / 8 * 8;
    const float *xf = x;
    float *padded = NULL;
    if (k8 != k && !(xf = padded = padded_input(x, 0, m, k, k8))) return 1;
    run(tiles, 0, xf, bias, y, m, n, k8, threads, 0);
    free(padded);
    return 0;
}

/* bfloat16 input, tiles, bias and output; float32 sums. `layout`: the tiles' (0 bfloat16, 1 bfloat16 in pairs, 2 int8
 * in pairs, 3 int8 widened). `float_out`: y is float32, the outputs rounded to bfloat16 values as they land (an LM
 * head's logits, which its caller wants in float32: the sums were stored, converted to bfloat16 on one thread, and
 * converted back, 786k values twice for a 16-row SmolLM2 head). */
int dflash_linear_bf16(const uint16_t *tiles, const uint16_t *x, const uint16_t *bias, void *y, int64_t m, int64_t n,
                       int64_t k, int threads, int layout, int float_out) {
    /* the float32 sums (an LM head's: 196 KB a row for SmolLM2) in a buffer kept per thread: a fresh allocation of
     * that size is a new mapping, page-faulted on every call */
    static _Thread_local float *kept;
    static _Thread_local int64_t kept_size;
    int64_t k8 = (k + 7) / 8 * 8;
    float *xf = padded_input(x, 1, m, k, k8), *buffer = kept_buffer(&kept, &kept_size, (float_out ? 0 : m * n) + n);
    float *yf = float_out ? (float *)y : buffer, *bf = bias && buffer ? buffer + (float_out ? 0 : m * n) : NULL;
    for (int64_t i = 0; bf && i < n; i++) bf[i] = bf16_to_f32(bias[i]);
    static const int kinds[4] = {1, 2, INT8_PAIRS, INT8_WIDENED};
    int failed = !xf || !buffer || layout < 0 || layout > 3 ||
                 run(tiles, kinds[layout], xf, bf, yf, m, n, k8, threads, float_out);
    free(xf);
    if (failed) return 1;
    if (float_out) return 0;
    int64_t i = 0;
    for (; i + 8 <= m * n; i += 8) store8(y, i, _mm256_loadu_ps(yf + i), 1); /* a 16-row LM head: 786k values */
    for (; i < m * n; i++) ((uint16_t *)y)[i] = f32_to_bf16(yf[i]);
    return 0;
}

/* ---- greedy tokens without reading the whole float32 LM head ----------------------------------------------------
 * A greedy round needs only each row's argmax, and the float32 head of a small model is a fifth of a step's bytes
 * (SmolLM2: 113 of 540 MB). So the logits go through a smaller copy of the head first, a screen, and each approximate
 * logit a_i comes with a bound b_i on its distance from the float32 logit e_i. A token with a_i + b_i below
 * max_j (a_j - b_j) cannot be the argmax, so only the rest (a handful) are summed in float32, each as the ONE chain of
 * FMAs in input order that the panel kernel sums for it: the winner, the first of the largest as torch's argmax picks
 * it, is bitwise the float32 head's. With u = 2^-24 and gamma = k u / (1 - k u) (the rounding of a chain of k FMAs):
 *   bfloat16 screen (tiles of bf16(w), rounded to nearest: |w - bf16(w)| <= 2^-8 |w|):
 *     |e_i - a_i| <= (2^-8 + 2 gamma (1 + 2^-8)) sum_j |x_j w_ij| <= norm_factor |x|_2 |w_i|_2   (Cauchy-Schwarz)
 *   int8 screen (q_ij = round(w_ij / s_i), |q| <= 127, a_i = s_i * sum_j x_j q_ij):
 *     |e_i - a_i| <= gamma |x|_2 |w_i|_2 + s_i |x|_1 (1/2 + 127 (gamma + u) + a little for w / s's rounding)
 *                  = norm_factor |x|_2 |w_i|_2 + l1_factor s_i |x|_1
 * (screening.py computes both factors, with room for computing the bound itself in double precision). */
/* Eight logits of the head, rows ids[] of w, each as the float32 kernel sums it: one chain of FMAs in input order
 * (bf16 = 1: over the widened bfloat16 weights, the sum rounded to bfloat16, as a bfloat16 head's kernel stores it).
 * One chain of k FMAs waits on their latency (~4 cycles each); eight side by side keep the FMA units busy, each
 * still its own chain. The screen's survivors go through here, eight at a time. */
static void chain_dots8(const void *w, int bf16, const int64_t *ids, const float *x, int64_t k, float *out) {
    float acc[8] = {0};
    if (bf16) {
        const uint16_t *r[8];
        for (int t = 0; t < 8; t++) r[t] = (const uint16_t *)w + ids[t] * k;
        for (int64_t j = 0; j < k; j++)
            for (int t = 0; t < 8; t++) acc[t] = fmaf(bf16_to_f32(r[t][j]), x[j], acc[t]);
        for (int t = 0; t < 8; t++) out[t] = bf16_to_f32(f32_to_bf16(acc[t]));
    } else {
        const float *r[8];
        for (int t = 0; t < 8; t++) r[t] = (const float *)w + ids[t] * k;
        for (int64_t j = 0; j < k; j++)
            for (int t = 0; t < 8; t++) acc[t] = fmaf(r[t][j], x[j], acc[t]);
        for (int t = 0; t < 8; t++) out[t] = acc[t];
    }
}


/* out[r, i] = scale_i * sum_j x[r, j] q[i, j] over int8 panels (laid out as float tiles are). A step's row runs
 * through an int8 target's step kernels (four panels at a time, then two). More rows run up to four against a panel
 * together, each input's 24 weights widened once for all of them (twelve chains at four rows, as panel_rows); one
 * row alternates its inputs between two sets of three accumulators instead (six chains). These kernels of its own
 * measured faster than the product's panel_rows here: 8-16 rows took 0.84-0.90x the time (scripts/ab_screen.py,
 * AMD EPYC Zen 3). The order of a screen's sums is free: its bound holds for any. */
typedef struct {
    const int8_t *tiles;
    const float *scales, *xf;
    float *out;
    int64_t m, n, k8;
} Int8Screen;

static inline __attribute__((always_inline)) void int8_rows(const int8_t *w, const float *x, int64_t ldx, int64_t k8,
                                                            const int R, float *out) {
    const int resume = 0;
    if (R == 1) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, b0 = a0, b1 = a0, b2 = a0;
        for (int64_t i = 0; i < k8; i += 2) { /* k8 is a multiple of 8 */
            __m256 u = _mm256_broadcast_ss(x + i), v = _mm256_broadcast_ss(x + i + 1);
            const int8_t *at = w + i * PANEL;
            a0 = _mm256_fmadd_ps(widen_int8(at), u, a0), a1 = _mm256_fmadd_ps(widen_int8(at + 8), u, a1);
            a2 = _mm256_fmadd_ps(widen_int8(at + 16), u, a2);
            b0 = _mm256_fmadd_ps(widen_int8(at + PANEL), v, b0);
            b1 = _mm256_fmadd_ps(widen_int8(at + PANEL + 8), v, b1);
            b2 = _mm256_fmadd_ps(widen_int8(at + PANEL + 16), v, b2);
        }
        _mm256_storeu_ps(out, _mm256_add_ps(a0, b0)), _mm256_storeu_ps(out + 8, _mm256_add_ps(a1, b1));
        _mm256_storeu_ps(out + 16, _mm256_add_ps(a2, b2));
        return;
    }
    ACC_ZERO(0) ACC_ZERO(1) ACC_ZERO(2) ACC_ZERO(3)
    ACC_LOAD(0) ACC_LOAD(1) ACC_LOAD(2) ACC_LOAD(3)
    for (int64_t i = 0; i < k8; i++) {
        const int8_t *at = w + i * PANEL;
        __m256 w0 = widen_int8(at), w1 = widen_int8(at + 8), w2 = widen_int8(at + 16);
        ACC_FMA(0) ACC_FMA(1) ACC_FMA(2) ACC_FMA(3)
    }
    ACC_STORE(0) ACC_STORE(1) ACC_STORE(2) ACC_STORE(3)
}
#define INT8_ROWS(NAME, R)                                                                                           \
    static void NAME(const int8_t *w, const float *x, int64_t ldx, int64_t k8, float *out) {                         \
        int8_rows(w, x, ldx, k8, R, out);                                                                             \
    }
INT8_ROWS(int8_rows_1, 1)
INT8_ROWS(int8_rows_2, 2)
INT8_ROWS(int8_rows_3, 3)
INT8_ROWS(int8_rows_4, 4)
typedef void (*Int8Rows)(const int8_t *w, const float *x, int64_t ldx, int64_t k8, float *out);
static const Int8Rows int8_row_kernels[4] = {int8_rows_1, int8_rows_2, int8_rows_3, int8_rows_4};

static void int8_screen_panels(void *ctx, int64_t first, int64_t last) {
    const Int8Screen *S = ctx;
    float sums[4 * PANEL];
    for (int64_t p = first; p < last; p++) {
        const int8_t *w = S->tiles + p * S->k8 * PANEL;
        int64_t cols = MIN(PANEL, S->n - PANEL * p);
        if (S->m == 1 && p + 3 < last) { /* a step: four panels, four streams (as a step's int8 products run) */
            int64_t all = MIN(4 * PANEL, S->n - PANEL * p);
            four_panels_int8(w, S->k8 * PANEL, S->xf, S->k8, sums);
            for (int64_t c = 0; c < all; c++) S->out[PANEL * p + c] = S->scales[PANEL * p + c] * sums[c];
            p += 3;
            continue;
        }
        if (S->m == 1 && p + 1 < last) { /* two panels, two streams */
            int64_t both = MIN(2 * PANEL, S->n - PANEL * p);
            two_panels_int8_1(w, S->k8 * PANEL, S->xf, S->k8, S->k8, sums, 0);
            for (int64_t c = 0; c < both; c++) S->out[PANEL * p + c] = S->scales[PANEL * p + c] * sums[c];
            p++;
            continue;
        }
        for (int64_t r0 = 0; r0 < S->m; r0 += 4) {
            int64_t rows = MIN(4, S->m - r0);
            int8_row_kernels[rows - 1](w, S->xf + r0 * S->k8, S->k8, S->k8, sums);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < cols; c++)
                    S->out[(r0 + r) * S->n + PANEL * p + c] = S->scales[PANEL * p + c] * sums[r * PANEL + c];
        }
    }
}

typedef struct {
    Int8Screen S;
    int threads;
} Int8ScreenCall;

static void int8_screen_body(void *arg) {
    Int8ScreenCall *C = arg;
    over_panels(C->S.n, C->threads, int8_screen_panels, &C->S);
}

/* ---- the int8 screen in integers (AVX512-VNNI) --------------------------------------------------------------------
 * The kernel above widens every int8 weight to float32 for an FMA: at 8-16 rows the screen is bound by those
 * conversions and FMAs (SmolLM2's 16-row screen took 5.2 ms on 2 Zen 4 cores, ~12 multiply-adds a cycle a core).
 * Where the CPU has AVX512-VNNI, each row of x is rounded to integers instead, x_j ~ sx n_j, and the sums are exact
 * integers, a_i = s_i sx sum_j q_ij n_j. Rounding x costs the bound one more term:
 *   |e_i - a_i| <= l1_factor s_i |x|_1 + c_i (d + 4u max|x|),   c_i = s_i |q_i|_1,  d = max_j |x_j - sx n_j|
 * The first term is the int8 screen's own (it covers the float32 head's chain too: gamma sum_j |w_ij x_j| <=
 * 127 gamma s_i |x|_1); the second, sum_j s_i q_ij (x_j - sx n_j), plus 4u for the sum, s_i sx and their product
 * rounded to float32 (sx |n_j| <= max|x| + d, d <= max|x| / 254). Exact integer sums need no norm term: c_i takes
 * row_norms' place in the screen's bound.
 * VPDPBUSD adds four byte products to each of sixteen int32 lanes (64 products an instruction; the twentieth
 * session's kernel, inputs in int16 through VPDPWSSD, added 32 and widened each weight first). One scale for a whole
 * row of x in bytes let ~39,000 of 49,152 tokens through: real hidden states have a few channels ~16-60x their mean.
 * So each n_j is split into a low byte and a high one, n_j = lo_j + 256 hi_j, in one of two ways:
 *   wide (many rows, where the sums bound the time): sx = the (QUAD_WIDE+1)-th largest |x_j| / 127 (or max|x| /
 *     N_MAX where that is larger), so hi_j is zero but for the QUAD_WIDE largest channels, whose high bytes a row
 *     sums as a short list of quads. On SmolLM2 states (685 rows of GSM8K and MT-Bench answers) 8 wide channels
 *     left a median of 8 survivors (mean 18) against 3 (5) dense: more float32 sums, half the work;
 *   dense (few rows, where reading the head bounds the time): sx = max|x| / N_MAX, N_MAX = 2^31 / (127 k) at most,
 *     every channel's high byte summed as a second stream of the same weights (the int16 kernel's sums, bitwise).
 * VPDPBUSD multiplies unsigned bytes by signed ones, so the weights are stored as q + 128 (1..255) and each row takes
 * 128 sum_j n_j back: acc_lo + 256 acc_hi - 128 sum n = sum_j q_ij n_j, exact modulo 2^32 on the way and exact at
 * the end, as 127 N_MAX k < 2^31. Layout (native.py, vnni_tiles): groups of 16 tokens, each stored four inputs at a
 * time, [groups, k4 / 4, 16, 4] uint8, k4 = k rounded up to a multiple of 4. */
#define VNNI_GROUP 16
#if defined(__x86_64__) && (defined(__clang__) ? __clang_major__ >= 9 : __GNUC__ >= 9)
#define VNNI_BUILT 1
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
static int cpu_has_vnni(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw");
}
#else
#define VNNI_BUILT 0
static int cpu_has_vnni(void) { return 0; }
#endif

/* Whether this build and CPU run the int8 screen in integers (native.py lays its weights out for it then). */
int dflash_int8_vnni(void) { return VNNI_BUILT && cpu_has_vnni(); }

#define QUAD_WIDE 8
#if VNNI_BUILT

typedef struct {
    const uint8_t *tiles;
    const float *scales;
    const int32_t *lo, *hi;    /* [m, quads]: four low (high) bytes a word; hi NULL where wide */
    const int32_t *wide;       /* [m, QUAD_WIDE]: four high bytes a word, those of quad wide_at */
    const int32_t *wide_at;    /* [m, QUAD_WIDE] */
    const int32_t *wide_count; /* [m] */
    const int32_t *offset;     /* [m]: 128 sum_j n_j, modulo 2^32 */
    const float *sx;           /* [m] */
    float *out;                /* [m, n] */
    int64_t m, n, quads;
} QuadScreen;

/* Rows r0..r0+R-1 against one group: low bytes into a_r and, where DENSE, high bytes into h_r, each quad's weights
 * loaded once for all. Each block of rows requests its share of the NEXT group's weights (`ahead`, every `stride`
 * bytes: 64 / the number of blocks), so that a group's lines are requested a whole group's work before they are
 * read and evenly over its blocks: at 8-16 rows the screen reads a head evicted by the pass near the memory's
 * rate (requests 512 bytes ahead, as the int16 kernel made them, left 16 rows 1.2-1.35x as long). Blocks of fewer
 * rows consume the weights faster than such requests help: the hardware's prefetcher alone made 4-6 rows 0.79-0.91x
 * as long (AMD EPYC Zen 4, 2 threads, after a 96 MB write). */
#define QUAD_CHAIN(r)                                                                                                 \
    if (r < R) {                                                                                                      \
        __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a##r) : "v"(w0), "m"(lo[r * quads + p]));                      \
        if (DENSE) __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(h##r) : "v"(w0), "m"(hi[r * quads + p]));           \
    }
VNNI_TARGET static inline __attribute__((always_inline)) void quad_block(const uint8_t *w, const int32_t *lo,
                                                                         const int32_t *hi, int64_t quads,
                                                                         const int R, const int DENSE, __m512i *acc,
                                                                         __m512i *high, const uint8_t *ahead,
                                                                         int64_t stride) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m512i h0 = a0, h1 = a0, h2 = a0, h3 = a0, h4 = a0, h5 = a0, h6 = a0, h7 = a0;
    for (int64_t p = 0; p < quads; p++) {
        if (R >= 7) _mm_prefetch((const char *)(ahead + p * stride), _MM_HINT_T0);
        __m512i w0 = _mm512_loadu_si512((const void *)(w + p * 64));
        QUAD_CHAIN(0) QUAD_CHAIN(1) QUAD_CHAIN(2) QUAD_CHAIN(3) QUAD_CHAIN(4) QUAD_CHAIN(5) QUAD_CHAIN(6)
        QUAD_CHAIN(7)
    }
    acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3, acc[4] = a4, acc[5] = a5, acc[6] = a6, acc[7] = a7;
    high[0] = h0, high[1] = h1, high[2] = h2, high[3] = h3, high[4] = h4, high[5] = h5, high[6] = h6, high[7] = h7;
}
#undef QUAD_CHAIN

/* Rows r0..r0+R-1's high bytes (256 each: shifted by 8; where wide, summed here from each row's list of quads),
 * their offsets taken back, and a_i = (float)acc * (sx s_i) stored for the group */
VNNI_TARGET static inline __attribute__((always_inline)) void quad_store(const QuadScreen *S, const uint8_t *w,
                                                                         int64_t group, int64_t r0, const int R,
                                                                         const __m512i *acc, __m512i *high) {
    int64_t i0 = group * VNNI_GROUP, valid = MIN(VNNI_GROUP, S->n - i0);
    __mmask16 lanes = (__mmask16)((1u << valid) - 1);
    __m512 scales = _mm512_maskz_loadu_ps(lanes, S->scales + i0);
    if (!S->hi) { /* the rows' lists side by side: R chains, where one row's list after another waited on each sum */
        int longest = 0;
        for (int r = 0; r < R; r++) longest = MAX(longest, S->wide_count[r0 + r]);
        for (int e = 0; e < longest; e++)
            for (int r = 0; r < R; r++) {
                int64_t at = (r0 + r) * QUAD_WIDE + e;
                if (e < S->wide_count[r0 + r])
                    high[r] = _mm512_dpbusd_epi32(high[r], _mm512_loadu_si512((const void *)(w + S->wide_at[at] * 64)),
                                                  _mm512_set1_epi32(S->wide[at]));
            }
    }
    for (int r = 0; r < R; r++) {
        int64_t row = r0 + r;
        __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(acc[r], _mm512_slli_epi32(high[r], 8)),
                                       _mm512_set1_epi32(S->offset[row]));
        __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(_mm512_set1_ps(S->sx[row]), scales));
        _mm512_mask_storeu_ps(S->out + row * S->n + i0, lanes, a);
    }
}

#define QUAD_ROWS(NAME, R, DENSE)                                                                                     \
    VNNI_TARGET static void NAME(const QuadScreen *S, int64_t group, int64_t r0, int64_t block, int64_t blocks) {    \
        __m512i acc[8], high[8];                                                                                      \
        int64_t size = S->quads * 4 * VNNI_GROUP, stride = 64 / blocks;                                               \
        const uint8_t *w = S->tiles + group * size;                                                                   \
        quad_block(w, S->lo + r0 * S->quads, DENSE ? S->hi + r0 * S->quads : NULL, S->quads, R, DENSE, acc, high,     \
                   w + size + block * S->quads * stride, stride);                                                     \
        quad_store(S, w, group, r0, R, acc, high);                                                                    \
    }
QUAD_ROWS(quad_1, 1, 0) QUAD_ROWS(quad_2, 2, 0) QUAD_ROWS(quad_3, 3, 0) QUAD_ROWS(quad_4, 4, 0)
QUAD_ROWS(quad_5, 5, 0) QUAD_ROWS(quad_6, 6, 0) QUAD_ROWS(quad_7, 7, 0) QUAD_ROWS(quad_8, 8, 0)
QUAD_ROWS(dense_1, 1, 1) QUAD_ROWS(dense_2, 2, 1) QUAD_ROWS(dense_3, 3, 1) QUAD_ROWS(dense_4, 4, 1)
QUAD_ROWS(dense_5, 5, 1) QUAD_ROWS(dense_6, 6, 1) QUAD_ROWS(dense_7, 7, 1) QUAD_ROWS(dense_8, 8, 1)
#undef QUAD_ROWS
typedef void (*QuadRows)(const QuadScreen *S, int64_t group, int64_t r0, int64_t block, int64_t blocks);
static const QuadRows quad_kernels[2][8] = {
    {quad_1, quad_2, quad_3, quad_4, quad_5, quad_6, quad_7, quad_8},
    {dense_1, dense_2, dense_3, dense_4, dense_5, dense_6, dense_7, dense_8}};

/* A single row: four chains over alternate quads (low bytes, and where dense the high ones in two more): one
 * chain waits on its latency */
#define ONE_QUAD(a, from, q)                                                                                          \
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(a) : "v"(_mm512_loadu_si512((const void *)(w + (q) * 64))),      \
            "m"(from[q]));
VNNI_TARGET static void quad_one_row(const QuadScreen *S, int64_t group) {
    const uint8_t *w = S->tiles + group * S->quads * 4 * VNNI_GROUP;
    const int32_t *lo = S->lo, *hi = S->hi;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, h0 = a0, h1 = a0;
    int64_t p = 0;
    if (hi) {
        for (; p + 2 <= S->quads; p += 2) { ONE_QUAD(a0, lo, p) ONE_QUAD(h0, hi, p) ONE_QUAD(a1, lo, p + 1) ONE_QUAD(h1, hi, p + 1) }
        for (; p < S->quads; p++) { ONE_QUAD(a0, lo, p) ONE_QUAD(h0, hi, p) }
    } else {
        for (; p + 4 <= S->quads; p += 4) { ONE_QUAD(a0, lo, p) ONE_QUAD(a1, lo, p + 1) ONE_QUAD(a2, lo, p + 2) ONE_QUAD(a3, lo, p + 3) }
        for (; p < S->quads; p++) { ONE_QUAD(a0, lo, p) }
    }
    __m512i acc[1] = {_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3))};
    __m512i high[1] = {_mm512_add_epi32(h0, h1)};
    quad_store(S, w, group, 0, 1, acc, high);
}
#undef ONE_QUAD

/* ---- the int8 screen through AMX tiles (AMX-INT8), where it runs
 * The screen's layout is already what TDPBSUD reads: for 16 quads, a group's weights are a tile of 16 rows (quads) of
 * 64 bytes (16 tokens x 4 unsigned bytes), and 16 quads of a row's signed low (high) bytes are a row of the inputs'
 * tile. TDPBSUD adds the same byte products as VPDPBUSD into int32 sums, which are exact modulo 2^32 in any order: the
 * sums, and so the screen's logits, are bitwise those of the kernels above. A group's quads past the last whole 16
 * are added by VPDPBUSD. Rows run 16 at a time (tiles 0, 1: low and high sums; 2, 3: low and high bytes; 4:
 * weights). */
#if AMX_BUILT
#define AMX_INT8_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,amx-tile,amx-int8")))
AMX_INT8_TARGET static void quad_tiles_configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 4; t++) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    c.rows[4] = 16, c.colsb[4] = 64;
    TOUCHES(&c);
    _tile_loadconfig(&c);
}
/* rows r0..r0 + rows - 1 (at most 16, as configured) against one group */
AMX_INT8_TARGET static void quad_group_tiles(const QuadScreen *S, int64_t group, int64_t r0, int64_t rows) {
    int64_t quads = S->quads, whole = quads / 16 * 16, size = quads * 4 * VNNI_GROUP;
    const uint8_t *w = S->tiles + group * size;
    const int32_t *lo = S->lo + r0 * quads, *hi = S->hi ? S->hi + r0 * quads : NULL;
    int32_t sums[2][16 * 16];
    TOUCHES(w);
    TOUCHES(lo);
    TOUCHES(hi);
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t p = 0; p < whole; p += 16) {
        for (int line = 0; line < 16; line++) /* the next group's lines, as this one's are read */
            _mm_prefetch((const char *)(w + size + (p + line) * 64), _MM_HINT_T0);
        _tile_loadd(4, w + p * 64, 64);
        _tile_loadd(2, lo + p, quads * 4);
        _tile_dpbsud(0, 2, 4);
        if (hi) {
            _tile_loadd(3, hi + p, quads * 4);
            _tile_dpbsud(1, 3, 4);
        }
    }
    _tile_stored(0, sums[0], 64);
    _tile_stored(1, sums[1], 64);
    TOUCHES(sums);
    __m512i acc[16], high[16];
    for (int64_t r = 0; r < rows; r++) {
        acc[r] = _mm512_loadu_si512((const void *)(sums[0] + r * 16));
        high[r] = _mm512_loadu_si512((const void *)(sums[1] + r * 16));
        for (int64_t p = whole; p < quads; p++) {
            __m512i wp = _mm512_loadu_si512((const void *)(w + p * 64));
            acc[r] = _mm512_dpbusd_epi32(acc[r], wp, _mm512_set1_epi32(lo[r * quads + p]));
            if (hi) high[r] = _mm512_dpbusd_epi32(high[r], wp, _mm512_set1_epi32(hi[r * quads + p]));
        }
    }
    quad_store(S, w, group, r0, (int)rows, acc, high);
}
AMX_INT8_TARGET static void quad_groups_tiles(const QuadScreen *S, int64_t first, int64_t last) {
    int configured = 0;
    for (int64_t g = first; g < last; g++)
        for (int64_t r0 = 0; r0 < S->m; r0 += 16) {
            int rows = (int)MIN(16, S->m - r0);
            if (rows != configured) quad_tiles_configure(rows), configured = rows;
            quad_group_tiles(S, g, r0, rows);
        }
    if (configured) _tile_release();
}
#else
static void quad_groups_tiles(const QuadScreen *S, int64_t first, int64_t last) { (void)S, (void)first, (void)last; }
#endif
static void quad_screen_groups(void *ctx, int64_t first, int64_t last) {
    const QuadScreen *S = ctx;
    int64_t g = first;
    if (S->m > 1 && screen_tiles) {
        quad_groups_tiles(S, first, last);
        return;
    }
    if (S->m == 1) {
        for (; g < last; g++) quad_one_row(S, g);
        return;
    }
    /* blocks of rows as even as can be (9 rows: 4 and 5, not 8 and a latency-bound 1); a group's weights (9 KB for
     * SmolLM2) stay in L1 across them */
    int64_t blocks = (S->m + 7) / 8;
    for (; g < last; g++)
        for (int64_t b = 0, r0 = 0; b < blocks; b++) {
            int64_t rows = (S->m - r0) / (blocks - b);
            quad_kernels[S->hi != NULL][rows - 1](S, g, r0, b, blocks);
            r0 += rows;
        }
}

typedef struct {
    QuadScreen S;
    int threads;
} QuadScreenCall;

static void quad_screen_body(void *arg) {
    QuadScreenCall *C = arg;
    int64_t groups = (C->S.n + VNNI_GROUP - 1) / VNNI_GROUP;
    int64_t grain = groups / (CHUNKS_PER_THREAD * MAX(C->threads, 1));
    parallel_for(groups, MAX(grain, 8), C->threads, quad_screen_groups, &C->S);
}
#endif

/* Row r of x [m, k] as bytes for the screen above, wide or dense (hi non-NULL): lo[r] ([quads] words of four low
 * bytes, zero-padded), the high bytes (dense: hi[r] likewise; wide: the wide channels' by quad), offset[r] and
 * sx[r]; spread[r] = d + 4u max|x| (NaN where the row is not finite). d is measured, |x_j - sx n_j| as one rounding
 * of an FMS, so it holds however n was rounded. Sixteen channels at a time (scalar, it took 3.5 us a row: 2.5% of a
 * 16-row screen). */
#if VNNI_BUILT
/* The channel's magnitude `size` among a row's QUAD_WIDE + 1 largest (top[], largest first) */
static inline void keep_largest(float *top, float size) {
    int at = QUAD_WIDE;
    for (; at > 0 && top[at - 1] < size; at--) top[at] = top[at - 1];
    top[at] = size;
}

/* Channel j's high byte into its row's list of wide quads; 0 when the list is full (then the row is undecided) */
static inline int add_wide(int32_t *w, int32_t *at, int32_t *count, int64_t j, int32_t high) {
    int e = 0;
    while (e < *count && at[e] != j / 4) e++;
    if (e == *count) {
        if (*count == QUAD_WIDE) return 0; /* cannot happen with the wide scale (quad_inputs) */
        at[*count] = (int32_t)(j / 4), w[(*count)++] = 0;
    }
    w[e] = (int32_t)((uint32_t)w[e] | (uint32_t)(uint8_t)(int8_t)high << (8 * (j % 4)));
    return 1;
}

VNNI_TARGET static void quad_inputs(const float *x, int64_t m, int64_t k, int64_t quads, int32_t *lo_words,
                                    int32_t *hi_words, int32_t *wide, int32_t *wide_at, int32_t *wide_count,
                                    int32_t *offset, float *sx, double *spread) {
    const float limit = (float)MIN(32767 - 128, INT32_MAX / (127 * 4 * quads));
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * k;
        float top[QUAD_WIDE + 1] = {0}; /* wide: the QUAD_WIDE + 1 largest magnitudes, largest first */
        __m512 most = _mm512_setzero_ps();
        __mmask16 odd = 0; /* NaN or inf */
        for (int64_t j = 0; j < k; j += 16) {
            __m512 size = _mm512_abs_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << MIN(16, k - j)) - 1), xr + j));
            odd |= _mm512_cmp_ps_mask(size, size, _CMP_UNORD_Q) |
                   _mm512_cmp_ps_mask(size, _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
            most = _mm512_max_ps(size, most);
            if (hi_words) continue;
            float lanes[16];
            _mm512_storeu_ps(lanes, size);
            for (__mmask16 above = _mm512_cmp_ps_mask(size, _mm512_set1_ps(top[QUAD_WIDE]), _CMP_GT_OQ); above;
                 above &= above - 1) {
                float v = lanes[__builtin_ctz(above)];
                if (v > top[QUAD_WIDE]) keep_largest(top, v);
            }
        }
        float largest = _mm512_reduce_max_ps(most);
        /* wide: a hair over a byte's scale, so that only the QUAD_WIDE channels above top[QUAD_WIDE] round past 127;
         * dense: the old int16 kernel's scale and rounding (its sums, bitwise) */
        float s = hi_words ? largest / limit : fmaxf(top[QUAD_WIDE] / 127.0f * (1.0f + 0x1p-10f), largest / limit);
        int unusable = odd || !(s > 0.0f);
        float inv = unusable ? 0.0f : hi_words ? limit / largest : 1.0f / s;
        if (unusable) s = 1.0f;
        int8_t *lo = (int8_t *)(lo_words + r * quads), *hi = hi_words ? (int8_t *)(hi_words + r * quads) : NULL;
        int32_t *w = wide + r * QUAD_WIDE, *at = wide_at + r * QUAD_WIDE, count = 0, fits = 1;
        __m512 deviation = _mm512_setzero_ps();
        __m512i total = _mm512_setzero_si512();
        for (int64_t j = 0; j < k; j += 16) {
            __mmask16 lanes = (__mmask16)((1u << MIN(16, k - j)) - 1);
            __m512 v = _mm512_maskz_loadu_ps(lanes, xr + j);
            __m512 nf = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            nf = _mm512_min_ps(_mm512_max_ps(nf, _mm512_set1_ps(-limit)), _mm512_set1_ps(limit));
            __m512i n = _mm512_cvtps_epi32(nf);
            __m512i low = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(n, _mm512_set1_epi32(128)),
                                                            _mm512_set1_epi32(255)),
                                           _mm512_set1_epi32(128));
            __m512i high = _mm512_srai_epi32(_mm512_sub_epi32(n, low), 8); /* exact: n - low is a multiple of 256 */
            _mm512_mask_cvtepi32_storeu_epi8(lo + j, lanes, low);
            total = _mm512_add_epi32(total, n); /* |sum n| <= k N_MAX < 2^31 / 127 */
            deviation = _mm512_max_ps(_mm512_abs_ps(_mm512_fmsub_ps(_mm512_set1_ps(s), nf, v)), deviation);
            if (hi) {
                _mm512_mask_cvtepi32_storeu_epi8(hi + j, lanes, high);
                continue;
            }
            __mmask16 wide_lanes = _mm512_test_epi32_mask(high, high);
            if (!wide_lanes) continue;
            int32_t highs[16];
            _mm512_storeu_si512((void *)highs, high);
            for (; wide_lanes; wide_lanes &= wide_lanes - 1) {
                int lane = __builtin_ctz(wide_lanes);
                fits &= add_wide(w, at, &count, j + lane, highs[lane]);
            }
        }
        for (int64_t j = k; j < 4 * quads; j++) {
            lo[j] = 0;
            if (hi) hi[j] = 0;
        }
        wide_count[r] = count;
        offset[r] = (int32_t)((uint32_t)_mm512_reduce_add_epi32(total) * 128u);
        sx[r] = s;
        double d = _mm512_reduce_max_ps(deviation) * (1 + 0x1p-20);
        spread[r] = unusable || !fits ? NAN : (d + 4 * 0x1p-24 * (double)largest) * (1 + 1e-6);
    }
}
#endif

/* The integer screen's approximate logits out [m, n] of x [m, k] and each row's rounding term spread [m], its
 * inputs wide (wide = 1) or dense (0); also a drafter's int8 LM head (dense). Returns nonzero when out of memory. */
int dflash_int8_quad_logits(const void *tiles, const float *scales, const float *x, int64_t m, int64_t n, int64_t k,
                            int threads, float *out, double *spread, int wide) {
    int64_t quads = (k + 3) / 4;
    int32_t *words = malloc(sizeof(int32_t) * m * (2 * quads + 2 * QUAD_WIDE + 2));
    float *sx = malloc(sizeof(float) * m);
    if (!words || !sx) {
        free(words), free(sx);
        return 1;
    }
    int32_t *lo = words, *hi = wide ? NULL : lo + m * quads, *more = lo + 2 * m * quads;
    int32_t *wide_words = more, *wide_at = more + m * QUAD_WIDE, *wide_count = wide_at + m * QUAD_WIDE;
    int32_t *offset = wide_count + m;
#if VNNI_BUILT
    quad_inputs(x, m, k, quads, lo, hi, wide_words, wide_at, wide_count, offset, sx, spread);
    QuadScreenCall C = {{tiles, scales, lo, hi, wide_words, wide_at, wide_count, offset, sx, out, m, n, quads}, threads};
    with_workers(threads, quad_screen_body, &C);
#else
    (void)tiles, (void)scales, (void)x, (void)n, (void)threads, (void)out, (void)lo, (void)hi, (void)offset,
        (void)wide_words, (void)wide_at;
    for (int64_t r = 0; r < m; r++) spread[r] = NAN;
#endif
    free(words), free(sx);
    return 0;
}

/* a_i +- b_i for tokens i0..i0+3 (sign +1 or -1), b_i = by_norm |w_i| + by_scale s_i, in double precision. */
static inline __m256d screen_reach(const float *a, const double *row_norms, const float *scales, double by_norm,
                                   double by_scale, int64_t i0, double sign) {
    __m256d bound = _mm256_mul_pd(_mm256_set1_pd(by_norm), _mm256_loadu_pd(row_norms + i0));
    if (scales) bound = _mm256_fmadd_pd(_mm256_set1_pd(by_scale), _mm256_cvtps_pd(_mm_loadu_ps(scales + i0)), bound);
    return _mm256_fmadd_pd(_mm256_set1_pd(sign), bound, _mm256_cvtps_pd(_mm_loadu_ps(a + i0)));
}

/* max_i (a_i - b_i): the least the largest logit can be. maxpd keeps the running max where a lane is NaN. */
static double screen_floor(const float *a, const double *row_norms, const float *scales, double by_norm,
                           double by_scale, int64_t n) {
    __m256d most = _mm256_set1_pd(-INFINITY);
    int64_t i = 0;
    for (; i + 4 <= n; i += 4)
        most = _mm256_max_pd(screen_reach(a, row_norms, scales, by_norm, by_scale, i, -1.0), most);
    double lanes[4], floor = -INFINITY;
    _mm256_storeu_pd(lanes, most);
    for (int j = 0; j < 4; j++) floor = fmax(floor, lanes[j]);
    for (; i < n; i++) floor = fmax(floor, a[i] - (by_norm * row_norms[i] + (scales ? by_scale * scales[i] : 0.0)));
    return floor;
}

/* The tokens from `from` on that may reach the floor, by the vector test (a_i + b_i >= floor), into found[] in
 * order, until 64 - 8 are found or n is reached (every token of the tail past the last whole vector is a candidate
 * for the scalar test); returns where to go on. */
static int64_t screen_scan(const float *a, const double *row_norms, const float *scales, double by_norm,
                           double by_scale, double floor, int64_t from, int64_t n, int64_t *found, int *count) {
    int64_t i0 = from;
    for (*count = 0; i0 < n && *count <= 64 - 8; i0 += 4) {
        int keep = i0 + 4 <= n ? _mm256_movemask_pd(_mm256_cmp_pd(
                       screen_reach(a, row_norms, scales, by_norm, by_scale, i0, 1), _mm256_set1_pd(floor),
                       _CMP_GE_OQ))
                               : 0xf;
        for (int64_t i = i0; keep && i < MIN(i0 + 4, n); i++, keep >>= 1)
            if (keep & 1) found[(*count)++] = i;
    }
    return MIN(i0, n);
}
/* The same two loops eight tokens a vector where the CPU has AVX-512F: each lane's value is computed by the same
 * operations in double precision, and the max and the tests do not depend on the lanes, so the survivors are the
 * same tokens in the same order (a 16-row screen spent a sixth of its time in these loops four lanes at a time) */
#if PAIRS_BUILT
#define SCREEN_WIDE_TARGET __attribute__((target("avx512f")))
SCREEN_WIDE_TARGET static inline __m512d screen_reach8(const float *a, const double *row_norms, const float *scales,
                                                       double by_norm, double by_scale, int64_t i0, double sign) {
    __m512d bound = _mm512_mul_pd(_mm512_set1_pd(by_norm), _mm512_loadu_pd(row_norms + i0));
    if (scales) bound = _mm512_fmadd_pd(_mm512_set1_pd(by_scale), _mm512_cvtps_pd(_mm256_loadu_ps(scales + i0)), bound);
    return _mm512_fmadd_pd(_mm512_set1_pd(sign), bound, _mm512_cvtps_pd(_mm256_loadu_ps(a + i0)));
}
SCREEN_WIDE_TARGET static double screen_floor8(const float *a, const double *row_norms, const float *scales,
                                               double by_norm, double by_scale, int64_t n) {
    __m512d most = _mm512_set1_pd(-INFINITY);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        most = _mm512_max_pd(screen_reach8(a, row_norms, scales, by_norm, by_scale, i, -1.0), most);
    double lanes[8], floor = -INFINITY;
    _mm512_storeu_pd(lanes, most);
    for (int j = 0; j < 8; j++) floor = fmax(floor, lanes[j]);
    for (; i < n; i++) floor = fmax(floor, a[i] - (by_norm * row_norms[i] + (scales ? by_scale * scales[i] : 0.0)));
    return floor;
}
SCREEN_WIDE_TARGET static int64_t screen_scan8(const float *a, const double *row_norms, const float *scales,
                                               double by_norm, double by_scale, double floor, int64_t from,
                                               int64_t n, int64_t *found, int *count) {
    int64_t i0 = from;
    for (*count = 0; i0 < n && *count <= 64 - 8; i0 += 8) {
        unsigned keep = i0 + 8 <= n ? (unsigned)_mm512_cmp_pd_mask(
                            screen_reach8(a, row_norms, scales, by_norm, by_scale, i0, 1), _mm512_set1_pd(floor),
                            _CMP_GE_OQ)
                                    : 0xffu;
        for (int64_t i = i0; keep && i < MIN(i0 + 8, n); i++, keep >>= 1)
            if (keep & 1) found[(*count)++] = i;
    }
    return MIN(i0, n);
}
static int screen_lanes8(void) {
    static int wide = -1;
    if (wide < 0) __builtin_cpu_init(), wide = __builtin_cpu_supports("avx512f");
    return wide;
}
#else
static double screen_floor8(const float *a, const double *row_norms, const float *scales, double by_norm,
                            double by_scale, int64_t n) {
    return screen_floor(a, row_norms, scales, by_norm, by_scale, n);
}
static int64_t screen_scan8(const float *a, const double *row_norms, const float *scales, double by_norm,
                            double by_scale, double floor, int64_t from, int64_t n, int64_t *found, int *count) {
    return screen_scan(a, row_norms, scales, by_norm, by_scale, floor, from, n, found, count);
}
static int screen_lanes8(void) { return 0; }
#endif

/* The bound's tests and the float32 sums of the survivors, row by row: rows [first, last) of a screen's call. A row
 * the screen cannot decide (no finite candidate: NaN or inf inputs) gets id -1. */
typedef struct {
    const float *approx, *x;
    const void *weight;
    const double *row_norms;
    const float *scales; /* NULL: a bfloat16 screen */
    const double *spread;
    double norm_factor, l1_factor;
    int bf16_head;
    int64_t n, k, *ids, *screened;
} ScreenRows;

/* The float32 (or bfloat16-head) sums of up to 8 survivors ids[0..n), in index order: each counted, and kept where
 * larger than the best so far (so the first of equal largest wins, as torch's argmax picks) */
static void settle_survivors(const ScreenRows *S, const float *xr, int64_t *ids, int n, int64_t *best, float *top,
                             int64_t *count) {
    float e[8];
    for (int t = n; t < 8; t++) ids[t] = ids[n - 1]; /* padding: a repeated chain, its sum unread */
    if (S->bf16_head == 2) (amx_on ? chain_dot_amx8 : chain_dot_pairs8)((const uint16_t *)S->weight, ids, xr, S->k, e);
    else chain_dots8(S->weight, S->bf16_head, ids, xr, S->k, e);
    for (int t = 0; t < n; t++) {
        ++*count;
        if (*best < 0 || e[t] > *top) *best = ids[t], *top = e[t];
    }
}

static void screen_rows(void *ctx, int64_t first, int64_t last) {
    const ScreenRows *S = ctx;
    const int64_t n = S->n, k = S->k;
    const double *row_norms = S->row_norms;
    const float *scales = S->scales;
    for (int64_t r = first; r < last; r++) {
        const float *a = S->approx + r * n, *xr = S->x + r * k;
        double norm = 0.0, l1 = 0.0;
        for (int64_t j = 0; j < k; j++) norm += (double)xr[j] * xr[j], l1 += fabs((double)xr[j]);
        double by_norm = S->spread ? S->spread[r] : S->norm_factor * sqrt(norm);
        double by_scale = scales ? S->l1_factor * l1 : 0.0;
        int wide = screen_lanes8();
        double floor = (wide ? screen_floor8 : screen_floor)(a, row_norms, scales, by_norm, by_scale, n);
        /* a step of the max's value, and room (absolute: also for the pairs kernel flushing values under 2^-126 to
         * zero, at most 2^-125 a step over k < 2^20 steps) */
        if (S->bf16_head) floor -= (0x1p-7 + 0x1p-13) * fabs(floor) + 0x1p-100;
        int64_t best = -1, count = 0, waiting[8];
        int pending = 0;
        float top = 0.0f;
        int64_t found[64];
        int candidates;
        for (int64_t i0 = 0; i0 < n;) { /* the survivors are few */
            i0 = (wide ? screen_scan8 : screen_scan)(a, row_norms, scales, by_norm, by_scale, floor, i0, n, found,
                                                     &candidates);
            for (int c = 0; c < candidates; c++) {
                int64_t i = found[c];
                double bound = by_norm * row_norms[i] + (scales ? by_scale * scales[i] : 0.0);
                if (!(a[i] + bound >= floor)) continue; /* the tail's tokens, tested one by one */
                waiting[pending++] = i;
                if (pending == 8) settle_survivors(S, xr, waiting, 8, &best, &top, &count), pending = 0;
            }
        }
        if (pending) settle_survivors(S, xr, waiting, pending, &best, &top, &count);
        S->ids[r] = best < 0 || !isfinite(top) || !isfinite(floor) ? -1 : best, S->screened[r] = count;
    }
}

typedef struct {
    ScreenRows *rows;
    int64_t m;
    int threads;
} ScreenRowsCall;

static void screen_rows_body(void *arg) {
    ScreenRowsCall *C = arg;
    parallel_for(C->m, 1, C->threads, screen_rows, C->rows);
}

/* ids[r] = argmax of x[r] . weight^T (weight [n, k], rows as stored: float32, or bfloat16 where bf16_head, whose
 * logits its kernel rounds to bfloat16; bf16_head = 2: that kernel sums in pairs), screened through `tiles`: the
 * weight in bfloat16 (int8 = 0), or in int8 with per-row `scales`, in the float kernel's layout (int8 = 1) or in
 * the integer screen's quads, its inputs dense (2) or wide (3). row_norms[i] = |w_i|_2 rounded up (int8 >= 2:
 * c_i = s_i |q_i|_1 instead); screened[r] = how many tokens were summed exactly. Rounded logits tie
 * within a bfloat16 step: a token whose logit lies within a step of the largest, 2^-7 |max| (1 + 2^-8), below it
 * may round to the same value, so a bfloat16 head keeps those too (`floor` lowered by that much: t - c|t| grows with
 * t, so floor - c|floor| <= max - c|max|). Returns 1 when out of memory, 2 when a row has no finite candidate (NaN
 * or inf inputs): nothing is decided then, the caller computes the logits. */
int dflash_greedy_screened(const void *tiles, int int8, const float *scales, const void *weight, int bf16_head,
                           const double *row_norms, double norm_factor, double l1_factor, const float *x, int64_t m,
                           int64_t n, int64_t k, int threads, int64_t *ids, int64_t *screened) {
    int64_t k8 = (k + 7) / 8 * 8;
    /* the approximate logits (196 KB a row for SmolLM2): kept between calls, where a fresh allocation of that size
     * is a new mapping, page-faulted every round */
    static _Thread_local float *kept;
    static _Thread_local int64_t kept_size;
    float *padded = NULL, *approx = kept_buffer(&kept, &kept_size, m * n);
    const float *xf = x;
    if (!approx || (k8 != k && !(xf = padded = padded_input(x, 0, m, k, k8)))) return 1;
    double *spread = NULL; /* int8 >= 2: the bound's input rounding term by row */
    if (int8 >= 2) {
        if (!(spread = malloc(sizeof(double) * m)) ||
            dflash_int8_quad_logits(tiles, scales, x, m, n, k, threads, approx, spread, int8 == 3)) {
            free(spread), free(padded);
            return 1;
        }
    } else if (int8) {
        Int8ScreenCall C = {{tiles, scales, xf, approx, m, n, k8}, threads};
        with_workers(threads, int8_screen_body, &C);
    } else {
        run(tiles, 1, xf, NULL, approx, m, n, k8, threads, 0);
    }
    ScreenRows R = {approx, x, weight, row_norms, int8 ? scales : NULL, spread, norm_factor, l1_factor, bf16_head, n,
                    k, ids, screened};
    if (m > 1) with_workers(threads, screen_rows_body, &(ScreenRowsCall){&R, m, threads});
    else screen_rows(&R, 0, 1);
    int status = 0;
    for (int64_t r = 0; r < m; r++) status |= ids[r] < 0 ? 2 : 0;
    free(padded), free(spread);
    return status;
}

/* ---- one decoder layer over a few new tokens of a few sequences (decode steps, verify passes) -----------------
 * Llama / Qwen2 / Qwen3 layers: pre-norm attention with RoPE (and Qwen3's per-head q/k norms) over the KV cache,
 * each row causal over its own cache, then a SiLU-gated MLP. Why in C: between its four products a layer ran ~25 small
 * torch ops, ~0.3 ms a layer in float32 and ~0.7 in bfloat16 on 2 AMD EPYC cores, against ~0.9 ms for the products
 * of one token; here they cost microseconds. Values are rounded to bfloat16 where torch's bfloat16 forward rounds
 * them (after each op), so this agrees with torch's bfloat16 layers as closely as torch's own kernels do. */

static inline float rnd(float v, int bf16) { return bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }
static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void store(void *p, int64_t i, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}
static inline __m256 rnd8(__m256 v, int bf16) { return bf16 ? _mm256_castsi256_ps(bf16_bits8(v)) : v; }
static inline __m256 load8(const void *p, int64_t i, int bf16) {
    return bf16 ? widen_bf16((const uint16_t *)p + i) : _mm256_loadu_ps((const float *)p + i);
}

/* y[i] = round(a[i] + b[i]) for n floats (the residual adds) */
static void add_rounded(const float *a, const float *b, float *y, int64_t n, int bf16) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, rnd8(_mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)), bf16));
    for (; i < n; i++) y[i] = rnd(a[i] + b[i], bf16);
}

/* e^x on eight lanes (Cody-Waite reduction and a degree-5 polynomial: ~1 ulp over the range softmax and SiLU use).
 * The argument is clamped to [-87.3, 88.3], so e^x stays a normal float: what is below rounds to ~1e-38, which
 * weighs nothing in a softmax sum or a SiLU. libm's expf, one value at a time, cost SmolLM2's 16-token verify
 * pass ~3 ms. One body for W = 256 and 512 bits, so that sixteen lanes (exp16) are lane by lane exp8's bits. */
#define EXP_LANES(W, ROUND_NEAREST)                                                                                 \
    x = _mm##W##_min_ps(_mm##W##_max_ps(x, _mm##W##_set1_ps(-87.3f)), _mm##W##_set1_ps(88.3f));                      \
    __m##W n = ROUND_NEAREST(_mm##W##_mul_ps(x, _mm##W##_set1_ps(1.44269504088896341f)),                           \
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                                          \
    x = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(0.693359375f), x);                                                     \
    x = _mm##W##_fnmadd_ps(n, _mm##W##_set1_ps(-2.12194440e-4f), x);                                                  \
    __m##W y = _mm##W##_set1_ps(1.9875691500e-4f);                                                                    \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.3981999507e-3f));                                                  \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(8.3334519073e-3f));                                                  \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(4.1665795894e-2f));                                                  \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(1.6666665459e-1f));                                                  \
    y = _mm##W##_fmadd_ps(y, x, _mm##W##_set1_ps(5.0000001201e-1f));                                                  \
    y = _mm##W##_add_ps(_mm##W##_fmadd_ps(y, _mm##W##_mul_ps(x, x), x), _mm##W##_set1_ps(1.0f));                     \
    __m##W##i scale = _mm##W##_slli_epi32(_mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127)), 23); \
    return _mm##W##_mul_ps(y, _mm##W##_castsi##W##_ps(scale));
static inline __m256 exp8(__m256 x) { EXP_LANES(256, _mm256_round_ps) }
#if PAIRS_BUILT
/* the gate and softmax sixteen at a time, where the CPU has AVX-512F */
#define WIDE_EXP_TARGET __attribute__((target("avx512f")))
WIDE_EXP_TARGET static inline __m512 exp16(__m512 x) { EXP_LANES(512, _mm512_roundscale_ps) }
#endif

/* out = x / rms(x) * weight, statistics in float32; torch rounds x / rms(x) to the model dtype, then the product.
 * `unit`: Gemma's norm, whose stored weight is an offset from 1 and whose product is taken before one rounding. */
static void rms_norm(const float *x, const void *weight, float eps, int64_t dim, int bf16, float *out, int unit) {
    __m256 squares = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= dim; i += 8) squares = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), squares);
    float sum = hsum(squares);
    for (; i < dim; i++) sum += x[i] * x[i];
    float inv = 1.0f / sqrtf(sum / (float)dim + eps);
    if (unit) {
        for (i = 0; i + 8 <= dim; i += 8) {
            __m256 scale = _mm256_add_ps(_mm256_set1_ps(1.0f), load8(weight, i, bf16));
            __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv));
            _mm256_storeu_ps(out + i, rnd8(_mm256_mul_ps(normed, scale), bf16));
        }
        for (; i < dim; i++) out[i] = rnd((x[i] * inv) * (1.0f + load(weight, i, bf16)), bf16);
        return;
    }
    for (i = 0; i + 8 <= dim; i += 8) {
        __m256 normed = rnd8(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(inv)), bf16);
        _mm256_storeu_ps(out + i, rnd8(_mm256_mul_ps(load8(weight, i, bf16), normed), bf16));
    }
    for (; i < dim; i++) out[i] = rnd(load(weight, i, bf16) * rnd(x[i] * inv, bf16), bf16);
}

/* A model's final norm over `rows` rows of x, in the model's dtype (bf16: bfloat16, else float32), into float32
 * rows `out` (bfloat16 values where bf16): rms_norm row by row, as the layers' own norms run. `row`: dim floats. */
static void final_norm_rows(const void *x, const void *weight, float eps, int64_t rows, int64_t dim, int bf16,
                            int unit, float *row, float *out) {
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < dim; i++) row[i] = load(x, r * dim + i, bf16);
        rms_norm(row, weight, eps, dim, bf16, out + r * dim, unit);
    }
}

/* final_norm_rows into out in the model's dtype: one call where torch's bfloat16 RMSNorm is six small ops, each
 * cold after a pass has streamed the weights (~0.2 ms of a 7 ms bfloat16 SmolLM2 step on 2 AMD EPYC Zen 4 cores). */
int dflash_rms_norm(const void *x, const void *weight, void *out, int64_t rows, int64_t dim, float eps, int bf16,
                    int unit) {
    float *row = malloc((size_t)(rows + 1) * (size_t)dim * sizeof(float));
    if (!row) return 1;
    float *normed = row + dim;
    final_norm_rows(x, weight, eps, rows, dim, bf16, unit, row, normed);
    for (int64_t i = 0; i < rows * dim; i++) {
        if (bf16)
            ((uint16_t *)out)[i] = f32_to_bf16(normed[i]); /* already a bfloat16 value: exact */
        else
            ((float *)out)[i] = normed[i];
    }
    free(row);
    return 0;
}

/* dflash_greedy_screened over the final norm of rows x (the model's dtype, as dflash_rms_norm takes them): the
 * norm, widened, and the screen in one call (two cold calls from Python before). Its rows are bitwise those of
 * dflash_rms_norm (the same function), so its tokens are the argmax of the logits of the model's normed rows. */
int dflash_greedy_screened_normed(const void *tiles, int int8, const float *scales, const void *weight, int bf16_head,
                                  const double *row_norms, double norm_factor, double l1_factor, const void *x,
                                  const void *norm_weight, float eps, int bf16, int unit, int64_t m, int64_t n,
                                  int64_t k, int threads, int64_t *ids, int64_t *screened) {
    static _Thread_local float *kept;
    static _Thread_local int64_t kept_size;
    float *rows = kept_buffer(&kept, &kept_size, (m + 1) * k);
    if (!rows) return 1;
    final_norm_rows(x, norm_weight, eps, m, k, bf16, unit, rows + m * k, rows);
    return dflash_greedy_screened(tiles, int8, scales, weight, bf16_head, row_norms, norm_factor, l1_factor, rows, m,
                                  n, k, threads, ids, screened);
}

/* x * cos + roll(x, d / 2) * signed_sin over one head (layers.py apply_rotary) */
static void rotate(float *x, const void *cos, const void *sin, int64_t d, int bf16, float *tmp) {
    if (d % 16 == 0) { /* halves of whole vectors: x[i] pairs with x[i +- d / 2] */
        for (int64_t i = 0; i < d; i += 8) {
            __m256 a = rnd8(_mm256_mul_ps(_mm256_loadu_ps(x + i), load8(cos, i, bf16)), bf16);
            __m256 b = rnd8(_mm256_mul_ps(_mm256_loadu_ps(x + (i + d / 2) % d), load8(sin, i, bf16)), bf16);
            _mm256_storeu_ps(tmp + i, rnd8(_mm256_add_ps(a, b), bf16));
        }
        memcpy(x, tmp, sizeof(float) * (size_t)d);
        return;
    }
    for (int64_t i = 0; i < d; i++) {
        float a = rnd(x[i] * load(cos, i, bf16), bf16);
        float b = rnd(x[(i + d / 2) % d] * load(sin, i, bf16), bf16);
        tmp[i] = rnd(a + b, bf16);
    }
    memcpy(x, tmp, sizeof(float) * (size_t)d);
}

/* y[m, n] = x[m, k8] . tiles^T + bias, rounded as torch's product in the model dtype; bf16 = 2: tiles in pairs (the
 * pairs buffer was reserved by the layer's caller, `reserve_pairs`); PAIRS_GIVEN: and x is that buffer, its pairs
 * written already (layer_pairs) */
static void product_rounded(const void *tiles, const void *bias, int bf16, const float *x, float *y, int64_t m,
                            int64_t n, int64_t k, int threads, float *bias_f, int rounded) {
    if (bias)
        for (int64_t i = 0; i < n; i++) bias_f[i] = load(bias, i, bf16);
    run(tiles, bf16, x, bias ? bias_f : NULL, y, m, n, (k + 7) / 8 * 8, threads, rounded);
}
static void product(const void *tiles, const void *bias, int bf16, const float *x, float *y, int64_t m, int64_t n,
                    int64_t k, int threads, float *bias_f) {
    product_rounded(tiles, bias, bf16, x, y, m, n, k, threads, bias_f, bf16 != 0);
}

/* A bfloat16-in-pairs layer's buffer for a product's input pairs [m, k8] (reserved before the layer ran), which the
 * tasks computing that input fill row by row as they go (attention_items, gate_tokens): converting it afterwards on
 * the first thread read rows the other thread had just written from that thread's caches, 1.2% of a 16-token pass.
 * NULL: not such a layer. */
static uint16_t *layer_pairs(int bf16) { return bf16 == 2 ? (uint16_t *)pairs_buffer(0) : NULL; }

/* a . b over d floats: eight lanes of FMAs, then, where d % 8 == 0, their sum by dot8's tree ((x0 + x1) + (x2 + x3))
 * + ((x4 + x5) + (x6 + x7)), so that a key's score is the same whichever of the two scores it: a tree pass scores
 * its keys against the pass's end, a step against its own (hsum's order made tree passes differ from steps). */
static inline float dot(const float *a, const float *b, int64_t d) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float x[8], s;
    _mm256_storeu_ps(x, acc);
    if (d % 8 == 0) return ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
    s = hsum(acc);
    for (; i < d; i++) s += a[i] * b[i];
    return s;
}

/* Cache rows j0..j1-1 (d values each, row 0 at element `at`) as float32: the rows themselves, or (bf16) widened
 * into `block` (widening is exact, so the sums below do not depend on which) */
static inline const float *cache_rows(const void *cache, int64_t at, int64_t j0, int64_t j1, int64_t d, int bf16,
                                      float *block) {
    if (!bf16) return (const float *)cache + at + j0 * d;
    const uint16_t *src = (const uint16_t *)cache + at + j0 * d;
    int64_t count = (j1 - j0) * d, i = 0;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(block + i, widen_bf16(src + i));
    for (; i < count; i++) block[i] = bf16_to_f32(src[i]);
    return block;
}

/* x[j] = e^(x[j] - shift) for j < n; returns their sum (the same lanes and order for a given n, so a token's
 * softmax does not depend on the pass it is in); the eight-lane loop from j on, adding to sums (exp_sums16's) */
static float exp_shifted_from(float *x, int64_t n, float shift, int64_t j, __m256 sums) {
    __m256 by = _mm256_set1_ps(shift);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), by));
        _mm256_storeu_ps(x + j, e);
        sums = _mm256_add_ps(sums, e);
    }
    float total = hsum(sums), tail[8] = {0};
    if (j < n) {
        memcpy(tail, x + j, sizeof(float) * (size_t)(n - j));
        _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), by)));
        for (int64_t i = 0; j + i < n; i++) total += (x[j + i] = tail[i]);
    }
    return total;
}
#if PAIRS_BUILT
/* Sixteen at a time, each half added to the eight lanes' sums in the order the eight-lane loop adds them: the same
 * values and sum, bitwise, for half the exponentials' instructions. Returns where it stopped. */
WIDE_EXP_TARGET static int64_t exp_sums16(float *x, int64_t n, float shift, __m256 *sums) {
    __m512 by = _mm512_set1_ps(shift);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), by));
        _mm512_storeu_ps(x + j, e);
        *sums = _mm256_add_ps(*sums, _mm512_castps512_ps256(e));
        *sums = _mm256_add_ps(*sums, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
    return j;
}
#else
static int64_t exp_sums16(float *x, int64_t n, float shift, __m256 *sums) {
    return (void)x, (void)n, (void)shift, (void)sums, 0;
}
#endif
static int exp_wide = -1; /* -1: not yet asked (then: where the CPU has AVX-512F) */
static int exp_lanes16(void) {
    if (exp_wide < 0) __builtin_cpu_init(), exp_wide = PAIRS_BUILT && __builtin_cpu_supports("avx512f");
    return exp_wide;
}
/* Whether softmax takes its exponentials sixteen at a time (on: only where the CPU can); returns the previous
 * setting. Either way gives the same outputs: for tests and A/B runs. */
int dflash_set_wide_exponentials(int on) {
    int old = exp_lanes16();
    exp_wide = on && PAIRS_BUILT && __builtin_cpu_supports("avx512f");
    return old;
}
static float exp_shifted(float *x, int64_t n, float shift) {
    __m256 sums = _mm256_setzero_ps();
    int64_t j = exp_lanes16() ? exp_sums16(x, n, shift, &sums) : 0;
    return exp_shifted_from(x, n, shift, j, sums);
}

/* max(x[0..n-1]) (-inf for none; NaNs skipped, as `x > top ? x : top` does), eight lanes at a time: a scalar
 * chain of maxima waited on each one's latency, a tenth of attention after 1000 tokens. Any order gives the same. */
static inline float largest(const float *x, int64_t n) {
    __m256 a = _mm256_set1_ps(-INFINITY), b = a;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        a = _mm256_max_ps(_mm256_loadu_ps(x + j), a); /* maxps gives its second operand where the first is NaN */
        b = _mm256_max_ps(_mm256_loadu_ps(x + j + 8), b);
    }
    float lanes[8], top = -INFINITY;
    _mm256_storeu_ps(lanes, _mm256_max_ps(a, b));
    for (int i = 0; i < 8; i++) top = lanes[i] > top ? lanes[i] : top;
    for (; j < n; j++) top = x[j] > top ? x[j] : top;
    return top;
}

/* out += p * v over d floats */
static inline void add_scaled(float *out, float p, const float *v, int64_t d) {
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(_mm256_set1_ps(p), _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < d; i++) out[i] = fmaf(p, v[i], out[i]);
}

/* Where a chunk of consecutive tokens of one row keeps its per-(token, head) rows: q, scores, out */
typedef struct {
    const float *q;
    float *scores, *out;
    int64_t q_token, score_token, score_head, out_token; /* strides in floats */
} Rows;

/* q . k_r for the eight keys r = 0..7 at k (rows of d floats, d % 8 == 0): eight accumulators, then one horizontal
 * reduction for all eight (a dot product at a time was bound by its FMA latency and its own reduction) */
static inline __m256 dot8(const float *q, const float *k, int64_t d) {
    __m256 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m256 qv = _mm256_loadu_ps(q + i);
        for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(k + r * d + i), qv, a[r]);
    }
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* s[j] = q . k_j * scale for the keys j0..MIN(j1, n)-1 of a block (`k`: key j0's row): eight at a time where a
 * whole eight lies below n, the rest one by one. j0 is a multiple of eight and which way a key goes depends only
 * on j and n, so a token's scores are the same in any pass and for any block size. */
static void block_scores(const float *q, const float *k, int64_t j0, int64_t j1, int64_t lo, int64_t n, int64_t d,
                         float scale, float *s) {
    int64_t j = MAX(j0, lo), stop = MIN(j1, n);
    if (d % 8 == 0)
        for (; j + 8 <= stop; j += 8)
            _mm256_storeu_ps(s + j, _mm256_mul_ps(dot8(q, k + (j - j0) * d, d), _mm256_set1_ps(scale)));
    for (; j < stop; j++) s[j] = dot(q, k + (j - j0) * d, d) * scale;
}

/* out += sum_j p[j] v_j over the values j0..MIN(j1, n)-1 of a block (`v`: value j0's row), in order of j. Heads
 * of 64 floats (or multiples) keep their sums in eight registers over the block; others add row by row. Each output
 * is one chain of FMAs over j, stored and reloaded between blocks (exact), so blocks do not change it. */
static void block_values(const float *p, const float *v, int64_t j0, int64_t j1, int64_t lo, int64_t n, int64_t d,
                         float *out) {
    int64_t first = MAX(j0, lo), stop = MIN(j1, n);
    if (d % 64 == 0) {
        for (int64_t c = 0; c < d; c += 64) {
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(out + c + 8 * i);
            for (int64_t j = first; j < stop; j++) {
                __m256 pj = _mm256_set1_ps(p[j]);
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(_mm256_loadu_ps(v + (j - j0) * d + c + 8 * i), pj, a[i]);
            }
            for (int i = 0; i < 8; i++) _mm256_storeu_ps(out + c + 8 * i, a[i]);
        }
        return;
    }
    for (int64_t j = first; j < stop; j++) add_scaled(out, p[j], v + (j - j0) * d, d);
}

/* s[j] = q . k_j * scale for the keys j0..MIN(j1, n)-1 of a block of bfloat16 keys (`k`: key j0's row), where a
 * bfloat16 model's products run in pairs (AVX512-BF16): q and k are bfloat16 values (q rounded after RoPE), so
 * VDPBF16PS takes them as they are, 32 products an instruction, and the cache needs no widening. Each score is ONE
 * chain of VDPBF16PS over q's pairs in order, then a fixed sum of its 16 lanes, whatever the block: a token's
 * scores are the same in any pass. (A float32 FMA chain of widened keys took 8 instructions and 8 loads a key, and
 * after 512 tokens attention was a third of a 16-token pass.) */
#if PAIRS_BUILT
#define ATTENTION_PAIRS_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
/* word i of an array of bfloat16 pairs, whatever type wrote it */
static inline uint32_t word_at(const void *p, int64_t i) {
    uint32_t w;
    memcpy(&w, (const char *)p + 4 * i, 4);
    return w;
}

/* lane i of the result: the sum of a[i]'s 16 lanes, by the same tree for every i (within each 128-bit lane
 * (x0 + x2) + (x1 + x3), then the lanes (L0 + L1) + (L2 + L3)), so a key's score does not depend on its neighbours */
ATTENTION_PAIRS_TARGET static inline __m512 lane_sums16(const __m512 *a) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    __m512 d = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    __m512 e = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d, e, 0x88), _mm512_shuffle_f32x4(d, e, 0xDD));
}

ATTENTION_PAIRS_TARGET static void block_scores_pairs(const uint16_t *qb, const uint16_t *k, int64_t j0, int64_t j1,
                                                      int64_t lo, int64_t n, int64_t d, float scale, float *s) {
    int64_t whole = d / 32 * 32;
    __mmask32 tail = (__mmask32)((1ull << (d - whole)) - 1);
    for (int64_t j = MAX(j0, lo), stop = MIN(j1, n); j < stop; j += 16) {
        int count = (int)MIN(16, stop - j);
        __m512 acc[16];
        if (d == 64 && count == 16) { /* heads of 64 (Llama, SmolLM2): sixteen chains of two, in registers */
            __m512bh q0 = (__m512bh)_mm512_loadu_si512(qb), q1 = (__m512bh)_mm512_loadu_si512(qb + 32);
            const uint16_t *kr = k + (j - j0) * 64;
#pragma GCC unroll 16
            for (int r = 0; r < 16; r++)
                acc[r] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), q0,
                                                           (__m512bh)_mm512_loadu_si512(kr + r * 64)),
                                          q1, (__m512bh)_mm512_loadu_si512(kr + r * 64 + 32));
            _mm512_storeu_ps(s + j, _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale)));
            continue;
        }
        for (int r = 0; r < 16; r++) {
            acc[r] = _mm512_setzero_ps();
            if (r >= count) continue;
            const uint16_t *kr = k + (j + r - j0) * d;
            for (int64_t i = 0; i < whole; i += 32)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(qb + i),
                                          (__m512bh)_mm512_loadu_si512(kr + i));
            if (tail)
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_maskz_loadu_epi16(tail, qb + whole),
                                          (__m512bh)_mm512_maskz_loadu_epi16(tail, kr + whole));
        }
        _mm512_mask_storeu_ps(s + j, (__mmask16)((1u << count) - 1),
                              _mm512_mul_ps(lane_sums16(acc), _mm512_set1_ps(scale)));
    }
}
#else
static void block_scores_pairs(const uint16_t *q, const uint16_t *k, int64_t j0, int64_t j1, int64_t lo,
                               int64_t n, int64_t d, float scale, float *s) {
    (void)q, (void)k, (void)j0, (void)j1, (void)lo, (void)n, (void)d, (void)scale, (void)s;
}
#endif

/* The value sums of Q query heads (Q <= VALUE_HEADS) over 64 columns of the cache's values (v: key 0's columns, d
 * apart; float32, or bfloat16 widened exactly): out[q][0:64] = sum over j in from[q]..to[q]-1 of p[q][j] v_j, each
 * output ONE chain of FMAs over j in order from zero, exactly the sums block_values makes, so a verify pass is still
 * bitwise its steps, and outputs do not change with the CPU. The keys all Q heads read run once for all of them,
 * each value row loaded (widened) once, into registers: block_values widened every block of a bfloat16 cache into
 * memory for each work item and read it back for each head (with the widening, two thirds of attention in a
 * 16-token bfloat16 pass). Needs AVX-512F (32 vector registers: up to 24 accumulators). */
#define VALUE_HEADS 6
typedef void (*Values64)(const void *v, int64_t d, const float *const *p, const int64_t *from, const int64_t *to,
                         float *const *out);
#if PAIRS_BUILT
#define VALUES_TARGET __attribute__((target("avx512f")))
VALUES_TARGET static inline __m512 value16(const void *v, int64_t at, int bf16) {
    if (!bf16) return _mm512_loadu_ps((const float *)v + at);
    __m256i half = _mm256_loadu_si256((const __m256i *)((const uint16_t *)v + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
#define VALUE_ROW(q, j)                                                                                               \
    do {                                                                                                              \
        __m512 pj = _mm512_set1_ps(p[q][j]);                                                                          \
        for (int i = 0; i < 4; i++) a[q][i] = _mm512_fmadd_ps(value16(v, (j) * d + 16 * i, BF16), pj, a[q][i]);      \
    } while (0)
VALUES_TARGET static inline __attribute__((always_inline)) void values64(const void *v, int64_t d, const int Q,
                                                                         const int BF16, const float *const *p,
                                                                         const int64_t *from, const int64_t *to,
                                                                         float *const *out) {
    __m512 a[VALUE_HEADS][4];
    int64_t lo = from[0], hi = to[0]; /* the keys every head reads */
#pragma GCC unroll 6
    for (int q = 0; q < Q; q++) {
        lo = MAX(lo, from[q]), hi = MIN(hi, to[q]);
        for (int i = 0; i < 4; i++) a[q][i] = _mm512_setzero_ps();
    }
    int common = lo < hi; /* none in common (sliding windows): each head alone */
#pragma GCC unroll 6
    for (int q = 0; q < Q; q++) /* a head's own keys before the common ones (or all of them) */
        for (int64_t j = from[q], stop = common ? lo : to[q]; j < stop; j++) VALUE_ROW(q, j);
    for (int64_t j = lo; common && j < hi; j++) {
        __m512 v0 = value16(v, j * d, BF16), v1 = value16(v, j * d + 16, BF16);
        __m512 v2 = value16(v, j * d + 32, BF16), v3 = value16(v, j * d + 48, BF16);
#pragma GCC unroll 6
        for (int q = 0; q < Q; q++) {
            __m512 pj = _mm512_set1_ps(p[q][j]);
            a[q][0] = _mm512_fmadd_ps(v0, pj, a[q][0]), a[q][1] = _mm512_fmadd_ps(v1, pj, a[q][1]);
            a[q][2] = _mm512_fmadd_ps(v2, pj, a[q][2]), a[q][3] = _mm512_fmadd_ps(v3, pj, a[q][3]);
        }
    }
#pragma GCC unroll 6
    for (int q = 0; q < Q; q++) {
        for (int64_t j = hi; common && j < to[q]; j++) VALUE_ROW(q, j); /* and its own keys after them */
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(out[q] + 16 * i, a[q][i]);
    }
}
#undef VALUE_ROW
#define VALUES64(Q, BF16, NAME)                                                                                       \
    VALUES_TARGET static void NAME(const void *v, int64_t d, const float *const *p, const int64_t *from,              \
                                   const int64_t *to, float *const *out) {                                            \
        values64(v, d, Q, BF16, p, from, to, out);                                                                    \
    }
VALUES64(1, 0, values64_f32_1) VALUES64(2, 0, values64_f32_2) VALUES64(3, 0, values64_f32_3)
VALUES64(4, 0, values64_f32_4) VALUES64(5, 0, values64_f32_5) VALUES64(6, 0, values64_f32_6)
VALUES64(1, 1, values64_bf16_1) VALUES64(2, 1, values64_bf16_2) VALUES64(3, 1, values64_bf16_3)
VALUES64(4, 1, values64_bf16_4) VALUES64(5, 1, values64_bf16_5) VALUES64(6, 1, values64_bf16_6)
static const Values64 values64_of[2][VALUE_HEADS] = {
    {values64_f32_1, values64_f32_2, values64_f32_3, values64_f32_4, values64_f32_5, values64_f32_6},
    {values64_bf16_1, values64_bf16_2, values64_bf16_3, values64_bf16_4, values64_bf16_5, values64_bf16_6}};
static int cpu_has_avx512f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
#else
static const Values64 values64_of[2][VALUE_HEADS] = {{NULL}, {NULL}};
static int cpu_has_avx512f(void) { return 0; }
#endif
static int values_in_registers = -1; /* -1: not yet asked (then: where the CPU has AVX-512F); 0: block_values */
static int values64_here(void) {
    if (values_in_registers < 0) values_in_registers = cpu_has_avx512f();
    return values_in_registers;
}
/* Whether attention sums values through values64 (on: only where the CPU can); returns the previous setting.
 * Either way gives the same outputs: for tests and A/B runs. */
int dflash_set_values_in_registers(int on) {
    int old = values64_here();
    values_in_registers = on && cpu_has_avx512f();
    return old;
}

static int attention_pairs = 1; /* 0: FMA chains of widened keys and values even where pairs run (A/B runs) */
int dflash_set_attention_pairs(int on) {
    int old = attention_pairs;
    attention_pairs = on;
    return old;
}

/* A bfloat16 model's value sums in pairs (AVX512-BF16), attention in pairs being on: a query's weights p_j rounded
 * to bfloat16 (as torch's bfloat16 flash attention rounds them before its value product), two keys' values
 * interleaved by column, and VDPBF16PS adds p_2m v_2m + p_2m+1 v_2m+1 for sixteen columns at once: half the
 * instructions of the FMA chains above, which ran at the FMA rate and were two fifths of attention in a 16-token
 * pass. Each output is ONE chain over the query's key pairs m = from / 2 .. (to + 1) / 2 - 1 in order; a pair with
 * a key outside [from, to) reads that key's values and weight as zero, so a token's sums are the same in any pass
 * (a step's key `to` may be a stale or unwritten slot). */
#if PAIRS_BUILT
/* keys 2m and 2m + 1 of 64 columns of values (v: key 0's), interleaved: I[0] and I[1] columns 0..31, I[2] and I[3]
 * 32..63, each 128-bit lane holding four columns of both (unpacklo: 8 L + 0..3, unpackhi: 8 L + 4..7); a key not
 * `first` / `second` reads as zero */
ATTENTION_PAIRS_TARGET static inline void value_rows(const uint16_t *a, const uint16_t *b, __m512i *I) {
    __m512i zero = _mm512_setzero_si512();
    __m512i a0 = a ? _mm512_loadu_si512(a) : zero, a1 = a ? _mm512_loadu_si512(a + 32) : zero;
    __m512i b0 = b ? _mm512_loadu_si512(b) : zero, b1 = b ? _mm512_loadu_si512(b + 32) : zero;
    I[0] = _mm512_unpacklo_epi16(a0, b0), I[1] = _mm512_unpackhi_epi16(a0, b0);
    I[2] = _mm512_unpacklo_epi16(a1, b1), I[3] = _mm512_unpackhi_epi16(a1, b1);
}
ATTENTION_PAIRS_TARGET static inline void value_pair(const uint16_t *v, int64_t d, int64_t m, int first, int second,
                                                     __m512i *I) {
    value_rows(first ? v + 2 * m * d : NULL, second ? v + (2 * m + 1) * d : NULL, I);
}
/* out[0:64] from the four sums of value pairs: lanes 4 L + k of a[0] (a[1]) hold column 8 L + k (8 L + 4 + k) */
ATTENTION_PAIRS_TARGET static inline void store_value_sums(const __m512 *a, float *out) {
    const __m512i low = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i high = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int h = 0; h < 2; h++) {
        _mm512_storeu_ps(out + 32 * h, _mm512_permutex2var_ps(a[2 * h], low, a[2 * h + 1]));
        _mm512_storeu_ps(out + 32 * h + 16, _mm512_permutex2var_ps(a[2 * h], high, a[2 * h + 1]));
    }
}
#define PAIR_ROW(q, m)                                                                                                \
    do {                                                                                                              \
        __m512i I[4];                                                                                                 \
        value_pair(v, d, m, 2 * (m) >= from[q], 2 * (m) + 1 < to[q], I);                                              \
        __m512bh w = (__m512bh)_mm512_set1_epi32((int)word_at(p[q], m));                                             \
        for (int i = 0; i < 4; i++) a[q][i] = _mm512_dpbf16_ps(a[q][i], (__m512bh)I[i], w);                           \
    } while (0)
ATTENTION_PAIRS_TARGET static inline __attribute__((always_inline)) void value_pairs64(const uint16_t *v, int64_t d,
                                                                                       const int Q,
                                                                                       const float *const *p,
                                                                                       const int64_t *from,
                                                                                       const int64_t *to,
                                                                                       float *const *out) {
    __m512 a[VALUE_HEADS][4];
    int64_t lo = (from[0] + 1) / 2, hi = to[0] / 2; /* the pairs whose two keys every query reads */
#pragma GCC unroll 6
    for (int q = 0; q < Q; q++) {
        lo = MAX(lo, (from[q] + 1) / 2), hi = MIN(hi, to[q] / 2);
        for (int i = 0; i < 4; i++) a[q][i] = _mm512_setzero_ps();
    }
    int common = lo < hi;
#pragma GCC unroll 6
    for (int q = 0; q < Q; q++)
        for (int64_t m = from[q] / 2, stop = common ? lo : (to[q] + 1) / 2; m < stop; m++) PAIR_ROW(q, m);
    for (int64_t m = lo; common && m < hi; m++) {
        __m512i I[4];
        value_pair(v, d, m, 1, 1, I);
#pragma GCC unroll 6
        for (int q = 0; q < Q; q++) {
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)word_at(p[q], m));
            for (int i = 0; i < 4; i++) a[q][i] = _mm512_dpbf16_ps(a[q][i], (__m512bh)I[i], w);
        }
    }
#pragma GCC unroll 6
    for (int q = 0; q < Q; q++) {
        for (int64_t m = common ? hi : (to[q] + 1) / 2; m < (to[q] + 1) / 2; m++) PAIR_ROW(q, m);
        store_value_sums(a[q], out[q]);
    }
}
#undef PAIR_ROW
typedef void (*ValuePairs64)(const uint16_t *v, int64_t d, const float *const *p, const int64_t *from,
                             const int64_t *to, float *const *out);
#define VALUE_PAIRS64(Q)                                                                                              \
    ATTENTION_PAIRS_TARGET static void value_pairs64_##Q(const uint16_t *v, int64_t d, const float *const *p,        \
                                                         const int64_t *from, const int64_t *to, float *const *out) { \
        value_pairs64(v, d, Q, p, from, to, out);                                                                     \
    }
VALUE_PAIRS64(1) VALUE_PAIRS64(2) VALUE_PAIRS64(3) VALUE_PAIRS64(4) VALUE_PAIRS64(5) VALUE_PAIRS64(6)
#undef VALUE_PAIRS64
static const ValuePairs64 value_pairs64_of[VALUE_HEADS] = {value_pairs64_1, value_pairs64_2, value_pairs64_3,
                                                           value_pairs64_4, value_pairs64_5, value_pairs64_6};

/* A query's weights s[from..to) as pairs of bfloat16 in place: the bfloat16 array b[j] = bf16(s[j]) for j in
 * [from, to) and 0 for the other key of a boundary pair, its word m pair m (b[2m] | b[2m+1] << 16). Writing b[j]
 * at byte 2j never overtakes the reads at byte 4j. */
ATTENTION_PAIRS_TARGET static void weights_as_pairs(float *s, int64_t from, int64_t to) {
    uint16_t *b = (uint16_t *)s;
    for (int64_t j = from / 2 * 2; j < to; j += 16) {
        int64_t a = MAX(from - j, 0), z = MIN(to - j, 16), end = MIN((to + 1) / 2 * 2 - j, 16);
        __mmask16 valid = (__mmask16)(((1u << z) - 1) & ~((1u << a) - 1)), room = (__mmask16)((1u << end) - 1);
        __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, s + j));
        _mm256_mask_storeu_epi16(b + j, room, (__m256i)h);
    }
}

/* A tree pass's node (trees.py's visibility word `visible` over the pass's keys from tree_start on): its value sums
 * as a step reading the same keys in a chain would sum them, the cache's keys [0, tree_start) and then the node's
 * ancestors and itself in order, compacted (its weights p[lo..count) already are: compact_tree), from the chain's
 * key lo on (a sliding window's first): the pairs of a step group keys by their place in that chain, not by their
 * slots in the pass, where other nodes sit between. */
static void chain_slots(int64_t tree_start, uint64_t visible, int64_t slot[64]) { /* the node's chain: its slots */
    for (int i = 0, k = 0; i < 64; i++)
        if (visible >> i & 1) slot[k++] = tree_start + i;
}
ATTENTION_PAIRS_TARGET static void tree_value_pairs(const uint16_t *v, int64_t d, float *p, int64_t lo, int64_t count,
                                                    int64_t tree_start, uint64_t visible, float *out) {
    int64_t slot[64];
    chain_slots(tree_start, visible, slot);
    weights_as_pairs(p, lo, count);
#define CHAIN_ROW(j) ((j) < lo || (j) >= count ? NULL : v + c + ((j) < tree_start ? (j) : slot[(j) - tree_start]) * d)
    for (int64_t c = 0; c < d; c += 64) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int64_t m = lo / 2; 2 * m < count; m++) {
            __m512i I[4];
            value_rows(CHAIN_ROW(2 * m), CHAIN_ROW(2 * m + 1), I);
            __m512bh w = (__m512bh)_mm512_set1_epi32((int)word_at(p, m));
            for (int i = 0; i < 4; i++) a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)I[i], w);
        }
        store_value_sums(a, out + c);
    }
#undef CHAIN_ROW
}
#else
typedef void (*ValuePairs64)(const uint16_t *v, int64_t d, const float *const *p, const int64_t *from,
                             const int64_t *to, float *const *out);
static const ValuePairs64 value_pairs64_of[VALUE_HEADS] = {NULL};
static void weights_as_pairs(float *s, int64_t from, int64_t to) { (void)s, (void)from, (void)to; }
static void tree_value_pairs(const uint16_t *v, int64_t d, float *p, int64_t lo, int64_t count, int64_t tree_start,
                             uint64_t visible, float *out) {
    (void)v, (void)d, (void)p, (void)lo, (void)count, (void)tree_start, (void)visible, (void)out;
}
#endif

/* ---- attention through AMX tiles (a bfloat16 model whose products run through tiles; heads a multiple of 64) ----
 * In a 16-token pass of SmolLM2 after 200 tokens, attention in pairs was a sixth of the pass (perf, Intel Xeon
 * family 6 model 207): VDPBF16PS gives 16 products an instruction, and each score then needs its own sum of 16
 * lanes. One TDPBF16PS scores 16 keys against 16 queries over 32 of a head's dimensions: the keys as the cache
 * holds them are its A tile (16 rows, 16 pairs each), the queries' pairs transposed its B tile. The value sums take
 * a query's weights in pairs (weights_as_pairs) as A and two keys' values interleaved (value_rows) as B.
 * Tiles sum a block of 16 pairs at once, not pair by pair (see amx_panels), so the outputs differ in their last bits
 * from the VDPBF16PS chains: attention runs through tiles exactly when the products do (amx_on, switched between
 * passes), never in part. Every score is still its own key row against its own query column, and every value sum
 * ONE sequence of blocks of 16 key pairs counted from key 0 (pairs outside a query's keys weigh zero and add exact
 * zeros; keys past the pass's last read as zero, so stale or unwritten slots never enter), so a verify pass gives
 * bitwise the attention of its steps, and a tree node that of a step reading its chain. */
#if AMX_BUILT && PAIRS_BUILT
#define ATTENTION_TILES_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
static int attention_tiles = 1; /* 0: attention in VDPBF16PS even where products run through tiles (A/B runs) */
static int attention_tiles_for(int pairs, int64_t d) { return pairs && amx_on && attention_tiles && d % 64 == 0; }
/* Every tile 16 rows of 64 bytes, whatever the number of queries (a step's 3 too): scores keep two chains of 16
 * keys in flight, and an item configures once for both phases (a step's layers took 1% longer through tiles with
 * a configuration per phase and one chain). Scores: tiles 6 and 0 sum 16 keys each for 16 queries, 7 and 4 hold
 * those keys' rows (16 dimension pairs), 5 the queries' pairs. Value sums: tiles 0-3 a quarter of 64 columns each
 * (value_rows' order), 4 the queries' weights (16 key pairs; rows past the queries hold stale words, and their sums
 * are never stored), 5 16 key pairs of values for 16 columns. */
static _Thread_local int tiles_configured; /* whether attention's tiles are configured on this thread */
ATTENTION_TILES_TARGET static void attention_tiles_configure(void) {
    if (tiles_configured) return;
    tiles_configured = 1;
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    TOUCHES(&c);
    _tile_loadconfig(&c);
}
ATTENTION_TILES_TARGET static void attention_tiles_release(void) {
    if (tiles_configured) _tile_release();
    tiles_configured = 0;
}

/* s[n][j] = q_n . k_j * scale for up to 16 queries (bfloat16 rows q[n]) and their keys j in [from[n], seen[n]),
 * keys read 32 at a time from first / 16 * 16 to `longest` (keys: key 0's row, d apart, `capacity` rows of them).
 * A block past the capacity is copied, zero-padded, so no read leaves the cache; the scores of keys past `longest`
 * (stale or never written) are not stored. */
ATTENTION_TILES_TARGET static void tile_scores(const uint16_t *const *q, int queries, const uint16_t *keys, int64_t d,
                                               int64_t capacity, int64_t first, int64_t longest,
                                               const int64_t *from, const int64_t *seen, float scale,
                                               float *const *s) {
    int64_t parts = d / 32; /* blocks of 16 dimension pairs */
    uint32_t dims[parts][16][16]; /* dims[c][i][n]: pair 16 c + i of query n */
    uint16_t tail[32 * d];
    float sums[32][16]; /* sums[r][n]: key j0 + r, query n */
    memset(dims, 0, sizeof dims);
    for (int n = 0; n < queries; n++)
        for (int64_t i = 0; i < d / 2; i++) dims[i / 16][i % 16][n] = word_at(q[n], i);
    TOUCHES(dims);
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    for (int64_t j0 = first / 16 * 16; j0 < longest; j0 += 32) {
        const uint16_t *k = keys + j0 * d;
        if (j0 + 32 > capacity) {
            memset(tail, 0, sizeof tail);
            memcpy(tail, k, sizeof(uint16_t) * (size_t)((MIN(longest, capacity) - j0) * d));
            k = tail;
        }
        TOUCHES(k);
        _tile_zero(6);
        _tile_zero(0);
        for (int64_t c = 0; c < parts; c++) { /* two blocks of 16 keys, two chains in flight */
            _tile_loadd(5, dims[c], 64);
            _tile_loadd(7, k + 32 * c, d * 2);
            _tile_dpbf16ps(6, 7, 5);
            _tile_loadd(4, k + 16 * d + 32 * c, d * 2);
            _tile_dpbf16ps(0, 4, 5);
        }
        _tile_stored(6, sums, 64);
        _tile_stored(0, sums[16], 64);
        TOUCHES(sums);
        for (int n = 0; n < queries; n++)
            for (int64_t h = 0; h < 32; h += 16) {
                int64_t a = MAX(j0 + h, from[n]) - j0 - h, z = MIN(j0 + h + 16, seen[n]) - j0 - h;
                if (a >= z) continue;
                __mmask16 valid = (__mmask16)(((1u << z) - 1) & ~((1u << a) - 1));
                __m512 scores = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(n)), &sums[h][0], 4);
                _mm512_mask_storeu_ps(s[n] + j0 + h, valid, _mm512_mul_ps(scores, _mm512_set1_ps(scale)));
            }
    }
}

/* out[n][0:d) = the sum over key pairs m of query n's weight pair m (p[n], words of bfloat16 pairs from
 * weights_as_pairs over [from[n], to[n])) times keys 2m and 2m + 1's values, up to 16 queries, blocks of 16 pairs
 * from pair 0 on. Key j's values sit at slot j (v: slot 0's, d apart), or, from tree_start on, at slot[j -
 * tree_start] (a tree node's chain); keys from the queries' last `to` on read as zero. */
ATTENTION_TILES_TARGET static void tile_values(const uint16_t *v, int64_t d, int queries, const float *const *p,
                                               const int64_t *from, const int64_t *to, int64_t tree_start,
                                               const int64_t *slot, float *const *out) {
    int64_t lo = from[0], hi = to[0];
    for (int n = 1; n < queries; n++) lo = MIN(lo, from[n]), hi = MAX(hi, to[n]);
    uint32_t weights[16][16], pairs[4][16][16];
    float sums[4][16][16];
#define KEY_ROW(j) ((j) >= hi ? NULL : v + c + ((j) < tree_start ? (j) : slot[(j) - tree_start]) * d)
    for (int64_t c = 0; c < d; c += 64) {
        /* the tile intrinsics name their tiles as literals (asm operands): no loops over them */
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t b = lo / 32 * 32; b < hi; b += 32) { /* keys b .. b + 31: pairs b / 2 .. b / 2 + 15 */
            for (int i = 0; i < 16; i++) {
                __m512i I[4];
                value_rows(KEY_ROW(b + 2 * i), KEY_ROW(b + 2 * i + 1), I);
                for (int r = 0; r < 4; r++) _mm512_storeu_si512(pairs[r][i], I[r]);
            }
            for (int n = 0; n < queries; n++) {
                int64_t a = MAX(from[n] / 2 - b / 2, 0), z = MIN((to[n] + 1) / 2 - b / 2, 16);
                __mmask16 valid = a < z ? (__mmask16)(((1u << z) - 1) & ~((1u << a) - 1)) : 0;
                _mm512_storeu_si512(weights[n], _mm512_maskz_loadu_epi32(valid, (const uint32_t *)p[n] + b / 2));
            }
            TOUCHES(weights);
            TOUCHES(pairs);
            _tile_loadd(4, weights, 64);
            _tile_loadd(5, pairs[0], 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, pairs[1], 64);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, pairs[2], 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, pairs[3], 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        _tile_stored(2, sums[2], 64);
        _tile_stored(3, sums[3], 64);
        TOUCHES(sums);
        for (int n = 0; n < queries; n++) {
            __m512 a[4];
            for (int r = 0; r < 4; r++) a[r] = _mm512_loadu_ps(sums[r][n]);
            store_value_sums(a, out[n] + c);
        }
    }
#undef KEY_ROW
}

/* attend's scores (before the softmax) or value sums (after) through tiles, 16 of the chunk's queries at a time */
ATTENTION_TILES_TARGET static void attend_tiles(Rows R, int64_t tokens, int64_t group, const uint16_t *q16,
                                                const uint16_t *keys, const uint16_t *values, int64_t d,
                                                int64_t capacity, int64_t first, int64_t longest,
                                                const int64_t *from, const int64_t *seen, float scale,
                                                int values_now) {
    const uint16_t *q[16];
    float *s[16], *out[16];
    int64_t lo[16], hi[16];
    for (int64_t q0 = 0; q0 < tokens * group; q0 += 16) {
        int count = (int)MIN(16, tokens * group - q0);
        for (int n = 0; n < count; n++) {
            int64_t t = (q0 + n) / group, h = (q0 + n) % group;
            q[n] = q16 + (t * group + h) * d;
            s[n] = R.scores + t * R.score_token + h * R.score_head;
            out[n] = R.out + t * R.out_token + h * d;
            lo[n] = from[t], hi[n] = seen[t];
            if (values_now) weights_as_pairs(s[n], lo[n], hi[n]);
        }
        attention_tiles_configure();
        if (values_now)
            tile_values(values, d, count, (const float *const *)s, lo, hi, INT64_MAX, NULL, out);
        else
            tile_scores(q, count, keys, d, capacity, first, longest, lo, hi, scale, s);
    }
}

/* A tree node's value sums through tiles: its chain (compact_tree), as a step reading the same keys would sum them */
ATTENTION_TILES_TARGET static void tree_value_tiles(const uint16_t *v, int64_t d, float *p, int64_t lo, int64_t count,
                                                    int64_t tree_start, uint64_t visible, float *out) {
    int64_t slot[64];
    chain_slots(tree_start, visible, slot);
    weights_as_pairs(p, lo, count);
    attention_tiles_configure();
    tile_values(v, d, 1, (const float *const *)&p, &lo, &count, tree_start, slot, &out);
}
#else
static const int attention_tiles = 0;
static int attention_tiles_for(int pairs, int64_t d) { return (void)pairs, (void)d, 0; }
static void attend_tiles(Rows R, int64_t tokens, int64_t group, const uint16_t *q16, const uint16_t *keys,
                         const uint16_t *values, int64_t d, int64_t capacity, int64_t first, int64_t longest,
                         const int64_t *from, const int64_t *seen, float scale, int values_now) {
    (void)R, (void)tokens, (void)group, (void)q16, (void)keys, (void)values, (void)d, (void)capacity, (void)first;
    (void)longest, (void)from, (void)seen, (void)scale, (void)values_now;
}
static void attention_tiles_release(void) {}
static void tree_value_tiles(const uint16_t *v, int64_t d, float *p, int64_t lo, int64_t count, int64_t tree_start,
                             uint64_t visible, float *out) {
    (void)v, (void)d, (void)p, (void)lo, (void)count, (void)tree_start, (void)visible, (void)out;
}
#endif
/* Whether attention of a bfloat16 model in tiles runs through tiles too (on by default; for tests and A/B runs);
 * returns the old setting */
int dflash_set_attention_tiles(int on) {
    int old = attention_tiles;
#if AMX_BUILT && PAIRS_BUILT
    attention_tiles = on != 0;
#else
    (void)on;
#endif
    return old;
}

/* attend's value sums through values64 (d a multiple of 64): the chunk's query heads, VALUE_HEADS at a time, each
 * 64 columns at a time; token t of the chunk sums the values of keys [lo[t], seen[t]) */
static void attend_values64(Rows R, int64_t tokens, int64_t group, const void *values, int64_t at, int64_t d,
                            const int64_t *lo, const int64_t *seen, int bf16, int pairs) {
    const float *p[VALUE_HEADS];
    float *out[VALUE_HEADS];
    int64_t from[VALUE_HEADS], to[VALUE_HEADS], heads = tokens * group;
    for (int64_t first = 0; first < heads; first += VALUE_HEADS) {
        int count = (int)MIN(VALUE_HEADS, heads - first);
        for (int q = 0; q < count; q++) {
            int64_t t = (first + q) / group, h = (first + q) % group;
            p[q] = R.scores + t * R.score_token + h * R.score_head;
            to[q] = seen[t], from[q] = lo[t];
            if (pairs) weights_as_pairs((float *)p[q], from[q], to[q]);
        }
        for (int64_t c = 0; c < d; c += 64) {
            for (int q = 0; q < count; q++) {
                int64_t t = (first + q) / group, h = (first + q) % group;
                out[q] = R.out + t * R.out_token + h * d + c;
            }
            const void *v = bf16 ? (const void *)((const uint16_t *)values + at + c) : (const float *)values + at + c;
            if (pairs)
                value_pairs64_of[count - 1](v, d, p, from, to, out);
            else
                values64_of[bf16 != 0][count - 1](v, d, p, from, to, out);
        }
    }
}

/* A tree pass's node sees the cache's keys [0, tree_start) and, of the pass's own, its ancestors and itself (the
 * bits of `visible`). Its scores s[tree_start..n) compacted to those it sees, in order (returns where they end), so
 * that its softmax sums them in the lanes and order of a step reading the same keys in a chain: with the others
 * in between at -inf, its sums differed from the step's in the last bits, and a bfloat16 target's greedy tokens
 * from `ar`'s (3 of 3 GSM8K answers with `dflash:tree15`). expand_tree puts the weights back at their slots, zero
 * elsewhere, for value sums by slot (FMA chains over zero weights add exactly nothing). */
static int64_t compact_tree(float *s, int64_t tree_start, int64_t n, uint64_t visible) {
    int64_t k = tree_start;
    for (int64_t j = tree_start; j < n; j++)
        if (visible >> (j - tree_start) & 1) s[k++] = s[j];
    return k;
}
static void expand_tree(float *s, int64_t tree_start, int64_t n, int64_t end, uint64_t visible) {
    for (int64_t j = n - 1, k = end; j >= tree_start; j--) s[j] = visible >> (j - tree_start) & 1 ? s[--k] : 0.0f;
}

/* The `group` query heads that share kv head g, for `tokens` consecutive tokens of one row (the first attends to
 * cache positions 0..last, each next one to `step` more: 1 causally, 0 in a drafter's block, where every token
 * sees the whole block; with a sliding `window` > 0, each only to its last `window`): out = softmax(q k^T * scale) v. The cache is read in blocks
 * of KEY_BLOCK keys (then values), each block once for all of the chunk's queries: query by query, every query
 * streamed the row's whole cache from L2 (~1.5 us per query at 200 positions, SmolLM2, 2 AMD EPYC cores). Every
 * (token, head) is still computed by the same operations in the same order whatever the chunk, so a verify pass
 * gives bitwise the attention of single steps. `block`: KEY_BLOCK * d floats of scratch (bf16 widening). */
#define KEY_BLOCK 32
/* tokens per work item (attention_items; through tiles, attention_chunk's): 2 rather than 4 gives a 4-token pass 6
 * items instead of 3 on two threads; bf16 SmolLM2 after 600 tokens, three alternating runs: layers of 4- and 8-token
 * passes -4% and -3% */
#define ATTEND_CHUNK 2
static void attend(Rows R, int64_t tokens, int64_t group, const void *keys, const void *values, int64_t g,
                   int64_t capacity, int64_t d, int64_t last, int64_t step, int64_t window, float scale, int bf16,
                   float *block, const uint64_t *tree, int64_t tree_start) {
    int64_t at = g * capacity * d, longest = last + (tokens - 1) * step + 1;
    int pairs = bf16 == 2 && attention_pairs;
    uint16_t q16[pairs ? tokens * group * d : 1]; /* the queries as bfloat16 (they are bfloat16 values: exact) */
    if (pairs)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < group; h++) {
                const float *q = R.q + t * R.q_token + h * d;
                uint16_t *q2 = q16 + (t * group + h) * d;
                int64_t i = 0;
                for (; i + 8 <= d; i += 8) store8(q2, i, _mm256_loadu_ps(q + i), 1);
                for (; i < d; i++) q2[i] = f32_to_bf16(q[i]);
            }
    /* token t reads the keys [from[t], seen[t]) by slot, the first `window` of them dropped (a sliding window):
     * a causal token all before it, a block's token the whole block. A tree node's chain (compact_tree) is the cache
     * before the pass, then its ancestors and itself: its window starts at the chain's key chain_lo[t], which may lie
     * among the ancestors, and it scores every key of the pass from tree_start on to compact them. */
    int64_t from[tokens], seen[tokens], chain_lo[tokens], first = longest;
    for (int64_t t = 0; t < tokens; t++) {
        seen[t] = last + t * step + 1;
        int64_t chain = tree ? tree_start + __builtin_popcountll(tree[t]) : seen[t];
        chain_lo[t] = window > 0 ? MAX(0, chain - window) : 0;
        from[t] = tree ? MIN(chain_lo[t], tree_start) : chain_lo[t];
        first = MIN(first, from[t]);
    }
    int tiles = attention_tiles_for(pairs, d);
    if (tiles)
        attend_tiles(R, tokens, group, q16, (const uint16_t *)keys + at, (const uint16_t *)values + at, d, capacity,
                     first, longest, from, seen, scale, 0);
    for (int64_t j0 = first / KEY_BLOCK * KEY_BLOCK; !tiles && j0 < longest; j0 += KEY_BLOCK) {
        int64_t j1 = MIN(j0 + KEY_BLOCK, longest);
        const float *k = pairs ? NULL : cache_rows(keys, at, j0, j1, d, bf16, block);
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < group; h++) {
                const float *q = R.q + t * R.q_token + h * d;
                float *s = R.scores + t * R.score_token + h * R.score_head;
                if (pairs)
                    block_scores_pairs(q16 + (t * group + h) * d, (const uint16_t *)keys + at + j0 * d, j0, j1,
                                       from[t], seen[t], d, scale, s);
                else
                    block_scores(q, k, j0, j1, from[t], seen[t], d, scale, s);
            }
    }
    int in_registers = d % 64 == 0 && values64_here(); /* values64 writes its sums whole, from zero */
    int tree_pairs = tree && pairs && d % 64 == 0;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < group; h++) {
            int64_t n = seen[t], lo = chain_lo[t], end = n;
            float *s = R.scores + t * R.score_token + h * R.score_head;
            if (tree) end = compact_tree(s, tree_start, n, tree[t]);
            float top = largest(s + lo, end - lo), inverse = 1.0f / exp_shifted(s + lo, end - lo, top);
            for (int64_t j = lo; j < end; j++) s[j] *= inverse;
            if (tree_pairs) {
                (tiles ? tree_value_tiles : tree_value_pairs)((const uint16_t *)values + at, d, s, lo, end, tree_start,
                                                              tree[t], R.out + t * R.out_token + h * d);
            } else if (tree) { /* by slot, ancestors before the window weighing zero (a zero weight adds nothing) */
                for (int64_t j = tree_start; j < lo; j++) s[j] = 0.0f;
                expand_tree(s, tree_start, n, end, tree[t]);
            }
            if (!in_registers && !tree_pairs) memset(R.out + t * R.out_token + h * d, 0, sizeof(float) * (size_t)d);
        }
    if (tree_pairs) { /* summed above, node by node */
    } else if (tiles) {
        attend_tiles(R, tokens, group, q16, (const uint16_t *)keys + at, (const uint16_t *)values + at, d, capacity,
                     first, longest, from, seen, scale, 1);
    } else if (in_registers || (pairs && d % 64 == 0)) {
        attend_values64(R, tokens, group, values, at, d, from, seen, bf16, pairs && d % 64 == 0);
    } else {
        for (int64_t j0 = first / KEY_BLOCK * KEY_BLOCK; j0 < longest; j0 += KEY_BLOCK) {
            int64_t j1 = MIN(j0 + KEY_BLOCK, longest);
            const float *v = cache_rows(values, at, j0, j1, d, bf16, block);
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t h = 0; h < group; h++)
                    block_values(R.scores + t * R.score_token + h * R.score_head, v, j0, j1, from[t], seen[t],
                                 d, R.out + t * R.out_token + h * d);
        }
    }
    if (tiles) attention_tiles_release(); /* this thread's tiles go back before its products configure theirs */
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < group; h++) {
            float *out = R.out + t * R.out_token + h * d;
            int64_t i = 0;
            for (; bf16 && i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, rnd8(_mm256_loadu_ps(out + i), 1));
            for (; i < d; i++) out[i] = rnd(out[i], bf16);
        }
}

#define PAD8(v) (((v) + 7) / 8 * 8)

typedef struct { /* one layer's own arguments, the same every call */
    int bf16;
    const void *norm1, *norm2, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *gate_up, *down;
    float eps, qk_eps, scale;
    int64_t hidden, heads, kv_heads, d, inter;
    const void *kv; /* a DFlash drafter's: the keys and values of injected context, one product (else NULL) */
    /* Gemma3: norms with a unit offset, and two more ("sandwich"): norm3 on the attention's output, norm4 on the
     * MLP's (norm2 is then the pre-MLP one); a GELU (tanh) gate; a sliding window (0: none); which of the pass's
     * RoPE tables the layer reads (its layer type's) */
    int gemma, gelu;
    int64_t window;
    const void *norm3, *norm4;
    int64_t rope;
    int int8; /* its four products' tiles hold int8 weights (the layer is bfloat16): INT8_PAIRS in a layer in pairs,
               * else INT8_WIDENED */
} Layer;

/* The kind of a layer's products, and the same with their inputs in pairs already (layer_pairs) */
static inline int weights_of(const Layer *L) { return L->int8 ? (L->bf16 == 2 ? INT8_PAIRS : INT8_WIDENED) : L->bf16; }
static inline int given_pairs_of(const Layer *L) { return L->int8 ? INT8_PAIRS_GIVEN : PAIRS_GIVEN; }

enum { X, XN, QKV, ATT, O_OUT, GU, ACT, DOWN_OUT, SCORES, ROW, TMP, BIAS, PARTS };

typedef struct { /* one pass: `rows` sequences of n new tokens (m in all), their caches, and float32 scratch */
    int64_t rows, n, m, longest, capacity;
    int block; /* 0: causal; 1: a drafter's block, each token attends to all of its row's tokens in the pass */
    /* a tree pass (NULL: none): token t sees the position tree_start + i of its row iff bit i of tree[t] is set
     * (its ancestors and itself), and every cached position before tree_start; tree_start is the pass's first
     * position less `tree_back` (an EAGLE-3 tree's depth pass: the earlier depths' nodes sit in the cache, each
     * node seeing its ancestors among them) */
    const uint64_t *tree;
    int64_t tree_back;
    const int64_t *starts;
    const void *cos, *sin;
    void *keys, *values;
    int threads;
    float *part[PARTS];
    /* added to each token's q, k and v after their product (float32, m rows of the product's width; NULL: none):
     * EAGLE-3's embedding half of its q/k/v product (HiddenHalf in methods/eagle3/head.py) */
    const float *qkv_rows;
} Pass;

/* Token t of a pass is token t % n of row t / n, at position starts[t / n] + t % n; its row's cache begins at
 * the returned byte offset. */
static inline int64_t position_of(const Pass *P, int64_t t) { return P->starts[t / P->n] + t % P->n; }
static inline int64_t row_offset(const Layer *L, const Pass *P, int64_t t) {
    return (t / P->n) * L->kv_heads * P->capacity * L->d * (L->bf16 ? 2 : 4);
}

/* The float32 scratch a layer's pass needs, as parts (sizes below) of one buffer. Rows of product inputs are
 * zero-padded to 8 columns (the buffer starts zeroed), and nothing writes into the padding, so layers of one shape
 * can reuse it. Returns the floats in all. */
static size_t scratch_parts(const Layer *L, const Pass *P, int64_t sizes[PARTS]) {
    int64_t width = (L->heads + 2 * L->kv_heads) * L->d, m = P->m;
    int64_t parts[PARTS] = {
        [X] = m * L->hidden,                     /* the residual stream */
        [XN] = m * PAD8(L->hidden),              /* normalised x, input of qkv and gate_up */
        [QKV] = m * width,                       /* rotated q, k and v */
        [ATT] = m * PAD8(L->heads * L->d),       /* attention output, input of o */
        [O_OUT] = m * L->hidden,
        [GU] = m * 2 * L->inter,
        [ACT] = m * PAD8(L->inter),              /* the gated activation, input of down */
        [DOWN_OUT] = m * L->hidden,
        [SCORES] = m * L->heads * P->longest,    /* one row per (token, head) */
        [ROW] = L->bf16 ? P->rows * L->kv_heads * ((P->n + ATTEND_CHUNK - 1) / ATTEND_CHUNK) * KEY_BLOCK * L->d
                        : 0,                     /* bf16: a widened block of the cache per work item */
        [TMP] = MAX(L->d, L->hidden),            /* one head's rotation or norm */
        [BIAS] = MAX(width, L->hidden),          /* a bias in float32 */
    };
    memcpy(sizes, parts, sizeof(parts));
    size_t floats = 0;
    for (int i = 0; i < PARTS; i++) floats += (size_t)sizes[i];
    return floats;
}

static void cut_scratch(Pass *P, float *buf, const int64_t sizes[PARTS]) {
    P->part[0] = buf;
    for (int i = 1; i < PARTS; i++) P->part[i] = P->part[i - 1] + sizes[i - 1];
}

static void set_longest(Pass *P) { /* the most cache positions any row's tokens attend to */
    P->longest = 0;
    for (int64_t r = 0; r < P->rows; r++) P->longest = MAX(P->longest, P->starts[r] + P->n);
}

/* q, k, v of every token: norm, product, Qwen3's per-head norms, RoPE; k and v written to their row's cache */
static void project(const Layer *L, Pass *P) {
    int64_t width = (L->heads + 2 * L->kv_heads) * L->d, d = L->d, hp = PAD8(L->hidden);
    float *qkv = P->part[QKV], *tmp = P->part[TMP];
    size_t elem = L->bf16 ? 2 : 4;
    for (int64_t t = 0; t < P->m; t++) rms_norm(P->part[X] + t * L->hidden, L->norm1, L->eps, L->hidden, L->bf16,
                                                P->part[XN] + t * hp, L->gemma);
    /* with qkv_rows, the sums are rounded (bfloat16) once, after the rows are added, as one product would */
    product_rounded(L->qkv, L->qkv_bias, weights_of(L), P->part[XN], qkv, P->m, width, L->hidden, P->threads,
                    P->part[BIAS], L->bf16 != 0 && !P->qkv_rows);
    for (int64_t i = 0; P->qkv_rows && i < P->m * width; i++) qkv[i] = rnd(qkv[i] + P->qkv_rows[i], L->bf16);
    for (int64_t t = 0; t < P->m; t++) {
        const char *cos = (const char *)P->cos + t * d * elem, *sin = (const char *)P->sin + t * d * elem;
        for (int64_t head = 0; head < L->heads + L->kv_heads; head++) {
            float *v = qkv + t * width + head * d;
            if (L->q_norm) { /* Qwen3, Gemma3: per head, before RoPE */
                rms_norm(v, head < L->heads ? L->q_norm : L->k_norm, L->qk_eps, d, L->bf16, tmp, L->gemma);
                memcpy(v, tmp, sizeof(float) * (size_t)d);
            }
            rotate(v, cos, sin, d, L->bf16, tmp);
        }
        char *keys = (char *)P->keys + row_offset(L, P, t), *values = (char *)P->values + row_offset(L, P, t);
        for (int64_t g = 0; g < L->kv_heads; g++) { /* eight at a time: one by one, 1% of a 16-token pass */
            const float *k = qkv + t * width + (L->heads + g) * d, *v = k + L->kv_heads * d;
            int64_t at = (g * P->capacity + position_of(P, t)) * d, i = 0;
            for (; i + 8 <= d; i += 8) {
                store8(keys, at + i, _mm256_loadu_ps(k + i), L->bf16);
                store8(values, at + i, _mm256_loadu_ps(v + i), L->bf16);
            }
            for (; i < d; i++) store(keys, at + i, k[i], L->bf16), store(values, at + i, v[i], L->bf16);
        }
    }
}

/* Attention, in work items of (row, kv head, a chunk of up to `chunk` of the row's tokens) shared among the
 * threads. Then o and the residual. */
typedef struct {
    const Layer *L;
    Pass *P;
    int64_t chunk, chunks;
    int tiles; /* attention through tiles: items need no widened block of the cache ([ROW], sized for ATTEND_CHUNK) */
    uint16_t *pairs; /* layer_pairs: o's input in pairs, filled by the items (NULL: none) */
} Attention;

static void attention_items(void *ctx, int64_t first, int64_t last) {
    const Attention *A = ctx;
    const Layer *L = A->L;
    Pass *P = A->P;
    int64_t width = (L->heads + 2 * L->kv_heads) * L->d, group = L->heads / L->kv_heads, ap = PAD8(L->heads * L->d);
    for (int64_t item = first; item < last; item++) {
        int64_t r = item / (L->kv_heads * A->chunks), g = item / A->chunks % L->kv_heads, c = item % A->chunks;
        int64_t t = r * P->n + c * A->chunk, head = g * group; /* the chunk's first token in the pass */
        int64_t tokens = MIN(A->chunk, P->n - c * A->chunk);
        Rows R = {.q = P->part[QKV] + t * width + head * L->d, .q_token = width,
                  .scores = P->part[SCORES] + (t * L->heads + head) * P->longest, .score_token = L->heads * P->longest,
                  .score_head = P->longest, .out = P->part[ATT] + t * ap + head * L->d, .out_token = ap};
        int whole = P->block || P->tree; /* every token's range reaches the pass's last key */
        int64_t last = whole ? P->starts[r] + P->n - 1 : position_of(P, t);
        attend(R, tokens, group, (const char *)P->keys + row_offset(L, P, t), (const char *)P->values + row_offset(L, P, t),
               g, P->capacity, L->d, last, !whole, L->window, L->scale, L->bf16,
               A->tiles ? NULL : P->part[ROW] + item * KEY_BLOCK * L->d, P->tree ? P->tree + t : NULL,
               P->starts[r] - P->tree_back);
        for (int64_t i = 0; A->pairs && i < tokens; i++)
            bf16_array(R.out + i * R.out_token, group * L->d, A->pairs + (t + i) * ap + head * L->d);
    }
}

/* Gemma's sandwich norms: each of the pass's m rows of `rows` (hidden floats apart) normalised in place */
static void normalize_rows(const Layer *L, Pass *P, const void *weight, float *rows) {
    for (int64_t t = 0; t < P->m; t++) {
        rms_norm(rows + t * L->hidden, weight, L->eps, L->hidden, L->bf16, P->part[TMP], L->gemma);
        memcpy(rows + t * L->hidden, P->part[TMP], sizeof(float) * (size_t)L->hidden);
    }
}

/* Tokens a work item: ATTEND_CHUNK, or through tiles as many as make up to 16 queries (a tile's rows or columns;
 * the keys' tiles and the values' interleaving then serve them all), though no fewer items than two a thread where
 * the pass has enough tokens for it. A token's attention is the same whatever its chunk. */
static int64_t attention_chunk(const Layer *L, const Pass *P, int tiles) {
    if (!tiles) return ATTEND_CHUNK;
    int64_t most = MAX(1, 16 / (L->heads / L->kv_heads)); /* tokens whose queries fill a tile */
    int64_t chunks = (2 * P->threads + P->rows * L->kv_heads - 1) / (P->rows * L->kv_heads);
    chunks = MAX(chunks, (P->n + most - 1) / most);
    return (P->n + chunks - 1) / chunks; /* as even as they come: 16 tokens 4 x 4, not 5, 5, 5 and 1 */
}

static void attention(const Layer *L, Pass *P) {
    int tiles = attention_tiles_for(L->bf16 == 2 && attention_pairs, L->d);
    int64_t chunk = attention_chunk(L, P, tiles), chunks = (P->n + chunk - 1) / chunk;
    int64_t items = P->rows * L->kv_heads * chunks;
    Attention A = {L, P, chunk, chunks, tiles, layer_pairs(L->bf16)};
    int worth_threads = P->m * L->heads * P->longest * L->d > 16384;
    parallel_for(items, 1, worth_threads ? P->threads : 1, attention_items, &A);
    int64_t width = L->heads * L->d, ap = PAD8(width);
    if (A.pairs) {
        for (int64_t t = 0; ap > width && t < P->m; t++) memset(A.pairs + t * ap + width, 0, 2 * (size_t)(ap - width));
        product(L->o, L->o_bias, given_pairs_of(L), (const float *)A.pairs, P->part[O_OUT], P->m, L->hidden, width,
                P->threads, P->part[BIAS]);
    } else {
        product(L->o, L->o_bias, weights_of(L), P->part[ATT], P->part[O_OUT], P->m, L->hidden, width, P->threads,
                P->part[BIAS]);
    }
    if (L->norm3) normalize_rows(L, P, L->norm3, P->part[O_OUT]);
    add_rounded(P->part[X], P->part[O_OUT], P->part[X], P->m * L->hidden, L->bf16);
}

/* GELU with the tanh approximation: g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = sign(z) (1 - e) /
 * (1 + e) with e = exp(-2 |z|), in (0, 1]: no overflow, and near z = 0 an absolute error of a few 1e-8 on 1 + tanh */
static inline __m256 gelu8(__m256 g) {
    __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
    __m256 sign = _mm256_and_ps(z, _mm256_set1_ps(-0.0f)), size = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
    __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), size));
    __m256 tanh = _mm256_or_ps(sign, _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e),
                                                   _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), tanh));
}

/* act = SiLU(gate) * up (or GELU(gate) * up) over one token's gate/up output (gate, then up: `inter` floats each),
 * rounded where torch's bfloat16 ops round; eight lanes at a time, the tail through the same lanes */
static inline __m256 gated8(__m256 g, __m256 up, int bf16, int gelu) {
    __m256 act = gelu ? gelu8(g)
                      : _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return rnd8(_mm256_mul_ps(rnd8(act, bf16), up), bf16);
}
static void gate(const float *gu, int64_t inter, int bf16, int gelu, float *act) {
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8)
        _mm256_storeu_ps(act + i, gated8(_mm256_loadu_ps(gu + i), _mm256_loadu_ps(gu + inter + i), bf16, gelu));
    if (i < inter) {
        float g[8] = {0}, up[8] = {0}, out[8];
        memcpy(g, gu + i, sizeof(float) * (size_t)(inter - i));
        memcpy(up, gu + inter + i, sizeof(float) * (size_t)(inter - i));
        _mm256_storeu_ps(out, gated8(_mm256_loadu_ps(g), _mm256_loadu_ps(up), bf16, gelu));
        memcpy(act + i, out, sizeof(float) * (size_t)(inter - i));
    }
}

#if PAIRS_BUILT
/* The gate of a bfloat16 model in pairs, sixteen lanes at a time: exp8's, gelu8's and gated8's operations lane by
 * lane and bf16_bits8's rounding in integers, so each activation is bitwise gated8's. It writes down's input pairs
 * only: in pairs nothing reads the float activations. */
PAIRS_TARGET static inline __m512i bf16_bits16(__m512 v) { /* bf16_bits8 on sixteen lanes */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}
PAIRS_TARGET static inline __m512 rnd16(__m512 v) { return _mm512_castsi512_ps(bf16_bits16(v)); }
PAIRS_TARGET static inline __m512 gelu16(__m512 g) {
    __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                             _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u));
    __m512 size = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(0x7fffffff)));
    __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), size));
    __m512 ratio = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    __m512 tanh = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_castps_si512(ratio)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh));
}
PAIRS_TARGET static inline __m512 gated16(__m512 g, __m512 up, int gelu) { /* gated8 with bf16 rounding */
    __m512 act;
    if (gelu)
        act = gelu16(g);
    else
        act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return rnd16(_mm512_mul_ps(rnd16(act), up));
}
/* one token's activations as down's bfloat16 input, its padding to ip (a multiple of 8) zeros; converted as
 * bf16_array converts gate's floats: VCVTNEPS2BF16 sixteen at a time, a last eight by integer rounding */
PAIRS_TARGET static void gate_pairs(const float *gu, int64_t inter, int64_t ip, int gelu, uint16_t *out) {
    int64_t i = 0;
    for (; i + 16 <= ip; i += 16) {
        __m512 act;
        if (i + 16 <= inter) {
            act = gated16(_mm512_loadu_ps(gu + i), _mm512_loadu_ps(gu + inter + i), gelu);
        } else { /* padding lanes: SiLU and GELU of 0 times 0 are 0 */
            __mmask16 live = (__mmask16)((1u << (inter - i)) - 1);
            act = gated16(_mm512_maskz_loadu_ps(live, gu + i), _mm512_maskz_loadu_ps(live, gu + inter + i), gelu);
        }
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(act));
    }
    if (i < ip) { /* eight left: inter ends within them */
        __mmask16 live = (__mmask16)((1u << (inter - i)) - 1);
        __m512 act = gated16(_mm512_maskz_loadu_ps(live, gu + i), _mm512_maskz_loadu_ps(live, gu + inter + i), gelu);
        __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(act), 16));
        _mm_storeu_si128((__m128i *)(out + i), _mm256_castsi256_si128(bits));
    }
}
#else
static void gate_pairs(const float *gu, int64_t inter, int64_t ip, int gelu, uint16_t *out) {
    (void)gu, (void)inter, (void)ip, (void)gelu, (void)out;
}
#endif

typedef struct {
    const float *gu;
    float *act;
    int64_t inter, ip;
    int bf16, gelu;
    uint16_t *pairs; /* layer_pairs: down's input in pairs, filled row by row instead of act (NULL: none) */
} Gating;

static void gate_tokens(void *ctx, int64_t first, int64_t last) {
    const Gating *G = ctx;
    for (int64_t t = first; t < last; t++) {
        if (G->pairs) /* down reads its input from the pairs alone */
            gate_pairs(G->gu + t * 2 * G->inter, G->inter, G->ip, G->gelu, G->pairs + t * G->ip);
        else
            gate(G->gu + t * 2 * G->inter, G->inter, G->bf16, G->gelu, G->act + t * G->ip);
    }
}

/* The gates of m tokens (gu [m, 2 * inter] floats: gate, then up) as a bfloat16 model in pairs feeds down: out
 * [m, PAD8(inter)] bfloat16. wide: gate_pairs's sixteen lanes; else gate's eight, then bf16_array, the way the
 * layers ran before gate_pairs. For tests, which hold the two to the same bits. -1 where the CPU lacks pairs. */
int dflash_gate_pairs(const float *gu, int64_t m, int64_t inter, int gelu, int wide, uint16_t *out) {
    if (!dflash_bf16_pairs()) return -1;
    int64_t ip = PAD8(inter);
    float *act = calloc((size_t)ip, sizeof(float));
    if (!act) return 1;
    for (int64_t t = 0; t < m; t++) {
        if (wide) {
            gate_pairs(gu + t * 2 * inter, inter, ip, gelu, out + t * ip);
        } else {
            gate(gu + t * 2 * inter, inter, 2, gelu, act);
            bf16_array(act, ip, out + t * ip);
        }
    }
    free(act);
    return 0;
}

/* norm, gate/up, SiLU(gate) * up, down, and the residual into h_out */
static void mlp(const Layer *L, Pass *P, void *h_out) {
    int64_t inter = L->inter, ip = PAD8(inter), hp = PAD8(L->hidden);
    float *gu = P->part[GU];
    for (int64_t t = 0; t < P->m; t++) rms_norm(P->part[X] + t * L->hidden, L->norm2, L->eps, L->hidden, L->bf16,
                                                P->part[XN] + t * hp, L->gemma);
    product(L->gate_up, NULL, weights_of(L), P->part[XN], gu, P->m, 2 * inter, L->hidden, P->threads, P->part[BIAS]);
    Gating G = {gu, P->part[ACT], inter, ip, L->bf16, L->gelu, layer_pairs(L->bf16)};
    parallel_for(P->m, 1, P->m * inter >= 8192 ? P->threads : 1, gate_tokens, &G);
    if (G.pairs)
        product(L->down, NULL, given_pairs_of(L), (const float *)G.pairs, P->part[DOWN_OUT], P->m, L->hidden, inter,
                P->threads, P->part[BIAS]);
    else
        product(L->down, NULL, weights_of(L), P->part[ACT], P->part[DOWN_OUT], P->m, L->hidden, inter, P->threads,
                P->part[BIAS]);
    if (L->norm4) normalize_rows(L, P, L->norm4, P->part[DOWN_OUT]);
    int64_t i = 0, count = P->m * L->hidden;
    for (; i + 8 <= count; i += 8)
        store8(h_out, i, _mm256_add_ps(_mm256_loadu_ps(P->part[X] + i), _mm256_loadu_ps(P->part[DOWN_OUT] + i)), L->bf16);
    for (; i < count; i++) store(h_out, i, P->part[X][i] + P->part[DOWN_OUT][i], L->bf16);
}

/* One layer over a pass: h (model dtype) -> h_out (model dtype). Nonzero when out of memory (nothing written). */
static void layer_pass(const Layer *L, Pass *P, const void *h, void *h_out) {
    int64_t i = 0, count = P->m * L->hidden;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(P->part[X] + i, load8(h, i, L->bf16));
    for (; i < count; i++) P->part[X][i] = load(h, i, L->bf16);
    project(L, P);
    attention(L, P);
    mlp(L, P, h_out);
}

/* Reserves the pairs buffer the products of `count` layers over m rows need (bfloat16 in pairs only): inside a
 * layer nothing may fail. Nonzero when out of memory. */
static int reserve_pairs(const Layer *layers, int64_t count, int64_t m) {
    if (layers[0].bf16 != 2) return layers[0].int8 && layers[0].bf16 != 1; /* int8 tiles: in a bfloat16 layer only */
    int64_t widest = 0;
    for (int64_t i = 0; i < count; i++)
        widest = MAX(widest, MAX(PAD8(layers[i].hidden), MAX(PAD8(layers[i].heads * layers[i].d), PAD8(layers[i].inter))));
    return pairs_buffer(m * widest / 2) == NULL;
}

static int same_shape(const Layer *a, const Layer *b) {
    return a->hidden == b->hidden && a->heads == b->heads && a->kv_heads == b->kv_heads && a->d == b->d &&
           a->inter == b->inter;
}

typedef struct {
    const Layer *L;
    Pass *P;
    const void *h;
    void *h_out;
} LayerCall;

static void layer_body(void *arg) {
    LayerCall *C = arg;
    layer_pass(C->L, C->P, C->h, C->h_out);
}

/* A DFlash drafter's injected context: m rows (float32, PAD8(hidden) apart) at positions first.., each layer's
 * keys and values of them through its `kv` product, per-head key norm and RoPE, written to the layer's cache
 * (row 0) before the block runs. `out`: m * 2 * kv_heads * d floats of scratch. */
typedef struct {
    const float *x;
    int64_t m, first;
    const void *cos, *sin;
    float *out;
} Context;

static void context_kv(const Layer *L, Pass *P, const Context *X) {
    int64_t d = L->d, width = 2 * L->kv_heads * d;
    size_t elem = L->bf16 ? 2 : 4;
    product(L->kv, NULL, L->bf16, X->x, X->out, X->m, width, L->hidden, P->threads, P->part[BIAS]);
    for (int64_t t = 0; t < X->m; t++) {
        const char *cos = (const char *)X->cos + t * d * elem, *sin = (const char *)X->sin + t * d * elem;
        for (int64_t g = 0; g < L->kv_heads; g++) {
            float *k = X->out + t * width + g * d, *v = k + L->kv_heads * d, *tmp = P->part[TMP];
            if (L->k_norm) {
                rms_norm(k, L->k_norm, L->qk_eps, d, L->bf16, tmp, L->gemma);
                memcpy(k, tmp, sizeof(float) * (size_t)d);
            }
            rotate(k, cos, sin, d, L->bf16, tmp);
            for (int64_t i = 0; i < d; i++) {
                int64_t at = (g * P->capacity + X->first + t) * d + i;
                store(P->keys, at, k[i], L->bf16);
                store(P->values, at, v[i], L->bf16);
            }
        }
    }
}

typedef struct {
    const Layer *layers;
    int64_t count;
    Pass *P;
    const void *h;
    void *h_out, *spare, *keys, *values;
    int64_t cache_stride;
    size_t elem;
    float *buf;
    size_t floats;
    void *const *features;
    int64_t feature_stride; /* elements from one token's row of features to the next's */
    const Context *context; /* a drafter's, else NULL */
    const void *const *coses, *const *sines; /* RoPE tables by layer type (Layer.rope), else NULL: the pass's one */
} StackCall;

/* m rows of `width` elements (elem bytes each), back to back at src, to dst with `stride` elements between rows */
static void copy_rows(void *dst, int64_t stride, const void *src, int64_t m, int64_t width, size_t elem) {
    if (stride == width) {
        memcpy(dst, src, (size_t)(m * width) * elem);
        return;
    }
    for (int64_t t = 0; t < m; t++)
        memcpy((char *)dst + (size_t)(t * stride) * elem, (const char *)src + (size_t)(t * width) * elem,
               (size_t)width * elem);
}

static void stack_body(void *arg) {
    StackCall *C = arg;
    Pass *P = C->P;
    int64_t sizes[PARTS];
    const void *in = C->h;
    for (int64_t i = 0; i < C->count; i++) {
        void *out = (C->count - 1 - i) % 2 == 0 ? C->h_out : C->spare; /* the last layer writes h_out */
        if (i > 0 && !same_shape(&C->layers[i], &C->layers[i - 1])) memset(C->buf, 0, C->floats * sizeof(float));
        scratch_parts(&C->layers[i], P, sizes);
        cut_scratch(P, C->buf, sizes);
        P->keys = (char *)C->keys + i * C->cache_stride * C->elem;
        P->values = (char *)C->values + i * C->cache_stride * C->elem;
        if (C->context) context_kv(&C->layers[i], P, C->context);
        if (C->coses) P->cos = C->coses[C->layers[i].rope], P->sin = C->sines[C->layers[i].rope];
        layer_pass(&C->layers[i], P, in, out);
        if (C->features && C->features[i]) copy_rows(C->features[i], C->feature_stride, out, P->m,
                                                     C->layers[i].hidden, C->elem);
        in = out;
    }
}

/* h_out = layer(h) for `rows` sequences of n new tokens each (h, h_out [rows, n, hidden]; cos, sin [rows, n,
 * head_dim]): row r's tokens sit at positions starts[r].., attend causally to their row's cache, and their keys and
 * values are written there (caches [rows, kv_heads, capacity, head_dim]). The arguments after `threads` are the
 * layer's own, the same every call: norms and biases in the model dtype (NULL where absent), products as tiles,
 * sizes; `qkv_rows` (NULL: none) is added to each token's q, k and v (Pass.qkv_rows). `tree` (NULL: causal): token
 * t sees its row's cache before starts[r] - tree_back and the positions from there whose bits tree[t] sets
 * (Pass.tree; tree_back + n <= 64). Returns nonzero when out of memory or asked what it cannot do (nothing written). */
int dflash_layer(const void *h, void *h_out, int64_t rows, int64_t n, const int64_t *starts, const void *cos,
                 const void *sin, void *keys, void *values, int64_t capacity, int threads, int bf16, const void *norm1,
                 const void *norm2, float eps, const void *qkv, const void *qkv_bias, const void *q_norm,
                 const void *k_norm, float qk_eps, const void *o, const void *o_bias, const void *gate_up,
                 const void *down, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d, int64_t inter,
                 float scale, int gemma, int gelu, int64_t window, const void *norm3, const void *norm4,
                 int64_t rope, int int8, const float *qkv_rows, const uint64_t *tree, int64_t tree_back) {
    /* rope: the constants' RoPE table index, which one layer does not need (cos / sin are its own) */
    Layer L = {bf16, norm1, norm2, qkv, qkv_bias, q_norm, k_norm, o, o_bias, gate_up, down, eps, qk_eps, scale,
               hidden, heads, kv_heads, d, inter, NULL, gemma, gelu, window, norm3, norm4, rope, int8};
    if (tree && (tree_back < 0 || tree_back + n > 64)) return 1; /* a tree's visibility is one 64-bit word a token */
    for (int64_t r = 0; tree && r < rows; r++)
        if (starts[r] < tree_back) return 1;
    Pass P = {.rows = rows, .n = n, .m = rows * n, .capacity = capacity, .tree = tree, .tree_back = tree ? tree_back : 0,
              .starts = starts, .cos = cos, .sin = sin, .keys = keys, .values = values, .threads = threads,
              .qkv_rows = qkv_rows};
    set_longest(&P);
    int64_t sizes[PARTS];
    if (reserve_pairs(&L, 1, P.m)) return 1;
    float *buf = calloc(scratch_parts(&L, &P, sizes), sizeof(float));
    if (!buf) return 1;
    cut_scratch(&P, buf, sizes);
    LayerCall C = {&L, &P, h, h_out};
    with_workers(threads, layer_body, &C);
    free(buf);
    return 0;
}

/* All `count` layers of a model in one call (a Python call between layers ran cold: after a layer has streamed
 * its weights through the caches, the interpreter's own data misses them, ~60 us a layer). cos / sin: the RoPE
 * tables by layer type (Gemma3's local and global layers differ), each layer reading its own (Layer.rope). Layer i's caches start
 * i * cache_stride elements after keys / values; features[i], where not NULL, receives layer i's output, each
 * token's row `feature_stride` elements after the one before (the hidden size: back to back; several layers' outputs
 * side by side, a token's row after row: their concatenation, as a drafter reads them). The
 * layers alternate between h_out and `spare` (both [rows, n, hidden] in the model dtype), the last one ending in
 * h_out. `tree` (NULL: causal): a tree pass of n <= 64 tokens a row, token t of the pass (row-major) seeing its
 * row's cache before the pass and the pass's tokens whose bits tree[t] sets (the caller's RoPE tables place each
 * node at its depth). Returns nonzero when out of memory or asked what it cannot do (then nothing is written). */
int dflash_stack(const void *h, void *h_out, void *spare, int64_t rows, int64_t n, const int64_t *starts,
                 const void *const *cos, const void *const *sin, void *keys, void *values, int64_t cache_stride,
                 int64_t capacity, int threads, int64_t count, const Layer *layers, void *const *features,
                 int64_t feature_stride, const uint64_t *tree) {
    size_t elem = layers[0].bf16 ? 2 : 4, floats = 0;
    if (tree && n > 64) return 1; /* a tree's visibility is one 64-bit word a token */
    Pass P = {.rows = rows, .n = n, .m = rows * n, .capacity = capacity, .tree = tree, .starts = starts,
              .cos = cos[0], .sin = sin[0], .threads = threads};
    set_longest(&P);
    int64_t sizes[PARTS];
    for (int64_t i = 0; i < count; i++) floats = MAX(floats, scratch_parts(&layers[i], &P, sizes));
    if (reserve_pairs(layers, count, P.m)) return 1;
    float *buf = calloc(floats, sizeof(float)); /* one scratch for all layers: fresh pages per layer cost page faults */
    if (!buf) return 1;
    StackCall C = {layers, count, &P, h, h_out, spare, keys, values, cache_stride, elem, buf, floats, features,
                   feature_stride, NULL, cos, sin};
    with_workers(threads, stack_body, &C);
    free(buf);
    return 0;
}

/* A DFlash drafter's layers in one call, for one sequence (cache row 0): first each layer writes the keys and
 * values of the m new context rows `ctx` ([m, hidden], model dtype, at positions start - m..; cos/sin of those
 * positions in ctx_cos/ctx_sin) through its `kv` product, then the n block tokens h ([n, hidden], positions
 * start..) run through it, writing their keys and values after the context and attending to the whole cache up to
 * the block's end, the block in both directions. The block's keys and values stay past the committed length (the
 * caller does not count them). h_out, spare as in dflash_stack. Nonzero when out of memory (nothing written). */
int dflash_drafter_stack(const void *h, void *h_out, void *spare, int64_t n, int64_t start, const void *cos,
                         const void *sin, const void *ctx, int64_t m, const void *ctx_cos, const void *ctx_sin,
                         void *keys, void *values, int64_t cache_stride, int64_t capacity, int threads, int64_t count,
                         const Layer *layers) {
    int bf16 = layers[0].bf16;
    int64_t hidden = layers[0].hidden, hp = PAD8(hidden), width = 0;
    size_t elem = bf16 ? 2 : 4, floats = 0;
    Pass P = {.rows = 1, .n = n, .m = n, .capacity = capacity, .block = 1, .starts = &start, .cos = cos, .sin = sin,
              .threads = threads};
    set_longest(&P);
    int64_t sizes[PARTS];
    for (int64_t i = 0; i < count; i++) {
        floats = MAX(floats, scratch_parts(&layers[i], &P, sizes));
        width = MAX(width, 2 * layers[i].kv_heads * layers[i].d);
    }
    if (reserve_pairs(layers, count, MAX(n, m))) return 1;
    float *buf = calloc(floats + (size_t)(m * (hp + width)), sizeof(float));
    if (!buf) return 1;
    Context X = {buf + floats, m, start - m, ctx_cos, ctx_sin, buf + floats + m * hp};
    for (int64_t t = 0; t < m; t++)
        for (int64_t i = 0; i < hidden; i++) buf[floats + t * hp + i] = load(ctx, t * hidden + i, bf16);
    StackCall C = {layers, count, &P, h, h_out, spare, keys, values, cache_stride, elem, buf, floats, NULL, 0,
                   m > 0 ? &X : NULL, NULL, NULL};
    with_workers(threads, stack_body, &C);
    free(buf);
    return 0;
}
