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
