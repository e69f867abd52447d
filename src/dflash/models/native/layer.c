/* ---- one decoder layer over a few new tokens of a few sequences (decode steps, verify passes) -----------------
 * Llama / Qwen2 / Qwen3 layers: pre-norm attention with RoPE (and Qwen3's per-head q/k norms) over the KV cache,
 * each row causal over its own cache, then a SiLU-gated MLP. Why in C: between its four products a layer ran ~25 small
 * torch ops, ~0.3 ms a layer in float32 and ~0.7 in bfloat16 on 2 AMD EPYC cores, against ~0.9 ms for the products
 * of one token; here they cost microseconds. Values are rounded to bfloat16 where torch's bfloat16 forward rounds
 * them (after each op), so this agrees with torch's bfloat16 layers as closely as torch's own kernels do. */

#define PAD8(v) (((v) + 7) / 8 * 8)

typedef struct { /* one layer's own arguments, the same every call */
    int bf16;
    const void *norm1, *norm2, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *gate_up, *down;
    float eps, qk_eps, scale;
    int64_t hidden, heads, kv_heads, d, inter;
    const void *kv; /* a DFlash drafter's: the keys and values of injected context, one product (else NULL) */
    /* Gemma3: norms with a unit offset, and two more ("sandwich"): norm3 on the attention's output, norm4 on the
     * MLP's (norm2 is then the pre-MLP one); a GELU (tanh) gate; a sliding window (0: none); which of the pass's
     * RoPE tables the layer reads (its layer type's) */
    int gemma, gelu;
    int64_t window;
    const void *norm3, *norm4;
    int64_t rope;
    int int8; /* its four products' tiles hold int8 weights (the layer is bfloat16): INT8_PAIRS in a layer in pairs,
               * else INT8_WIDENED */
} Layer;

/* The kind of a layer's products, and the same with their inputs in pairs already (layer_pairs) */
static inline int weights_of(const Layer *L) { return L->int8 ? (L->bf16 == 2 ? INT8_PAIRS : INT8_WIDENED) : L->bf16; }
static inline int given_pairs_of(const Layer *L) { return L->int8 ? INT8_PAIRS_GIVEN : PAIRS_GIVEN; }

enum { X, XN, QKV, ATT, O_OUT, GU, ACT, DOWN_OUT, SCORES, ROW, TMP, BIAS, PARTS };

typedef struct { /* one pass: `rows` sequences of n new tokens (m in all), their caches, and float32 scratch */
    int64_t rows, n, m, longest, capacity;
    int block; /* 0: causal; 1: a drafter's block, each token attends to all of its row's tokens in the pass */
    /* a tree pass (NULL: none): token t sees the position tree_start + i of its row iff bit i of tree[t] is set
     * (its ancestors and itself), and every cached position before tree_start; tree_start is the pass's first
     * position less `tree_back` (an EAGLE-3 tree's depth pass: the earlier depths' nodes sit in the cache, each
     * node seeing its ancestors among them) */
    const uint64_t *tree;
    int64_t tree_back;
    const int64_t *starts;
    const void *cos, *sin;
    void *keys, *values;
    int threads;
    float *part[PARTS];
    /* added to each token's q, k and v after their product (float32, m rows of the product's width; NULL: none):
     * EAGLE-3's embedding half of its q/k/v product (HiddenHalf in methods/eagle3/head.py) */
    const float *qkv_rows;
} Pass;

/* Token t of a pass is token t % n of row t / n, at position starts[t / n] + t % n; its row's cache begins at
 * the returned byte offset. */
static inline int64_t position_of(const Pass *P, int64_t t) { return P->starts[t / P->n] + t % P->n; }
static inline int64_t row_offset(const Layer *L, const Pass *P, int64_t t) {
    return (t / P->n) * L->kv_heads * P->capacity * L->d * (L->bf16 ? 2 : 4);
}

/* The float32 scratch a layer's pass needs, as parts (sizes below) of one buffer. Rows of product inputs are
 * zero-padded to 8 columns (the buffer starts zeroed), and nothing writes into the padding, so layers of one shape
 * can reuse it. Returns the floats in all. */
