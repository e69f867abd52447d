/* ---- bfloat16 pairs through AMX tiles, where the CPU has them (Intel Sapphire Rapids and later) -------------------
 * A verify pass of 8-16 bfloat16 tokens is bound by its multiply-adds even in pairs: VDPBF16PS does 16 an
 * instruction, and a 16-token pass of SmolLM2 took 1.9-2.9x a step (Intel Xeon, family 6 model 207, 2 threads). One
 * TDPBF16PS multiplies a tile of up to 16 rows by 16 input pairs against 16 pairs of 16 columns: 8192 multiply-adds.
 * The pairs layout is already what it reads: for 16 input pairs, a panel's columns 0-15 are a tile of 16 rows of 64
 * bytes, 96 bytes apart, and columns 16-23 one of 32-byte rows. So the same tiles serve both kernels, and a product
 * of 1-16 rows reads its weight once at about the memory's speed (a standalone harness over SmolLM2's 212 MB of
 * decoder products, 2 threads: 9.1-10.6 ms at 1-16 rows, where a plain read of the bytes took 9.9 and VDPBF16PS
 * 17-22 ms at one row and 45-86 at sixteen).
 * TDPBF16PS does not sum as a chain of VDPBF16PS: the 32 products of a block meet the sum once, not pair by pair
 * (measured: 40% of outputs differ in their last bits). So a model either runs ALL its products in pairs through
 * tiles or none (dflash_set_amx, switched between passes, never inside one), and every output is ONE sequence of
 * blocks of 16 input pairs, in order, whatever the number of rows: a row's sums never depend on the other rows of its
 * tile (tests/test_native.py), so verifying k tokens still gives bitwise the logits of k steps. Inputs past k (the
 * tiles' zero padding to 8, then zeros to a whole block) add exact zeros. The screen's survivors (chain_dot_amx8)
 * are summed by the same blocks. */
/* How far ahead, in input pairs, a product through tiles requests the weights it will read from memory (int8: the
 * stored bytes of the chunk that far on, not the chunk expanded into L1). 64 (6 KB of bfloat16 ahead, into the next
 * panel near a panel's end): SmolLM2's decoder products from memory in a standalone harness (2 threads, Intel Xeon
 * family 6 model 207) took 0.88-0.91x the time of the hardware prefetcher alone, 8.6-8.9 ms for 212 MB at 1-16
 * rows, where a plain read of the same bytes took 9.9; int8 passes of 1, 8 and 16 tokens 0.83-0.89x
 * (`AB_WIDTHS=1,8,16 scripts/ab_native.py OLD.c NEW.c verify int8 200`) */
#ifndef AMX_AHEAD
#define AMX_AHEAD 64
#endif
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) ? __clang_major__ >= 12 : __GNUC__ >= 11)
#define AMX_BUILT 1
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;
/* gcc's tile intrinsics are asm statements that name only the addresses they load from and store to, not the memory
 * there: without a barrier that hands the compiler those addresses, it dropped a buffer's stores before a load and
 * read the sums before the store (zero-padded tails came out as garbage at -O3). Each tile access below sits behind
 * one. */
#define TOUCHES(p) __asm__ volatile("" : : "r"(p) : "memory")
/* tiles 0 and 1: a slice's sums over columns 0-15 and 16-23; 2: its input pairs, 16 at a time; 3 and 4: the weights
 * of those 16 pairs, columns 0-15 and 16-23 */
AMX_TARGET static void amx_configure(int rows) {
    TileConfig c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = c.rows[1] = c.rows[2] = (uint8_t)rows, c.rows[3] = c.rows[4] = 16;
    c.colsb[0] = 64, c.colsb[1] = 32, c.colsb[2] = 64, c.colsb[3] = 64, c.colsb[4] = 32;
    TOUCHES(&c);
    _tile_loadconfig(&c);
}
AMX_TARGET static void amx_release(void) { _tile_release(); }
AMX_TARGET static void amx_zero_sums(void) { _tile_zero(0); _tile_zero(1); }
AMX_TARGET static void amx_store_sums(float *sums) { /* rows of PANEL floats, as the panel kernels write them */
    _tile_stored(0, sums, PANEL * 4);
    _tile_stored(1, sums + 16, PANEL * 4);
    TOUCHES(sums);
}
/* the configured rows of input pairs x (ldx words a row) against `units` (a multiple of 16) pairs of a panel's
 * weights w, added to the sums' tiles */
AMX_TARGET static void amx_blocks(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t units, int ahead) {
    TOUCHES(w);
    TOUCHES(x);
    for (int64_t i = 0; i < units; i += 16) {
        if (ahead) /* a block's 16 pairs of 24 columns: 1536 bytes, 24 lines */
            for (int line = 0; line < 24; line++)
                _mm_prefetch((const char *)(w + (i + AMX_AHEAD) * PANEL) + 64 * line, _MM_HINT_T0);
        _tile_loadd(2, x + i, ldx * 4);
        _tile_loadd(3, w + i * PANEL, PANEL * 4);
        _tile_loadd(4, w + i * PANEL + 16, PANEL * 4);
        _tile_dpbf16ps(0, 2, 3);
        _tile_dpbf16ps(1, 2, 4);
    }
}
/* the last `units` (under 16) pairs as one block padded with zeros, for `rows` rows */
static void amx_tail(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t units, int64_t rows) {
    uint32_t wt[16 * PANEL] = {0}, xt[16 * 16] = {0};
    memcpy(wt, w, sizeof(uint32_t) * (size_t)(units * PANEL));
    for (int64_t r = 0; r < rows; r++) memcpy(xt + r * 16, x + r * ldx, sizeof(uint32_t) * (size_t)units);
    amx_blocks(wt, xt, 16, 16, 0);
}
/* units [0, count) of a panel (words of pairs, PANEL a unit) against rows x (ldx words a row); `ahead`: w is read
 * from memory, so request it ahead */
