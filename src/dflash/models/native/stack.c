/* ---- a model's layers in one call (dflash_stack), and a DFlash drafter's (dflash_drafter_stack) ----------------- */

/* A DFlash drafter's injected context: m rows (float32, PAD8(hidden) apart) at positions first.., each layer's
 * keys and values of them through its `kv` product, per-head key norm and RoPE, written to the layer's cache
 * (row 0) before the block runs. `out`: m * 2 * kv_heads * d floats of scratch. */
typedef struct {
    const float *x;
    int64_t m, first;
    const void *cos, *sin;
    float *out;
} Context;

static void context_kv(const Layer *L, Pass *P, const Context *X) {
    int64_t d = L->d, width = 2 * L->kv_heads * d;
    size_t elem = L->bf16 ? 2 : 4;
    product(L->kv, NULL, L->bf16, X->x, X->out, X->m, width, L->hidden, P->threads, P->part[BIAS]);
    for (int64_t t = 0; t < X->m; t++) {
        const char *cos = (const char *)X->cos + t * d * elem, *sin = (const char *)X->sin + t * d * elem;
        for (int64_t g = 0; g < L->kv_heads; g++) {
            float *k = X->out + t * width + g * d, *v = k + L->kv_heads * d, *tmp = P->part[TMP];
            if (L->k_norm) {
                rms_norm(k, L->k_norm, L->qk_eps, d, L->bf16, tmp, L->gemma);
                memcpy(k, tmp, sizeof(float) * (size_t)d);
            }
            rotate(k, cos, sin, d, L->bf16, tmp);
            for (int64_t i = 0; i < d; i++) {
                int64_t at = (g * P->capacity + X->first + t) * d + i;
                store(P->keys, at, k[i], L->bf16);
                store(P->values, at, v[i], L->bf16);
            }
        }
    }
}

typedef struct {
    const Layer *layers;
    int64_t count;
    Pass *P;
    const void *h;
    void *h_out, *spare, *keys, *values;
    int64_t cache_stride;
    size_t elem;
    float *buf;
    size_t floats;
    void *const *features;
    int64_t feature_stride; /* elements from one token's row of features to the next's */
    const Context *context; /* a drafter's, else NULL */
    const void *const *coses, *const *sines; /* RoPE tables by layer type (Layer.rope), else NULL: the pass's one */
} StackCall;

/* m rows of `width` elements (elem bytes each), back to back at src, to dst with `stride` elements between rows */
static void copy_rows(void *dst, int64_t stride, const void *src, int64_t m, int64_t width, size_t elem) {
    if (stride == width) {
        memcpy(dst, src, (size_t)(m * width) * elem);
        return;
    }
    for (int64_t t = 0; t < m; t++)
        memcpy((char *)dst + (size_t)(t * stride) * elem, (const char *)src + (size_t)(t * width) * elem,
               (size_t)width * elem);
}

static void stack_body(void *arg) {
    StackCall *C = arg;
    Pass *P = C->P;
    int64_t sizes[PARTS];
    const void *in = C->h;
    for (int64_t i = 0; i < C->count; i++) {
        void *out = (C->count - 1 - i) % 2 == 0 ? C->h_out : C->spare; /* the last layer writes h_out */
        if (i > 0 && !same_shape(&C->layers[i], &C->layers[i - 1])) memset(C->buf, 0, C->floats * sizeof(float));
        scratch_parts(&C->layers[i], P, sizes);
        cut_scratch(P, C->buf, sizes);
        P->keys = (char *)C->keys + i * C->cache_stride * C->elem;
        P->values = (char *)C->values + i * C->cache_stride * C->elem;
        if (C->context) context_kv(&C->layers[i], P, C->context);
        if (C->coses) P->cos = C->coses[C->layers[i].rope], P->sin = C->sines[C->layers[i].rope];
        layer_pass(&C->layers[i], P, in, out);
        if (C->features && C->features[i]) copy_rows(C->features[i], C->feature_stride, out, P->m,
                                                     C->layers[i].hidden, C->elem);
        in = out;
    }
}