static size_t scratch_parts(const Layer *L, const Pass *P, int64_t sizes[PARTS]) {
    int64_t width = (L->heads + 2 * L->kv_heads) * L->d, m = P->m;
    int64_t parts[PARTS] = {
        [X] = m * L->hidden,                     /* the residual stream */
        [XN] = m * PAD8(L->hidden),              /* normalised x, input of qkv and gate_up */
        [QKV] = m * width,                       /* rotated q, k and v */
        [ATT] = m * PAD8(L->heads * L->d),       /* attention output, input of o */
        [O_OUT] = m * L->hidden,
        [GU] = m * 2 * L->inter,
        [ACT] = m * PAD8(L->inter),              /* the gated activation, input of down */
        [DOWN_OUT] = m * L->hidden,
        [SCORES] = m * L->heads * P->longest,    /* one row per (token, head) */
        [ROW] = L->bf16 ? P->rows * L->kv_heads * ((P->n + ATTEND_CHUNK - 1) / ATTEND_CHUNK) * KEY_BLOCK * L->d
                        : 0,                     /* bf16: a widened block of the cache per work item */
        [TMP] = MAX(L->d, L->hidden),            /* one head's rotation or norm */
        [BIAS] = MAX(width, L->hidden),          /* a bias in float32 */
    };
    memcpy(sizes, parts, sizeof(parts));
    size_t floats = 0;
    for (int i = 0; i < PARTS; i++) floats += (size_t)sizes[i];
    return floats;
}

static void cut_scratch(Pass *P, float *buf, const int64_t sizes[PARTS]) {
    P->part[0] = buf;
    for (int i = 1; i < PARTS; i++) P->part[i] = P->part[i - 1] + sizes[i - 1];
}

static void set_longest(Pass *P) { /* the most cache positions any row's tokens attend to */
    P->longest = 0;
    for (int64_t r = 0; r < P->rows; r++) P->longest = MAX(P->longest, P->starts[r] + P->n);
}

/* Work on the pass's tokens one at a time, shared among the threads where the pass has enough of it (`work`
 * floats): between the products the first thread ran them alone, and the others waited (a 16-token bfloat16 pass
 * of SmolLM2: the norms and RoPE were 2.4% of its time, the other thread idle 7%; shared, the pass took 0.984x and
 * 0.989x the time, docs/data/session52). Each token is computed whole by one thread, so the results do not depend
 * on which. */
static void for_tokens(const Pass *P, int64_t work, Task task, void *ctx) {
    int threads = work >= 4096 ? P->threads : 1;
    parallel_for(P->m, MAX(1, P->m / (2 * MAX(threads, 1))), threads, task, ctx);
}

typedef struct { /* the work for_tokens shares out: a layer's pass, and the weight of its norm where it is one */
    const Layer *L;
    const Pass *P;
    const void *weight;
} TokenWork;

static void norm_tokens(void *ctx, int64_t first, int64_t last) { /* x's rows normalised into XN */
    const TokenWork *N = ctx;
    const Layer *L = N->L;
    for (int64_t t = first; t < last; t++)
        rms_norm(N->P->part[X] + t * L->hidden, N->weight, L->eps, L->hidden, L->bf16,
                 N->P->part[XN] + t * PAD8(L->hidden), L->gemma);
}

static void norm_into_xn(const Layer *L, Pass *P, const void *weight) {
    TokenWork N = {L, P, weight};
    for_tokens(P, P->m * L->hidden, norm_tokens, &N);
}

/* Each token's Qwen3 / Gemma3 per-head norms and RoPE, and its k and v into its row's cache */
static void position_tokens(void *ctx, int64_t first, int64_t last) {
    const TokenWork *N = ctx;
    const Layer *L = N->L;
    const Pass *P = N->P;
    int64_t width = (L->heads + 2 * L->kv_heads) * L->d, d = L->d;
    float *qkv = P->part[QKV], tmp[d]; /* this thread's: one head's norm or rotation */
    size_t elem = L->bf16 ? 2 : 4;
    for (int64_t t = first; t < last; t++) {
        const char *cos = (const char *)P->cos + t * d * elem, *sin = (const char *)P->sin + t * d * elem;
        for (int64_t head = 0; head < L->heads + L->kv_heads; head++) {
            float *v = qkv + t * width + head * d;
            if (L->q_norm) { /* Qwen3, Gemma3: per head, before RoPE */
                rms_norm(v, head < L->heads ? L->q_norm : L->k_norm, L->qk_eps, d, L->bf16, tmp, L->gemma);
                memcpy(v, tmp, sizeof(float) * (size_t)d);
            }
            rotate(v, cos, sin, d, L->bf16, tmp);
        }
        char *keys = (char *)P->keys + row_offset(L, P, t), *values = (char *)P->values + row_offset(L, P, t);
        for (int64_t g = 0; g < L->kv_heads; g++) { /* eight at a time: one by one, 1% of a 16-token pass */
            const float *k = qkv + t * width + (L->heads + g) * d, *v = k + L->kv_heads * d;
            int64_t at = (g * P->capacity + position_of(P, t)) * d, i = 0;
            for (; i + 8 <= d; i += 8) {
                store8(keys, at + i, _mm256_loadu_ps(k + i), L->bf16);
                store8(values, at + i, _mm256_loadu_ps(v + i), L->bf16);
            }
            for (; i < d; i++) store(keys, at + i, k[i], L->bf16), store(values, at + i, v[i], L->bf16);
        }
    }
}

