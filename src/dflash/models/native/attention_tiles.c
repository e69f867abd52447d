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
 * those keys' rows (16 dimension pairs), 5 the queries' pairs; a head of 64 keeps its queries' two tiles in 1 and
 * 2, loads keys into 3 and 4, and sums the next block in 5 and 7 while the registers store this one's scores.
 * Value sums: tiles 0-3 a quarter of 64 columns each (value_rows' order), 4 the queries' weights (16 key pairs;
 * rows past the queries hold stale words, and their sums are never stored), 5, 6 and 7 in turn 16 key pairs of
 * values for 16 columns. */
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

/* Rows r0..r0+15 of a [.][16] block, transposed: col[n] lane i = sums[r0 + i][n] (unpacks within 128-bit lanes,
 * then 128-bit lanes shuffled: 64 shuffles for 256 floats, against 16 gathers of a column each) */
ATTENTION_TILES_TARGET static inline void transpose16(const float (*sums)[16], __m512 *col) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        __m512 a = _mm512_loadu_ps(sums[i]), b = _mm512_loadu_ps(sums[i + 1]);
        t[i] = _mm512_unpacklo_ps(a, b), t[i + 1] = _mm512_unpackhi_ps(a, b);
    }
    for (int g = 0; g < 16; g += 4) { /* u[g + k]: rows g..g + 3 of columns 4 L + k, lane L */
        __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
        __m512d c = _mm512_castps_pd(t[g + 2]), e = _mm512_castps_pd(t[g + 3]);
        u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c)), u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, e)), u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, e));
    }
    for (int k = 0; k < 4; k++) {
        __m512 x0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88), x1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
        __m512 y0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        __m512 y1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
        col[k] = _mm512_shuffle_f32x4(x0, y0, 0x88), col[8 + k] = _mm512_shuffle_f32x4(x0, y0, 0xDD);
        col[4 + k] = _mm512_shuffle_f32x4(x1, y1, 0x88), col[12 + k] = _mm512_shuffle_f32x4(x1, y1, 0xDD);
    }
}

/* Keys j0 .. j0 + 31 as tiles read them: the cache's rows, or past its capacity a zero-padded copy in `tail` */
static inline const uint16_t *block_keys(const uint16_t *keys, int64_t j0, int64_t d, int64_t capacity,
                                         int64_t longest, uint16_t *tail) {
    const uint16_t *k = keys + j0 * d;
    if (j0 + 32 > capacity) {
        memset(tail, 0, sizeof(uint16_t) * (size_t)(32 * d));
        memcpy(tail, k, sizeof(uint16_t) * (size_t)((MIN(longest, capacity) - j0) * d));
        k = tail;
    }
    TOUCHES(k);
    return k;
}

/* A block's sums (sums[r][n]: key j0 + r, query n) scaled into each query's scores where it reads the key, and
 * into its running maxima */
ATTENTION_TILES_TARGET static inline void store_scores(float (*sums)[16], int64_t j0, int queries,
                                                       const int64_t *from, const int64_t *seen, float scale,
                                                       float *const *s, __m512 *tops) {
    const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                              _mm512_set1_epi32(16));
    int transposed = queries > 4; /* a step's 3 queries: three gathers cost less than a transposition */
    TOUCHES(sums);
    int whole = transposed; /* every query reads all 32 keys: no masks */
    for (int n = 0; whole && n < queries; n++) whole = from[n] <= j0 && j0 + 32 <= seen[n];
    for (int64_t h = 0; whole && h < 32; h += 16) {
        __m512 col[16];
        transpose16((const float (*)[16])sums[h], col);
        for (int n = 0; n < queries; n++) {
            __m512 scores = _mm512_mul_ps(col[n], _mm512_set1_ps(scale));
            _mm512_storeu_ps(s[n] + j0 + h, scores);
            tops[n] = _mm512_max_ps(scores, tops[n]);
        }
    }
    for (int64_t h = 0; !whole && h < 32; h += 16) {
        __m512 col[16];
        if (transposed) transpose16((const float (*)[16])sums[h], col);
        for (int n = 0; n < queries; n++) {
            int64_t a = MAX(j0 + h, from[n]) - j0 - h, z = MIN(j0 + h + 16, seen[n]) - j0 - h;
            if (a >= z) continue;
            __mmask16 valid = (__mmask16)(((1u << z) - 1) & ~((1u << a) - 1));
            __m512 scores = transposed ? col[n] : _mm512_i32gather_ps(
                _mm512_add_epi32(column, _mm512_set1_epi32(n)), &sums[h][0], 4);
            scores = _mm512_mul_ps(scores, _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(s[n] + j0 + h, valid, scores);
            tops[n] = _mm512_mask_max_ps(tops[n], valid, scores, tops[n]);
        }
    }
}

/* A block of 32 keys (k) against the queries held in tiles 1 and 2 (a head of 64), into tiles X (keys 0..15) and Y
 * (16..31), each summing dimension pairs 0..15, then 16..31, as the general loop does */
#define SCORE_BLOCK64(X, Y, k)                                                                                        \
    do {                                                                                                              \
        _tile_zero(X);                                                                                                \
        _tile_zero(Y);                                                                                                \
        _tile_loadd(3, (k), d * 2);                                                                                   \
        _tile_loadd(4, (k) + 16 * d, d * 2);                                                                          \
        _tile_dpbf16ps(X, 3, 1);                                                                                      \
        _tile_dpbf16ps(Y, 4, 1);                                                                                      \
        _tile_loadd(3, (k) + 32, d * 2);                                                                              \
        _tile_loadd(4, (k) + 16 * d + 32, d * 2);                                                                     \
        _tile_dpbf16ps(X, 3, 2);                                                                                      \
        _tile_dpbf16ps(Y, 4, 2);                                                                                      \
    } while (0)

