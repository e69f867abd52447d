/* ---- a group of query heads attends: over the cache and the pass's own keys, or a tree's ------------------------ */

/* attend's value sums through values64 (d a multiple of 64): the chunk's query heads, VALUE_HEADS at a time, each
 * 64 columns at a time; token t of the chunk sums the values of keys [lo[t], seen[t]); `inverses` (in pairs; NULL:
 * none): each query head's softmax's division, left to the rounding of its weights to pairs */
static void attend_values64(Rows R, int64_t tokens, int64_t group, const void *values, int64_t at, int64_t d,
                            const int64_t *lo, const int64_t *seen, int bf16, int pairs, const float *inverses) {
    const float *p[VALUE_HEADS];
    float *out[VALUE_HEADS];
    int64_t from[VALUE_HEADS], to[VALUE_HEADS], heads = tokens * group;
    for (int64_t first = 0; first < heads; first += VALUE_HEADS) {
        int count = (int)MIN(VALUE_HEADS, heads - first);
        for (int q = 0; q < count; q++) {
            int64_t t = (first + q) / group, h = (first + q) % group;
            p[q] = R.scores + t * R.score_token + h * R.score_head;
            to[q] = seen[t], from[q] = lo[t];
            if (pairs) weights_as_pairs((float *)p[q], from[q], to[q], inverses ? inverses[first + q] : 1.0f);
        }
        for (int64_t c = 0; c < d; c += 64) {
            for (int q = 0; q < count; q++) {
                int64_t t = (first + q) / group, h = (first + q) % group;
                out[q] = R.out + t * R.out_token + h * d + c;
            }
            const void *v = bf16 ? (const void *)((const uint16_t *)values + at + c) : (const float *)values + at + c;
            if (pairs)
                value_pairs64_of[count - 1](v, d, p, from, to, out);
            else
                values64_of[bf16 != 0][count - 1](v, d, p, from, to, out);
        }
    }
}

/* A tree pass's node sees the cache's keys [0, tree_start) and, of the pass's own, its ancestors and itself (the
 * bits of `visible`). Its scores s[tree_start..n) compacted to those it sees, in order (returns where they end), so
 * that its softmax sums them in the lanes and order of a step reading the same keys in a chain: with the others
 * in between at -inf, its sums differed from the step's in the last bits, and a bfloat16 target's greedy tokens
 * from `ar`'s (3 of 3 GSM8K answers with `dflash:tree15`). expand_tree puts the weights back at their slots, zero
 * elsewhere, for value sums by slot (FMA chains over zero weights add exactly nothing). */
static int64_t compact_tree(float *s, int64_t tree_start, int64_t n, uint64_t visible) {
    int64_t k = tree_start;
    for (int64_t j = tree_start; j < n; j++)
        if (visible >> (j - tree_start) & 1) s[k++] = s[j];
    return k;
}
static void expand_tree(float *s, int64_t tree_start, int64_t n, int64_t end, uint64_t visible) {
    for (int64_t j = n - 1, k = end; j >= tree_start; j--) s[j] = visible >> (j - tree_start) & 1 ? s[--k] : 0.0f;
}

/* The `group` query heads that share kv head g, for `tokens` consecutive tokens of one row (the first attends to
 * cache positions 0..last, each next one to `step` more: 1 causally, 0 in a drafter's block, where every token
 * sees the whole block; with a sliding `window` > 0, each only to its last `window`): out = softmax(q k^T * scale) v. The cache is read in blocks
 * of KEY_BLOCK keys (then values), each block once for all of the chunk's queries: query by query, every query
 * streamed the row's whole cache from L2 (~1.5 us per query at 200 positions, SmolLM2, 2 AMD EPYC cores). Every
 * (token, head) is still computed by the same operations in the same order whatever the chunk, so a verify pass
 * gives bitwise the attention of single steps. `block`: KEY_BLOCK * d floats of scratch (bf16 widening). */
#define KEY_BLOCK 32
/* tokens per work item (attention_items; through tiles, attention_chunk's): 2 rather than 4 gives a 4-token pass 6
 * items instead of 3 on two threads; bf16 SmolLM2 after 600 tokens, three alternating runs: layers of 4- and 8-token
 * passes -4% and -3% */