/* h_out = layer(h) for `rows` sequences of n new tokens each (h, h_out [rows, n, hidden]; cos, sin [rows, n,
 * head_dim]): row r's tokens sit at positions starts[r].., attend causally to their row's cache, and their keys and
 * values are written there (caches [rows, kv_heads, capacity, head_dim]). The arguments after `threads` are the
 * layer's own, the same every call: norms and biases in the model dtype (NULL where absent), products as tiles,
 * sizes; `qkv_rows` (NULL: none) is added to each token's q, k and v (Pass.qkv_rows). `tree` (NULL: causal): token
 * t sees its row's cache before starts[r] - tree_back and the positions from there whose bits tree[t] sets
 * (Pass.tree; tree_back + n <= 64). Returns nonzero when out of memory or asked what it cannot do (nothing written). */
int dflash_layer(const void *h, void *h_out, int64_t rows, int64_t n, const int64_t *starts, const void *cos,
                 const void *sin, void *keys, void *values, int64_t capacity, int threads, int bf16, const void *norm1,
                 const void *norm2, float eps, const void *qkv, const void *qkv_bias, const void *q_norm,
                 const void *k_norm, float qk_eps, const void *o, const void *o_bias, const void *gate_up,
                 const void *down, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t d, int64_t inter,
                 float scale, int gemma, int gelu, int64_t window, const void *norm3, const void *norm4,
                 int64_t rope, int int8, const float *qkv_rows, const uint64_t *tree, int64_t tree_back) {
    /* rope: the constants' RoPE table index, which one layer does not need (cos / sin are its own) */
    Layer L = {bf16, norm1, norm2, qkv, qkv_bias, q_norm, k_norm, o, o_bias, gate_up, down, eps, qk_eps, scale,
               hidden, heads, kv_heads, d, inter, NULL, gemma, gelu, window, norm3, norm4, rope, int8};
    if (tree && (tree_back < 0 || tree_back + n > 64)) return 1; /* a tree's visibility is one 64-bit word a token */
    for (int64_t r = 0; tree && r < rows; r++)
        if (starts[r] < tree_back) return 1;
    Pass P = {.rows = rows, .n = n, .m = rows * n, .capacity = capacity, .tree = tree, .tree_back = tree ? tree_back : 0,
              .starts = starts, .cos = cos, .sin = sin, .keys = keys, .values = values, .threads = threads,
              .qkv_rows = qkv_rows};
    set_longest(&P);
    int64_t sizes[PARTS];
    if (reserve_pairs(&L, 1, P.m)) return 1;
    float *buf = calloc(scratch_parts(&L, &P, sizes), sizeof(float));
    if (!buf) return 1;
    cut_scratch(&P, buf, sizes);
    LayerCall C = {&L, &P, h, h_out};
    with_workers(threads, layer_body, &C);
    free(buf);
    return 0;
}

/* All `count` layers of a model in one call (a Python call between layers ran cold: after a layer has streamed
 * its weights through the caches, the interpreter's own data misses them, ~60 us a layer). cos / sin: the RoPE
 * tables by layer type (Gemma3's local and global layers differ), each layer reading its own (Layer.rope). Layer i's caches start
 * i * cache_stride elements after keys / values; features[i], where not NULL, receives layer i's output, each
 * token's row `feature_stride` elements after the one before (the hidden size: back to back; several layers' outputs
 * side by side, a token's row after row: their concatenation, as a drafter reads them). The
 * layers alternate between h_out and `spare` (both [rows, n, hidden] in the model dtype), the last one ending in
 * h_out. `tree` (NULL: causal): a tree pass of n <= 64 tokens a row, token t of the pass (row-major) seeing its
 * row's cache before the pass and the pass's tokens whose bits tree[t] sets (the caller's RoPE tables place each
 * node at its depth). Returns nonzero when out of memory or asked what it cannot do (then nothing is written). */
