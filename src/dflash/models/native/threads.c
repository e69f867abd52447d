/* ---- threads: one OpenMP region per call, inside it work that any thread claims chunk by chunk -------------------
 * Why not a `parallel for` per loop: an OpenMP region ends in a barrier that waits for EVERY thread of its team,
 * including one the OS has descheduled because another process holds its core. A step opened ~180 regions, and
 * each waited a scheduler time slice: a 25 ms float32 step took 1.6 s beside one busy process (2 AMD EPYC cores).
 * So a call opens ONE region (with_workers): its first thread runs the call and publishes each parallel loop as a
 * job; every thread, the first included, claims chunks of it, and the first waits only for chunks another thread
 * has actually started. A thread that gets no core does no work, and the call waits for it once, at its end.
 * Measured on 2 AMD EPYC cores, float32 (scripts/bench_threads.py --beside): a step beside a running `dflash data`
 * job took 88 ms instead of 0.8-1.7 s, and as long as before on a quiet machine. The region runs on torch's own
 * OpenMP threads: a pool of our own threads, with no barrier at all, did better beside a busy process (49 ms), but
 * its 16-token passes were 10-30% slower on a quiet machine.
 * Which thread computes an item never changes its result (every output is computed whole by one thread), so
 * results stay bitwise the same at any thread count or load.
 *
 * A job is one 64-bit word: generation (20 bits) | items (22) | next unclaimed item (22). A claim is a
 * compare-and-swap on it, so a thread that looks late cannot claim from a job that is over; it reads the job's task
 * only after its claim succeeded, which holds the job open until that chunk is finished. */
typedef void (*Task)(void *ctx, int64_t begin, int64_t end);
#define MAX(a, b) ((a) > (b) ? (a) : (b))
#define MIN(a, b) ((a) < (b) ? (a) : (b))

#define ITEM_BITS 22
#define ITEM_MASK ((UINT64_C(1) << ITEM_BITS) - 1)
#define GEN_MASK ((UINT64_C(1) << 20) - 1)

static struct {
    _Atomic uint64_t word;
    _Atomic int64_t finished; /* items done in the current job */
    Task task;
    void *ctx;
    _Atomic int64_t grain;
    _Atomic int closing; /* the region's first thread is done: the others leave */
    uint64_t generation;
    pthread_mutex_t busy; /* one region at a time; a second caller meanwhile runs on its own thread */
} pool = {.busy = PTHREAD_MUTEX_INITIALIZER};
static _Thread_local int in_region; /* this thread opened the region and may publish jobs to it */

static void after_fork(void) { pthread_mutex_init(&pool.busy, NULL); }
__attribute__((constructor)) static void watch_forks(void) { pthread_atfork(NULL, NULL, after_fork); }

/* Claims the next chunk of the job tagged `tag` (generation | items); 0 when that job has none left. */
static int claim(uint64_t tag, int64_t *begin, int64_t *end) {
    uint64_t word = atomic_load_explicit(&pool.word, memory_order_acquire);
    for (;;) {
        int64_t next = (int64_t)(word & ITEM_MASK), items = (int64_t)((word >> ITEM_BITS) & ITEM_MASK);
        if ((word >> ITEM_BITS) != tag || next >= items) return 0;
        int64_t grain = atomic_load_explicit(&pool.grain, memory_order_relaxed); /* a stale grain only sizes a chunk */
        int64_t stop = MIN(next + MAX(grain, 1), items);
        if (atomic_compare_exchange_weak_explicit(&pool.word, &word, (word & ~ITEM_MASK) | (uint64_t)stop,
                                                  memory_order_acq_rel, memory_order_acquire)) {
            *begin = next, *end = stop;
            return 1;
        }
    }
}

static void work_on(uint64_t tag) {
    int64_t begin, end;
    while (claim(tag, &begin, &end)) {
        pool.task(pool.ctx, begin, end);
        atomic_fetch_add_explicit(&pool.finished, end - begin, memory_order_release);
    }
}

/* task(ctx, begin, end) over items [0, items) in chunks of `grain`, on the region's threads where `threads` > 1 and
 * this thread opened a region; on this thread alone otherwise. */
static void parallel_for(int64_t items, int64_t grain, int threads, Task task, void *ctx) {
    if (threads <= 1 || !in_region || items <= grain || items > (int64_t)ITEM_MASK) {
        task(ctx, 0, items);
        return;
    }
    pool.task = task, pool.ctx = ctx;
    atomic_store_explicit(&pool.grain, grain, memory_order_relaxed);
    atomic_store_explicit(&pool.finished, 0, memory_order_relaxed);
    pool.generation = pool.generation % GEN_MASK + 1; /* never 0: a thread entering the region has seen tag 0 */
    uint64_t tag = (pool.generation << ITEM_BITS) | (uint64_t)items;
    atomic_store_explicit(&pool.word, tag << ITEM_BITS, memory_order_release); /* publishes task, ctx, grain */
    work_on(tag);
    /* only chunks another thread is computing remain; yield now and then in case it waits for this core */
    for (int spins = 1; atomic_load_explicit(&pool.finished, memory_order_acquire) < items; spins++) {
        if (spins % 1024 == 0) sched_yield();
        else _mm_pause();
    }
}

/* body(arg) on this thread, with up to `threads` threads (this one included) taking part in its parallel loops */
static void with_workers(int threads, void (*body)(void *), void *arg) {
    if (threads <= 1 || in_region || pthread_mutex_trylock(&pool.busy) != 0) {
        body(arg);
        return;
    }
    atomic_store(&pool.closing, 0);
#pragma omp parallel num_threads(threads)
    {
        if (omp_get_thread_num() == 0) {
            in_region = 1;
            body(arg);
            in_region = 0;
            atomic_store(&pool.closing, 1);
        } else {
            for (uint64_t seen = 0; !atomic_load_explicit(&pool.closing, memory_order_acquire);) {
                uint64_t tag = atomic_load_explicit(&pool.word, memory_order_acquire) >> ITEM_BITS;
                if (tag != seen) work_on(seen = tag);
                else _mm_pause();
            }
        }
    }
    pthread_mutex_unlock(&pool.busy);
}
