/* ---- the int8 screen in integers (AVX512-VNNI) --------------------------------------------------------------------
 * The float kernel (screen.c) widens every int8 weight to float32 for an FMA: at 8-16 rows the screen is bound by those
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
