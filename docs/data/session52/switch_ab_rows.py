"""The pass's per-token norms and RoPE shared among the threads (on) or on the first thread alone (off): the same
library, the switch flipped pass by pass, the order alternating; median ratio on/off and quartiles by width.
It ran against a temporary switch, not committed (layer.c's for_tokens with `parallel_rows`, set by
dflash_set_parallel_rows); usage: python switch_ab_rows.py DTYPE CONTEXT PAIRS [WIDTHS]."""
import sys, time, torch, statistics
from dflash.loading import load_target_cached
from dflash.models import native
torch.set_num_threads(2)
dtype = sys.argv[1]; ctx = int(sys.argv[2]); pairs = int(sys.argv[3])
widths = [int(w) for w in (sys.argv[4] if len(sys.argv) > 4 else "1,4,8,16").split(",")]
t = load_target_cached("smollm2-135m", dtype)
lib = native.library()
cache = t.new_cache(capacity=ctx + 20)
t.forward(torch.arange(5, 5 + ctx)[None] % 1000, cache)
def run(w):
    s = time.perf_counter(); t.forward(torch.arange(5, 5 + w)[None], cache, (), logits_at="hidden"); e = time.perf_counter()
    cache.truncate(ctx); return e - s
ratios = {w: [] for w in widths}
for i in range(pairs):
    for w in widths:
        times = {}
        for on in ((1, 0) if i % 2 else (0, 1)):
            lib.dflash_set_parallel_rows(on); run(w); times[on] = run(w)
        ratios[w].append(times[1] / times[0])
lib.dflash_set_parallel_rows(1)
for w in widths:
    q = statistics.quantiles(ratios[w], n=4)
    print(f"{dtype} context {ctx} width {w:2d}: shared/alone {statistics.median(ratios[w]):.3f} (quartiles {q[0]:.3f}-{q[2]:.3f})")