/* q, k, v of every token: norm, product, Qwen3's per-head norms, RoPE; k and v written to their row's cache */
static void project(const Layer *L, Pass *P) {
    int64_t width = (L->heads + 2 * L->kv_heads) * L->d;
    float *qkv = P->part[QKV];
    norm_into_xn(L, P, L->norm1);
    /* with qkv_rows, the sums are rounded (bfloat16) once, after the rows are added, as one product would */
    product_rounded(L->qkv, L->qkv_bias, weights_of(L), P->part[XN], qkv, P->m, width, L->hidden, P->threads,
                    P->part[BIAS], L->bf16 != 0 && !P->qkv_rows);
    for (int64_t i = 0; P->qkv_rows && i < P->m * width; i++) qkv[i] = rnd(qkv[i] + P->qkv_rows[i], L->bf16);
    TokenWork N = {L, P, NULL};
    for_tokens(P, P->m * (L->heads + L->kv_heads) * L->d, position_tokens, &N);
}

/* Attention, in work items of (row, kv head, a chunk of up to `chunk` of the row's tokens) shared among the
 * threads. Then o and the residual. */
typedef struct {
    const Layer *L;
    Pass *P;
    int64_t chunk, chunks;
    int tiles; /* attention through tiles: items need no widened block of the cache ([ROW], sized for ATTEND_CHUNK) */
    uint16_t *pairs; /* layer_pairs: o's input in pairs, filled by the items (NULL: none) */
} Attention;

static void attention_items(void *ctx, int64_t first, int64_t last) {
    const Attention *A = ctx;
    const Layer *L = A->L;
    Pass *P = A->P;
    int64_t width = (L->heads + 2 * L->kv_heads) * L->d, group = L->heads / L->kv_heads, ap = PAD8(L->heads * L->d);
    for (int64_t item = first; item < last; item++) {
        int64_t r = item / (L->kv_heads * A->chunks), g = item / A->chunks % L->kv_heads, c = item % A->chunks;
        int64_t t = r * P->n + c * A->chunk, head = g * group; /* the chunk's first token in the pass */
        int64_t tokens = MIN(A->chunk, P->n - c * A->chunk);
        Rows R = {.q = P->part[QKV] + t * width + head * L->d, .q_token = width,
                  .scores = P->part[SCORES] + (t * L->heads + head) * P->longest, .score_token = L->heads * P->longest,
                  .score_head = P->longest, .out = P->part[ATT] + t * ap + head * L->d, .out_token = ap};
        int whole = P->block || P->tree; /* every token's range reaches the pass's last key */
        int64_t last = whole ? P->starts[r] + P->n - 1 : position_of(P, t);
        attend(R, tokens, group, (const char *)P->keys + row_offset(L, P, t), (const char *)P->values + row_offset(L, P, t),
               g, P->capacity, L->d, last, !whole, L->window, L->scale, L->bf16,
               A->tiles ? NULL : P->part[ROW] + item * KEY_BLOCK * L->d, P->tree ? P->tree + t : NULL,
               P->starts[r] - P->tree_back);
        for (int64_t i = 0; A->pairs && i < tokens; i++)
            bf16_array(R.out + i * R.out_token, group * L->d, A->pairs + (t + i) * ap + head * L->d);
    }
}