int dflash_stack(const void *h, void *h_out, void *spare, int64_t rows, int64_t n, const int64_t *starts,
                 const void *const *cos, const void *const *sin, void *keys, void *values, int64_t cache_stride,
                 int64_t capacity, int threads, int64_t count, const Layer *layers, void *const *features,
                 int64_t feature_stride, const uint64_t *tree) {
    size_t elem = layers[0].bf16 ? 2 : 4, floats = 0;
    if (tree && n > 64) return 1; /* a tree's visibility is one 64-bit word a token */
    Pass P = {.rows = rows, .n = n, .m = rows * n, .capacity = capacity, .tree = tree, .starts = starts,
              .cos = cos[0], .sin = sin[0], .threads = threads};
    set_longest(&P);
    int64_t sizes[PARTS];
    for (int64_t i = 0; i < count; i++) floats = MAX(floats, scratch_parts(&layers[i], &P, sizes));
    if (reserve_pairs(layers, count, P.m)) return 1;
    float *buf = calloc(floats, sizeof(float)); /* one scratch for all layers: fresh pages per layer cost page faults */
    if (!buf) return 1;
    StackCall C = {layers, count, &P, h, h_out, spare, keys, values, cache_stride, elem, buf, floats, features,
                   feature_stride, NULL, cos, sin};
    with_workers(threads, stack_body, &C);
    free(buf);
    return 0;
}

/* A DFlash drafter's layers in one call, for one sequence (cache row 0): first each layer writes the keys and
 * values of the m new context rows `ctx` ([m, hidden], model dtype, at positions start - m..; cos/sin of those
 * positions in ctx_cos/ctx_sin) through its `kv` product, then the n block tokens h ([n, hidden], positions
 * start..) run through it, writing their keys and values after the context and attending to the whole cache up to
 * the block's end, the block in both directions. The block's keys and values stay past the committed length (the
 * caller does not count them). h_out, spare as in dflash_stack. Nonzero when out of memory (nothing written). */
int dflash_drafter_stack(const void *h, void *h_out, void *spare, int64_t n, int64_t start, const void *cos,
                         const void *sin, const void *ctx, int64_t m, const void *ctx_cos, const void *ctx_sin,
                         void *keys, void *values, int64_t cache_stride, int64_t capacity, int threads, int64_t count,
                         const Layer *layers) {
    int bf16 = layers[0].bf16;
    int64_t hidden = layers[0].hidden, hp = PAD8(hidden), width = 0;
    size_t elem = bf16 ? 2 : 4, floats = 0;
    Pass P = {.rows = 1, .n = n, .m = n, .capacity = capacity, .block = 1, .starts = &start, .cos = cos, .sin = sin,
              .threads = threads};
    set_longest(&P);
    int64_t sizes[PARTS];
    for (int64_t i = 0; i < count; i++) {
        floats = MAX(floats, scratch_parts(&layers[i], &P, sizes));
        width = MAX(width, 2 * layers[i].kv_heads * layers[i].d);
    }
    if (reserve_pairs(layers, count, MAX(n, m))) return 1;
    float *buf = calloc(floats + (size_t)(m * (hp + width)), sizeof(float));
    if (!buf) return 1;
    Context X = {buf + floats, m, start - m, ctx_cos, ctx_sin, buf + floats + m * hp};
    for (int64_t t = 0; t < m; t++)
        for (int64_t i = 0; i < hidden; i++) buf[floats + t * hp + i] = load(ctx, t * hidden + i, bf16);
    StackCall C = {layers, count, &P, h, h_out, spare, keys, values, cache_stride, elem, buf, floats, NULL, 0,
                   m > 0 ? &X : NULL, NULL, NULL};
    with_workers(threads, stack_body, &C);
    free(buf);
    return 0;
}
