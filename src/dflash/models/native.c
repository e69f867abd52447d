/* Our CPU kernels: products y[m, n] = x[m, k] . w[n, k]^T (+ bias[n]) for the few rows of a decode step or a verify
 * pass, greedy tokens through a screen of the LM head, and whole decoder layers over a few new tokens of a few
 * sequences, on AVX2 + FMA, and on AVX-512, AVX512-BF16, VNNI and AMX where the CPU has them.
 *
 * Why: such a product is bound by reading w once from memory. oneDNN's and MKL's kernels reached 13-14 GB/s on
 * SmolLM2-135M's 1-7 MB matrices where a plain read of the same bytes reached 23 GB/s (2 threads, AMD EPYC); the
 * panel loop reaches 20-24 GB/s in float32 and 18-20 in bfloat16 (12 row by row).
 *
 * The weight is laid out once in "tiles" (native.py): padded with zeros to a multiple of 24 rows and 8 columns, then
 * cut into panels of 24 rows (output columns), each stored input by input (the 24 weights of input i side by side).
 * A panel is then read as ONE sequential stream, which the hardware prefetcher follows at full speed; rows read side
 * by side as separate short streams (1-2 KB each) were not. Up to four input rows run against a panel at once (twelve
 * accumulators), so it is read from memory once and a verify pass is bound by the FMAs. bfloat16 weights are
 * widened to float32 (a shift) and all sums are float32, like torch's own bfloat16 products; a bfloat16 result is
 * rounded once, to nearest even.
 * Threads split the output rows in chunks that each thread claims (one OpenMP region per call: native/threads.c).
 *
 * ONE translation unit: the parts below are included in this order, each using what the parts before it define, so
 * that the compiler sees every call and inlines across them (none compiles alone). Built and loaded by native.py,
 * which hashes the parts with this file; every caller falls back to torch's kernels where this cannot be built.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native/threads.c"          /* one OpenMP region per call; work any thread claims, chunk by chunk */
#include "native/lanes.c"            /* horizontal sums; bfloat16 <-> float32 */
#include "native/panels.c"           /* the product over panels in AVX2 (float32, bfloat16 and int8 widened) */
#include "native/pairs.c"            /* bfloat16 and int8 weights in pairs (AVX512-BF16); float32 in AVX-512 */
#include "native/kernels.c"          /* the kernel for each kind of weight; rows and panels cut into work */
#include "native/amx.c"              /* products in pairs through AMX tiles */
#include "native/product.c"          /* a product over the threads: dflash_linear_f32 / _bf16 */
#include "native/screen.c"           /* greedy tokens through a screen of the LM head (float kernels) */
#include "native/screen_integers.c"  /* the int8 screen in integers: VNNI, AMX-INT8 */
#include "native/screen_survivors.c" /* the screen's bound; the float32 logits of the tokens that may win */
#include "native/norms.c"            /* a layer's rounding, norms, RoPE and rounded products */
#include "native/attention.c"        /* scores, softmax and value sums */
#include "native/attention_tiles.c"  /* attention through AMX tiles */
#include "native/attend.c"           /* query heads over the cache and the pass, or a tree */
#include "native/layer.c"            /* one decoder layer (Llama, Qwen, Gemma3) over a pass */
#include "native/stack.c"            /* every layer in one call; a DFlash drafter's layers */