/* Gemma's sandwich norms: each of the pass's m rows of `rows` (hidden floats apart) normalised in place */
static void normalize_rows(const Layer *L, Pass *P, const void *weight, float *rows) {
    for (int64_t t = 0; t < P->m; t++) {
        rms_norm(rows + t * L->hidden, weight, L->eps, L->hidden, L->bf16, P->part[TMP], L->gemma);
        memcpy(rows + t * L->hidden, P->part[TMP], sizeof(float) * (size_t)L->hidden);
    }
}

/* Tokens a work item: ATTEND_CHUNK, or through tiles as many as make up to 16 queries (a tile's rows or columns;
 * the keys' tiles and the values' interleaving then serve them all), though no fewer items than two a thread where
 * the pass has enough tokens for it. A token's attention is the same whatever its chunk. */
static int64_t attention_chunk(const Layer *L, const Pass *P, int tiles) {
    if (!tiles) return ATTEND_CHUNK;
    int64_t most = MAX(1, 16 / (L->heads / L->kv_heads)); /* tokens whose queries fill a tile */
    int64_t chunks = (2 * P->threads + P->rows * L->kv_heads - 1) / (P->rows * L->kv_heads);
    chunks = MAX(chunks, (P->n + most - 1) / most);
    return (P->n + chunks - 1) / chunks; /* as even as they come: 16 tokens 4 x 4, not 5, 5, 5 and 1 */
}

static void attention(const Layer *L, Pass *P) {
    int tiles = attention_tiles_for(L->bf16 == 2 && attention_pairs, L->d);
    int64_t chunk = attention_chunk(L, P, tiles), chunks = (P->n + chunk - 1) / chunk;
    int64_t items = P->rows * L->kv_heads * chunks;
    Attention A = {L, P, chunk, chunks, tiles, layer_pairs(L->bf16)};
    int worth_threads = P->m * L->heads * P->longest * L->d > 16384;
    parallel_for(items, 1, worth_threads ? P->threads : 1, attention_items, &A);
    int64_t width = L->heads * L->d, ap = PAD8(width);
    if (A.pairs) {
        for (int64_t t = 0; ap > width && t < P->m; t++) memset(A.pairs + t * ap + width, 0, 2 * (size_t)(ap - width));
        product(L->o, L->o_bias, given_pairs_of(L), (const float *)A.pairs, P->part[O_OUT], P->m, L->hidden, width,
                P->threads, P->part[BIAS]);
    } else {
        product(L->o, L->o_bias, weights_of(L), P->part[ATT], P->part[O_OUT], P->m, L->hidden, width, P->threads,
                P->part[BIAS]);
    }
    if (L->norm3) normalize_rows(L, P, L->norm3, P->part[O_OUT]);
    add_rounded(P->part[X], P->part[O_OUT], P->part[X], P->m * L->hidden, L->bf16);
}

/* GELU with the tanh approximation: g / 2 (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), tanh(z) = sign(z) (1 - e) /
 * (1 + e) with e = exp(-2 |z|), in (0, 1]: no overflow, and near z = 0 an absolute error of a few 1e-8 on 1 + tanh */
static inline __m256 gelu8(__m256 g) {
    __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                             _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g));
    __m256 sign = _mm256_and_ps(z, _mm256_set1_ps(-0.0f)), size = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), z);
    __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), size));
    __m256 tanh = _mm256_or_ps(sign, _mm256_div_ps(_mm256_sub_ps(_mm256_set1_ps(1.0f), e),
                                                   _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), _mm256_add_ps(_mm256_set1_ps(1.0f), tanh));
}

/* act = SiLU(gate) * up (or GELU(gate) * up) over one token's gate/up output (gate, then up: `inter` floats each),
 * rounded where torch's bfloat16 ops round; eight lanes at a time, the tail through the same lanes */
static inline __m256 gated8(__m256 g, __m256 up, int bf16, int gelu) {
    __m256 act = gelu ? gelu8(g)
                      : _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(_mm256_setzero_ps(), g))));
    return rnd8(_mm256_mul_ps(rnd8(act, bf16), up), bf16);
}
static void gate(const float *gu, int64_t inter, int bf16, int gelu, float *act) {
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8)
        _mm256_storeu_ps(act + i, gated8(_mm256_loadu_ps(gu + i), _mm256_loadu_ps(gu + inter + i), bf16, gelu));
    if (i < inter) {
        float g[8] = {0}, up[8] = {0}, out[8];
        memcpy(g, gu + i, sizeof(float) * (size_t)(inter - i));
        memcpy(up, gu + inter + i, sizeof(float) * (size_t)(inter - i));
        _mm256_storeu_ps(out, gated8(_mm256_loadu_ps(g), _mm256_loadu_ps(up), bf16, gelu));
        memcpy(act + i, out, sizeof(float) * (size_t)(inter - i));
    }
}

