/* ---- which kernel runs a product, and how its rows and panels are cut into work --------------------------------- */

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
