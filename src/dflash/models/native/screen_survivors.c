/* ---- the screen's logits, its bound, and the float32 logits of the tokens that may win -------------------------- */

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