#if PAIRS_BUILT
/* The gate of a bfloat16 model in pairs, sixteen lanes at a time: exp8's, gelu8's and gated8's operations lane by
 * lane and bf16_bits8's rounding in integers, so each activation is bitwise gated8's. It writes down's input pairs
 * only: in pairs nothing reads the float activations. */
PAIRS_TARGET static inline __m512i bf16_bits16(__m512 v) { /* bf16_bits8 on sixteen lanes */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    return _mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u));
}
PAIRS_TARGET static inline __m512 rnd16(__m512 v) { return _mm512_castsi512_ps(bf16_bits16(v)); }
PAIRS_TARGET static inline __m512 gelu16(__m512 g) {
    __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                             _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), g), _mm512_mul_ps(g, g), g));
    __m512i sign = _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u));
    __m512 size = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32(0x7fffffff)));
    __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-2.0f), size));
    __m512 ratio = _mm512_div_ps(_mm512_sub_ps(_mm512_set1_ps(1.0f), e), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
    __m512 tanh = _mm512_castsi512_ps(_mm512_or_si512(sign, _mm512_castps_si512(ratio)));
    return _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(_mm512_set1_ps(1.0f), tanh));
}
PAIRS_TARGET static inline __m512 gated16(__m512 g, __m512 up, int gelu) { /* gated8 with bf16 rounding */
    __m512 act;
    if (gelu)
        act = gelu16(g);
    else
        act = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), g))));
    return rnd16(_mm512_mul_ps(rnd16(act), up));
}
/* one token's activations as down's bfloat16 input, its padding to ip (a multiple of 8) zeros; converted as
 * bf16_array converts gate's floats: VCVTNEPS2BF16 sixteen at a time, a last eight by integer rounding */
PAIRS_TARGET static void gate_pairs(const float *gu, int64_t inter, int64_t ip, int gelu, uint16_t *out) {
    int64_t i = 0;
    for (; i + 16 <= ip; i += 16) {
        __m512 act;
        if (i + 16 <= inter) {
            act = gated16(_mm512_loadu_ps(gu + i), _mm512_loadu_ps(gu + inter + i), gelu);
        } else { /* padding lanes: SiLU and GELU of 0 times 0 are 0 */
            __mmask16 live = (__mmask16)((1u << (inter - i)) - 1);
            act = gated16(_mm512_maskz_loadu_ps(live, gu + i), _mm512_maskz_loadu_ps(live, gu + inter + i), gelu);
        }
        _mm256_storeu_si256((__m256i *)(out + i), (__m256i)_mm512_cvtneps_pbh(act));
    }
    if (i < ip) { /* eight left: inter ends within them */
        __mmask16 live = (__mmask16)((1u << (inter - i)) - 1);
        __m512 act = gated16(_mm512_maskz_loadu_ps(live, gu + i), _mm512_maskz_loadu_ps(live, gu + inter + i), gelu);
        __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(act), 16));
        _mm_storeu_si128((__m128i *)(out + i), _mm256_castsi256_si128(bits));
    }
}
#else
static void gate_pairs(const float *gu, int64_t inter, int64_t ip, int gelu, uint16_t *out) {
    (void)gu, (void)inter, (void)ip, (void)gelu, (void)out;
}
#endif

typedef struct {
    const float *gu;
    float *act;
    int64_t inter, ip;
    int bf16, gelu;
    uint16_t *pairs; /* layer_pairs: down's input in pairs, filled row by row instead of act (NULL: none) */
} Gating;

static void gate_tokens(void *ctx, int64_t first, int64_t last) {
    const Gating *G = ctx;
    for (int64_t t = first; t < last; t++) {
        if (G->pairs) /* down reads its input from the pairs alone */
            gate_pairs(G->gu + t * 2 * G->inter, G->inter, G->ip, G->gelu, G->pairs + t * G->ip);
        else
            gate(G->gu + t * 2 * G->inter, G->inter, G->bf16, G->gelu, G->act + t * G->ip);
    }
}

