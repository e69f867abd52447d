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