/* s[n][j] = q_n . k_j * scale for up to 16 queries (bfloat16 rows q[n]) and their keys j in [from[n], seen[n]),
 * keys read 32 at a time from first / 16 * 16 to `longest` (keys: key 0's row, d apart, `capacity` rows of them).
 * A block past the capacity is copied, zero-padded, so no read leaves the cache; the scores of keys past `longest`
 * (stale or never written) are not stored. `top` (NULL: none): each query's largest stored score (NaNs skipped, as
 * `largest` skips them), taken from the registers as they are stored, so softmax need not read the scores for it.
 * A head of 64 keeps its queries in tiles and the next block's products in flight while the registers store a
 * block's scores (blocks summed in tiles 6 and 0, 5 and 7, in turn). */
ATTENTION_TILES_TARGET static void tile_scores(const uint16_t *const *q, int queries, const uint16_t *keys, int64_t d,
                                               int64_t capacity, int64_t first, int64_t longest,
                                               const int64_t *from, const int64_t *seen, float scale,
                                               float *const *s, float *top) {
    int64_t parts = d / 32; /* blocks of 16 dimension pairs */
    uint32_t dims[parts][16][16]; /* dims[c][i][n]: pair 16 c + i of query n */
    uint16_t tail[32 * d];
    float sums[32][16]; /* sums[r][n]: key j0 + r, query n */
    __m512 tops[16];
    memset(dims, 0, sizeof dims);
    for (int n = 0; n < queries; n++) {
        tops[n] = _mm512_set1_ps(-INFINITY);
        for (int64_t i = 0; i < d / 2; i++) dims[i / 16][i % 16][n] = word_at(q[n], i);
    }
    TOUCHES(dims);
    int64_t j0 = first / 16 * 16;
    int resident = parts == 2;
    if (resident) {
        _tile_loadd(1, dims[0], 64);
        _tile_loadd(2, dims[1], 64);
        if (j0 < longest) SCORE_BLOCK64(6, 0, block_keys(keys, j0, d, capacity, longest, tail));
        while (j0 < longest) {
            int64_t next = j0 + 32, after = j0 + 64;
            if (next < longest) SCORE_BLOCK64(5, 7, block_keys(keys, next, d, capacity, longest, tail));
            _tile_stored(6, sums, 64);
            _tile_stored(0, sums[16], 64);
            store_scores(sums, j0, queries, from, seen, scale, s, tops);
            if (next >= longest) break;
            if (after < longest) SCORE_BLOCK64(6, 0, block_keys(keys, after, d, capacity, longest, tail));
            _tile_stored(5, sums, 64);
            _tile_stored(7, sums[16], 64);
            store_scores(sums, next, queries, from, seen, scale, s, tops);
            j0 = after;
        }
    }
    for (; !resident && j0 < longest; j0 += 32) { /* any head: the queries' tiles loaded for each block */
        const uint16_t *k = block_keys(keys, j0, d, capacity, longest, tail);
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
        store_scores(sums, j0, queries, from, seen, scale, s, tops);
    }
    for (int n = 0; top && n < queries; n++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, tops[n]);
        top[n] = -INFINITY;
        for (int i = 0; i < 16; i++) top[n] = lanes[i] > top[n] ? lanes[i] : top[n];
    }
}
#undef SCORE_BLOCK64

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
            /* tiles 5, 6 and 7 in turn: a load need not wait for the product before it to finish reading its tile */
            _tile_loadd(5, pairs[0], 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, pairs[1], 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, pairs[2], 64);
            _tile_dpbf16ps(2, 4, 7);
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
                                                int values_now, float *tops, const float *inverses) {
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
            if (values_now) weights_as_pairs(s[n], lo[n], hi[n], inverses ? inverses[q0 + n] : 1.0f);
        }
        attention_tiles_configure();
        if (values_now)
            tile_values(values, d, count, (const float *const *)s, lo, hi, INT64_MAX, NULL, out);
        else
            tile_scores(q, count, keys, d, capacity, first, longest, lo, hi, scale, s, tops ? tops + q0 : NULL);
    }
}

/* A tree node's value sums through tiles: its chain (compact_tree), as a step reading the same keys would sum them */
ATTENTION_TILES_TARGET static void tree_value_tiles(const uint16_t *v, int64_t d, float *p, int64_t lo, int64_t count,
                                                    int64_t tree_start, uint64_t visible, float *out) {
    int64_t slot[64];
    chain_slots(tree_start, visible, slot);
    weights_as_pairs(p, lo, count, 1.0f);
    attention_tiles_configure();
    tile_values(v, d, 1, (const float *const *)&p, &lo, &count, tree_start, slot, &out);
}
#else
static const int attention_tiles = 0;
static int attention_tiles_for(int pairs, int64_t d) { return (void)pairs, (void)d, 0; }
static void attend_tiles(Rows R, int64_t tokens, int64_t group, const uint16_t *q16, const uint16_t *keys,
                         const uint16_t *values, int64_t d, int64_t capacity, int64_t first, int64_t longest,
                         const int64_t *from, const int64_t *seen, float scale, int values_now, float *tops,
                         const float *inverses) {
    (void)R, (void)tokens, (void)group, (void)q16, (void)keys, (void)values, (void)d, (void)capacity, (void)first;
    (void)longest, (void)from, (void)seen, (void)scale, (void)values_now, (void)tops, (void)inverses;
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