/* The gates of m tokens (gu [m, 2 * inter] floats: gate, then up) as a bfloat16 model in pairs feeds down: out
 * [m, PAD8(inter)] bfloat16. wide: gate_pairs's sixteen lanes; else gate's eight, then bf16_array, the way the
 * layers ran before gate_pairs. For tests, which hold the two to the same bits. -1 where the CPU lacks pairs. */
int dflash_gate_pairs(const float *gu, int64_t m, int64_t inter, int gelu, int wide, uint16_t *out) {
    if (!dflash_bf16_pairs()) return -1;
    int64_t ip = PAD8(inter);
    float *act = calloc((size_t)ip, sizeof(float));
    if (!act) return 1;
    for (int64_t t = 0; t < m; t++) {
        if (wide) {
            gate_pairs(gu + t * 2 * inter, inter, ip, gelu, out + t * ip);
        } else {
            gate(gu + t * 2 * inter, inter, 2, gelu, act);
            bf16_array(act, ip, out + t * ip);
        }
    }
    free(act);
    return 0;
}

/* norm, gate/up, SiLU(gate) * up, down, and the residual into h_out */
static void mlp(const Layer *L, Pass *P, void *h_out) {
    int64_t inter = L->inter, ip = PAD8(inter);
    float *gu = P->part[GU];
    norm_into_xn(L, P, L->norm2);
    product(L->gate_up, NULL, weights_of(L), P->part[XN], gu, P->m, 2 * inter, L->hidden, P->threads, P->part[BIAS]);
    Gating G = {gu, P->part[ACT], inter, ip, L->bf16, L->gelu, layer_pairs(L->bf16)};
    parallel_for(P->m, 1, P->m * inter >= 8192 ? P->threads : 1, gate_tokens, &G);
    if (G.pairs)
        product(L->down, NULL, given_pairs_of(L), (const float *)G.pairs, P->part[DOWN_OUT], P->m, L->hidden, inter,
                P->threads, P->part[BIAS]);
    else
        product(L->down, NULL, weights_of(L), P->part[ACT], P->part[DOWN_OUT], P->m, L->hidden, inter, P->threads,
                P->part[BIAS]);
    if (L->norm4) normalize_rows(L, P, L->norm4, P->part[DOWN_OUT]);
    int64_t i = 0, count = P->m * L->hidden;
    for (; i + 8 <= count; i += 8)
        store8(h_out, i, _mm256_add_ps(_mm256_loadu_ps(P->part[X] + i), _mm256_loadu_ps(P->part[DOWN_OUT] + i)), L->bf16);
    for (; i < count; i++) store(h_out, i, P->part[X][i] + P->part[DOWN_OUT][i], L->bf16);
}

/* One layer over a pass: h (model dtype) -> h_out (model dtype). Nonzero when out of memory (nothing written). */
static void layer_pass(const Layer *L, Pass *P, const void *h, void *h_out) {
    int64_t i = 0, count = P->m * L->hidden;
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(P->part[X] + i, load8(h, i, L->bf16));
    for (; i < count; i++) P->part[X][i] = load(h, i, L->bf16);
    project(L, P);
    attention(L, P);
    mlp(L, P, h_out);
}

/* Reserves the pairs buffer the products of `count` layers over m rows need (bfloat16 in pairs only): inside a
 * layer nothing may fail. Nonzero when out of memory. */
static int reserve_pairs(const Layer *layers, int64_t count, int64_t m) {
    if (layers[0].bf16 != 2) return layers[0].int8 && layers[0].bf16 != 1; /* int8 tiles: in a bfloat16 layer only */
    int64_t widest = 0;
    for (int64_t i = 0; i < count; i++)
        widest = MAX(widest, MAX(PAD8(layers[i].hidden), MAX(PAD8(layers[i].heads * layers[i].d), PAD8(layers[i].inter))));
    return pairs_buffer(m * widest / 2) == NULL;
}

static int same_shape(const Layer *a, const Layer *b) {
    return a->hidden == b->hidden && a->heads == b->heads && a->kv_heads == b->kv_heads && a->d == b->d &&
           a->inter == b->inter;
}

typedef struct {
    const Layer *L;
    Pass *P;
    const void *h;
    void *h_out;
} LayerCall;

static void layer_body(void *arg) {
    LayerCall *C = arg;
    layer_pass(C->L, C->P, C->h, C->h_out);
}
