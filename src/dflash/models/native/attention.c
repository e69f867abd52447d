/* ---- attention's arithmetic: scores, softmax's exponentials and value sums (FMAs, VDPBF16PS, AVX-512 registers) - */

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
/* block_scores for two queries at once (AVX-512F; two heads, or a token's last head and the next token's first):
 * each register holds eight keys' lanes for the first query in its low half and for the second in its high half,
 * each lane the same chain of FMAs as dot8's and each score the same sum of lanes (hadd's as shuffles and adds), so
 * the scores are bitwise block_scores' for half the multiply-add instructions (float32 attention's scores were most
 * of a float32 prompt's attention). The keys both read in the same eights go together, the rest as block_scores
 * takes them. */
#if PAIRS_BUILT
VALUES_TARGET static inline __m512 hadd_lanes(__m512 x, __m512 y) { /* _mm256_hadd_ps in each 128-bit lane */
    return _mm512_add_ps(_mm512_shuffle_ps(x, y, 0x88), _mm512_shuffle_ps(x, y, 0xDD));
}
VALUES_TARGET static inline __m512 dot8_two(const float *qa, const float *qb, const float *k, int64_t d) {
    __m512 a[8];
    for (int r = 0; r < 8; r++) a[r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 8) {
        __m512d both = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_loadu_ps(qa + i))),
                                          _mm256_castps_pd(_mm256_loadu_ps(qb + i)), 1);
        for (int r = 0; r < 8; r++) {
            __m512d key = _mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(k + r * d + i)));
            a[r] = _mm512_fmadd_ps(_mm512_castpd_ps(key), _mm512_castpd_ps(both), a[r]);
        }
    }
    __m512 t0 = hadd_lanes(hadd_lanes(a[0], a[1]), hadd_lanes(a[2], a[3]));
    __m512 t1 = hadd_lanes(hadd_lanes(a[4], a[5]), hadd_lanes(a[6], a[7]));
    /* dot8's last step, low 128-bit lane + high of each half: [a 0..3, b 0..3, a 4..7, b 4..7], then a's, b's */
    __m512 sum = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
    return _mm512_shuffle_f32x4(sum, sum, 0xD8);
}
VALUES_TARGET static void block_scores_two(const float *qa, const float *qb, const float *k, int64_t j0, int64_t j1,
                                           int64_t lo_a, int64_t n_a, int64_t lo_b, int64_t n_b, int64_t d,
                                           float scale, float *sa, float *sb) {
    int64_t j = MAX(j0, lo_a), stop = MIN(MIN(j1, n_a), n_b);
    for (; j == MAX(j0, lo_b) && d % 8 == 0 && j + 8 <= stop; j += 8, lo_a = lo_b = j) {
        __m512 two = _mm512_mul_ps(dot8_two(qa, qb, k + (j - j0) * d, d), _mm512_set1_ps(scale));
        _mm256_storeu_ps(sa + j, _mm512_castps512_ps256(two));
        _mm256_storeu_ps(sb + j, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(two), 1)));
    }
    /* each head's own eights and single keys after the ones they share, as block_scores goes on from there */
    int64_t a = MAX(j0, lo_a), b = MAX(j0, lo_b);
    block_scores(qa, k + (a - j0) * d, a, j1, a, n_a, d, scale, sa);
    block_scores(qb, k + (b - j0) * d, b, j1, b, n_b, d, scale, sb);
}
#else
static void block_scores_two(const float *qa, const float *qb, const float *k, int64_t j0, int64_t j1, int64_t lo_a,
                             int64_t n_a, int64_t lo_b, int64_t n_b, int64_t d, float scale, float *sa, float *sb) {
    (void)qa, (void)qb, (void)k, (void)j0, (void)j1, (void)lo_a, (void)n_a, (void)lo_b, (void)n_b, (void)d;
    (void)scale, (void)sa, (void)sb;
}
#endif
/* A setting on wherever the CPU has AVX-512F (-1 until first asked), which tests and A/B runs may turn off; turning
 * it on elsewhere changes nothing. Returns the previous setting. */
static int avx512_setting(int *setting) {
    if (*setting < 0) *setting = cpu_has_avx512f();
    return *setting;
}
static int set_avx512_setting(int *setting, int on) {
    int old = avx512_setting(setting);
    *setting = on && cpu_has_avx512f();
    return old;
}
static int scores_two = -1;          /* 0: block_scores, query by query */
static int values_in_registers = -1; /* 0: block_values */
static int scores_two_here(void) { return avx512_setting(&scores_two); }
static int values64_here(void) { return avx512_setting(&values_in_registers); }
/* Whether float32 scores go two queries at once; whether attention sums values through values64. Either way gives
 * the same outputs: for tests and A/B runs. */
int dflash_set_scores_two(int on) { return set_avx512_setting(&scores_two, on); }
int dflash_set_values_in_registers(int on) { return set_avx512_setting(&values_in_registers, on); }

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

/* A query's weights s[from..to) as pairs of bfloat16 in place: the bfloat16 array b[j] = bf16(s[j] * inverse) for
 * j in [from, to) and 0 for the other key of a boundary pair, its word m pair m (b[2m] | b[2m+1] << 16). Writing
 * b[j] at byte 2j never overtakes the reads at byte 4j. `inverse`: softmax's division by its sum, where it was left
 * to this pass (1 otherwise: exact); the product is rounded to float32, then to bfloat16, as two passes round it. */
ATTENTION_PAIRS_TARGET static void weights_as_pairs(float *s, int64_t from, int64_t to, float inverse) {
    uint16_t *b = (uint16_t *)s;
    __m512 by = _mm512_set1_ps(inverse);
    for (int64_t j = from / 2 * 2; j < to; j += 16) {
        int64_t a = MAX(from - j, 0), z = MIN(to - j, 16), end = MIN((to + 1) / 2 * 2 - j, 16);
        __mmask16 valid = (__mmask16)(((1u << z) - 1) & ~((1u << a) - 1)), room = (__mmask16)((1u << end) - 1);
        __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, s + j), by));
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
    weights_as_pairs(p, lo, count, 1.0f);
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
static void weights_as_pairs(float *s, int64_t from, int64_t to, float inverse) {
    (void)s, (void)from, (void)to, (void)inverse;
}
static void tree_value_pairs(const uint16_t *v, int64_t d, float *p, int64_t lo, int64_t count, int64_t tree_start,
                             uint64_t visible, float *out) {
    (void)v, (void)d, (void)p, (void)lo, (void)count, (void)tree_start, (void)visible, (void)out;
}
#endif
