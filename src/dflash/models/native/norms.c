/* ---- a layer's smaller operations: rounding to the model's dtype, norms, RoPE, products rounded ---------------------
 * (the layer itself: layer.c) */

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