static void amx_units(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t count, int64_t rows, int ahead) {
    int64_t whole = count / 16 * 16;
    amx_blocks(w, x, ldx, whole, ahead);
    if (whole < count) amx_tail(w + whole * PANEL, x + whole, ldx, count - whole, rows);
}
static int amx_on = 0; /* set by native.py (dflash_set_amx) where the CPU, the OS and a measurement allow */
static int cpu_has_amx_int8(void) {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    return d >> 25 & 1;
}
static int cpu_has_amx(void) {
    unsigned a, b, c, d;
    __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
    if (!(d >> 22 & 1) || !(d >> 24 & 1)) return 0; /* AMX-BF16, AMX-TILE */
    /* Linux hands out the tile state only to a process that asks for it (ARCH_REQ_XCOMP_PERM, XTILEDATA) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
}
/* Eight logits of a bfloat16 head as its AMX product stores them, rows ids[] of w (k inputs a row): the rows are
 * gathered into a panel of their own (columns 0-7, the rest zero) and summed by the same blocks, one input row */
static void chain_dot_amx8(const uint16_t *w, const int64_t *ids, const float *x, int64_t k, float *out) {
    static _Thread_local uint32_t *panel, *pairs;
    static _Thread_local int64_t size, zeroed_for = -1; /* the k whose padding the panel holds as zeros */
    int64_t units = (k + 7) / 8 * 4, padded = (units + 15) / 16 * 16, whole = k / 2;
    if (padded > size) {
        free(panel), free(pairs);
        panel = malloc(sizeof(uint32_t) * (size_t)(padded * PANEL)), pairs = malloc(sizeof(uint32_t) * (size_t)padded);
        size = panel && pairs ? padded : 0, zeroed_for = -1;
        if (!size) {
            for (int t = 0; t < 8; t++) out[t] = NAN;
            return;
        }
    }
    /* Columns 8-23 and the pairs past k are zeros that no call writes: cleared once per k, not per call (a 27 KB
     * memset and a scalar merge of every weight into its pair took a sixth of a 16-row screen) */
    if (zeroed_for != k) {
        memset(panel, 0, sizeof(uint32_t) * (size_t)(padded * PANEL));
        memset(pairs, 0, sizeof(uint32_t) * (size_t)padded);
        zeroed_for = k;
    }
    for (int64_t m = 0; m < whole; m++)
        pairs[m] = (uint32_t)f32_to_bf16(x[2 * m]) | (uint32_t)f32_to_bf16(x[2 * m + 1]) << 16;
    if (k & 1) pairs[whole] = f32_to_bf16(x[k - 1]);
    for (int t = 0; t < 8; t++) { /* a row's consecutive bfloat16 pairs are the panel's words, PANEL apart */
        const uint16_t *row = w + ids[t] * k;
        for (int64_t m = 0; m < whole; m++)
            panel[m * PANEL + t] = (uint32_t)row[2 * m] | (uint32_t)row[2 * m + 1] << 16;
        if (k & 1) panel[whole * PANEL + t] = row[k - 1];
    }
    float sums[PANEL];
    amx_configure(1);
    amx_zero_sums();
    amx_blocks(panel, pairs, padded, padded, 0);
    amx_store_sums(sums);
    amx_release();
    for (int t = 0; t < 8; t++) out[t] = bf16_to_f32(f32_to_bf16(sums[t]));
}
#else
#define AMX_BUILT 0
static const int amx_on = 0;
static int cpu_has_amx(void) { return 0; }
static int cpu_has_amx_int8(void) { return 0; }
static void amx_configure(int rows) { (void)rows; }
static void amx_release(void) {}
static void amx_zero_sums(void) {}
static void amx_store_sums(float *sums) { (void)sums; }
static void amx_units(const uint32_t *w, const uint32_t *x, int64_t ldx, int64_t count, int64_t rows, int ahead) {
    (void)w, (void)x, (void)ldx, (void)count, (void)rows, (void)ahead;
}
static void chain_dot_amx8(const uint16_t *w, const int64_t *ids, const float *x, int64_t k, float *out) {
    (void)w, (void)ids, (void)x, (void)k;
    for (int t = 0; t < 8; t++) out[t] = NAN;
}
#endif

/* Whether this build, CPU and OS run products in pairs through AMX tiles (dflash_set_amx turns them on) */
int dflash_amx(void) { return AMX_BUILT && cpu_has_pairs() && cpu_has_amx(); }
/* Whether the int8 screen of more than one row can run (dflash_screen_tiles) and runs (dflash_set_screen_tiles, which
 * returns the old setting) through tiles: TDPBSUD, bitwise the VNNI kernels' sums; set by native.py */
static int screen_tiles = 0;
int dflash_int8_vnni(void);
int dflash_screen_tiles(void) { return AMX_BUILT && dflash_int8_vnni() && cpu_has_amx() && cpu_has_amx_int8(); }
int dflash_set_screen_tiles(int on) {
    int old = screen_tiles;
    screen_tiles = on && dflash_screen_tiles();
    return old;
}
int dflash_set_amx(int on) {
    int old = amx_on;
#if AMX_BUILT
    amx_on = on && dflash_amx();
#else
    (void)on;
#endif
    return old;
}