#define ATTEND_CHUNK 2
static void attend(Rows R, int64_t tokens, int64_t group, const void *keys, const void *values, int64_t g,
                   int64_t capacity, int64_t d, int64_t last, int64_t step, int64_t window, float scale, int bf16,
                   float *block, const uint64_t *tree, int64_t tree_start) {
    int64_t at = g * capacity * d, longest = last + (tokens - 1) * step + 1;
    int pairs = bf16 == 2 && attention_pairs;
    uint16_t q16[pairs ? tokens * group * d : 1]; /* the queries as bfloat16 (they are bfloat16 values: exact) */
    if (pairs)
        for (int64_t t = 0; t < tokens; t++)
            for (int64_t h = 0; h < group; h++) {
                const float *q = R.q + t * R.q_token + h * d;
                uint16_t *q2 = q16 + (t * group + h) * d;
                int64_t i = 0;
                for (; i + 8 <= d; i += 8) store8(q2, i, _mm256_loadu_ps(q + i), 1);
                for (; i < d; i++) q2[i] = f32_to_bf16(q[i]);
            }
    /* token t reads the keys [from[t], seen[t]) by slot, the first `window` of them dropped (a sliding window):
     * a causal token all before it, a block's token the whole block. A tree node's chain (compact_tree) is the cache
     * before the pass, then its ancestors and itself: its window starts at the chain's key chain_lo[t], which may lie
     * among the ancestors, and it scores every key of the pass from tree_start on to compact them. */
    int64_t from[tokens], seen[tokens], chain_lo[tokens], first = longest;
    for (int64_t t = 0; t < tokens; t++) {
        seen[t] = last + t * step + 1;
        int64_t chain = tree ? tree_start + __builtin_popcountll(tree[t]) : seen[t];
        chain_lo[t] = window > 0 ? MAX(0, chain - window) : 0;
        from[t] = tree ? MIN(chain_lo[t], tree_start) : chain_lo[t];
        first = MIN(first, from[t]);
    }
    int tiles = attention_tiles_for(pairs, d);
    /* weights rounded to pairs, not a tree: softmax's division by the sum is left to that rounding
     * (weights_as_pairs), and through tiles each query's largest score comes from tile_scores: a pass over the
     * scores fewer, two through tiles */
    int late = !tree && pairs && d % 64 == 0, fused = tiles && !tree;
    float tops[fused ? tokens * group : 1], inverses[late ? tokens * group : 1];
    if (tiles)
        attend_tiles(R, tokens, group, q16, (const uint16_t *)keys + at, (const uint16_t *)values + at, d, capacity,
                     first, longest, from, seen, scale, 0, fused ? tops : NULL, NULL);
    int two = !pairs && d % 8 == 0 && scores_two_here();
    for (int64_t j0 = first / KEY_BLOCK * KEY_BLOCK; !tiles && j0 < longest; j0 += KEY_BLOCK) {
        int64_t j1 = MIN(j0 + KEY_BLOCK, longest);
        const float *k = pairs ? NULL : cache_rows(keys, at, j0, j1, d, bf16, block);
        for (int64_t i = 0; i < tokens * group; i++) { /* query i: token i / group's head i % group */
            int64_t t = i / group, u = (i + 1) / group;
            const float *q = R.q + t * R.q_token + i % group * d;
            float *s = R.scores + t * R.score_token + i % group * R.score_head;
            if (pairs)
                block_scores_pairs(q16 + i * d, (const uint16_t *)keys + at + j0 * d, j0, j1, from[t], seen[t], d,
                                   scale, s);
            else if (two && i + 1 < tokens * group) { /* this query and the next, at once */
                block_scores_two(q, R.q + u * R.q_token + (i + 1) % group * d, k, j0, j1, from[t], seen[t], from[u],
                                 seen[u], d, scale, s, R.scores + u * R.score_token + (i + 1) % group * R.score_head);
                i++;
            } else
                block_scores(q, k, j0, j1, from[t], seen[t], d, scale, s);
        }
    }
    int in_registers = d % 64 == 0 && values64_here(); /* values64 writes its sums whole, from zero */
    int tree_pairs = tree && pairs && d % 64 == 0;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < group; h++) {
            int64_t n = seen[t], lo = chain_lo[t], end = n;
            float *s = R.scores + t * R.score_token + h * R.score_head;
            if (tree) end = compact_tree(s, tree_start, n, tree[t]);
            float top = fused ? tops[t * group + h] : largest(s + lo, end - lo);
            float inverse = 1.0f / exp_shifted(s + lo, end - lo, top);
            if (late) inverses[t * group + h] = inverse;
            for (int64_t j = lo; !late && j < end; j++) s[j] *= inverse;
            if (tree_pairs) {
                (tiles ? tree_value_tiles : tree_value_pairs)((const uint16_t *)values + at, d, s, lo, end, tree_start,
                                                              tree[t], R.out + t * R.out_token + h * d);
            } else if (tree) { /* by slot, ancestors before the window weighing zero (a zero weight adds nothing) */
                for (int64_t j = tree_start; j < lo; j++) s[j] = 0.0f;
                expand_tree(s, tree_start, n, end, tree[t]);
            }
            if (!in_registers && !tree_pairs) memset(R.out + t * R.out_token + h * d, 0, sizeof(float) * (size_t)d);
        }
    if (tree_pairs) { /* summed above, node by node */
    } else if (tiles) {
        attend_tiles(R, tokens, group, q16, (const uint16_t *)keys + at, (const uint16_t *)values + at, d, capacity,
                     first, longest, from, seen, scale, 1, NULL, late ? inverses : NULL);
    } else if (in_registers || (pairs && d % 64 == 0)) {
        attend_values64(R, tokens, group, values, at, d, from, seen, bf16, pairs && d % 64 == 0,
                        late ? inverses : NULL);
    } else {
        for (int64_t j0 = first / KEY_BLOCK * KEY_BLOCK; j0 < longest; j0 += KEY_BLOCK) {
            int64_t j1 = MIN(j0 + KEY_BLOCK, longest);
            const float *v = cache_rows(values, at, j0, j1, d, bf16, block);
            for (int64_t t = 0; t < tokens; t++)
                for (int64_t h = 0; h < group; h++)
                    block_values(R.scores + t * R.score_token + h * R.score_head, v, j0, j1, from[t], seen[t],
                                 d, R.out + t * R.out_token + h * d);
        }
    }
    if (tiles) attention_tiles_release(); /* this thread's tiles go back before its products configure theirs */
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < group; h++) {
            float *out = R.out + t * R.out_token + h * d;
            int64_t i = 0;
            for (; bf16 && i + 8 <= d; i += 8) _mm256_storeu_ps(out + i, rnd8(_mm256_loadu_ps(out + i), 1));
            for (; i < d; i++) out[i] = rnd(out[i], bf16);
        }
}
