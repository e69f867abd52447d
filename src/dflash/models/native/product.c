/* ---- a product: its panels over the threads, through tiles or the kernels; its entry points --------------------- */

/* int8 weights (INT8_PAIRS, 2 bytes a unit) expanded to bfloat16 pairs, `count` units from c0 into `wide`, the
 * stored bytes AMX_AHEAD units on requested from memory */
static void int8_expand_chunk(const char *stored, int64_t c0, int64_t count, uint32_t *wide) {
    for (int line = 0; line < PAIR_CHUNK * PANEL * 2 / 64; line++) /* a chunk AMX_AHEAD pairs on */
        _mm_prefetch(stored + (c0 + AMX_AHEAD) * PANEL * 2 + 64 * line, _MM_HINT_T0);
    int8_expand(stored + c0 * PANEL * 2, count, wide);
}
/* Whether an int8 product expands each panel whole, once for all its slices of rows, rather than a chunk at a time
 * for each slice: a pass of over 16 rows (a prompt, a batch) expanded every chunk once a slice; whole, an int8
 * SmolLM2 prompt of 300 tokens took 0.89x the time (passes of 64) and of 1024 0.79x (passes of 256; Intel Xeon
 * with AMX, two threads), bitwise the same. The panel (a few tens of KB) stays in the caches while its slices read
 * it. */
static int panel_expanded(const Product *W) { return W->kind == INT8_PAIRS && W->m > SLICE; }
/* A product's panels [first, last) in pairs through tiles, SLICE rows at a time. int8 weights (INT8_PAIRS) are
 * expanded to their bfloat16 pairs into `wide`: a chunk at a time, or each panel whole (panel_expanded). */
static void amx_panels(const Product *W, int64_t first, int64_t last, uint32_t *wide) {
    int64_t m = W->m, n = W->n, k2 = units_of(W), elem = unit_bytes(W);
    const uint32_t *x = (const uint32_t *)W->xf;
    float sums[SLICE * PANEL];
    int64_t configured = 0;
    int whole = panel_expanded(W);
    for (int64_t p = first; p < last; p++) {
        const char *stored = (const char *)W->panels + p * PANEL * k2 * elem;
        int64_t cols = MIN(PANEL, n - PANEL * p);
        for (int64_t c0 = 0; whole && c0 < k2; c0 += PAIR_CHUNK)
            int8_expand_chunk(stored, c0, MIN(PAIR_CHUNK, k2 - c0), wide + c0 * PANEL);
        for (int64_t j0 = 0; j0 < m; j0 += SLICE) {
            int64_t rows = MIN(SLICE, m - j0);
            if (rows != configured) amx_configure((int)rows), configured = rows;
            amx_zero_sums();
            if (W->kind == INT8_PAIRS && !whole)
                for (int64_t c0 = 0; c0 < k2; c0 += PAIR_CHUNK) {
                    int64_t count = MIN(PAIR_CHUNK, k2 - c0);
                    int8_expand_chunk(stored, c0, count, wide);
                    amx_units(wide, x + j0 * k2 + c0, k2, count, rows, 0);
                }
            else
                amx_units(whole ? wide : (const uint32_t *)stored, x + j0 * k2, k2, k2, rows, !whole);
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
        int64_t chunks = panel_expanded(W) ? (units_of(W) + PAIR_CHUNK - 1) / PAIR_CHUNK : 1;
        int64_t words = PANEL * PAIR_CHUNK * chunks; /* whole chunks: the last is expanded whole */
        uint32_t *expanded = W->kind == INT8_PAIRS ? (uint32_t *)widening_buffer(words) : NULL;
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
