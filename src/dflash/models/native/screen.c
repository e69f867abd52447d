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
