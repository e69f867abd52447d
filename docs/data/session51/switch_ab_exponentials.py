import sys, time, torch, statistics
from dflash.loading import load_target_cached
from dflash.models import native
torch.set_num_threads(2)
ctx = int(sys.argv[1]); pairs = int(sys.argv[2])
t = load_target_cached("smollm2-135m", "bfloat16")
lib = native.library()
cache = t.new_cache(capacity=ctx + 20)
t.forward(torch.arange(5, 5 + ctx)[None] % 1000, cache)
def run(w):
    s = time.perf_counter(); t.forward(torch.arange(5, 5 + w)[None], cache, (), logits_at="hidden"); e = time.perf_counter()
    cache.truncate(ctx); return e - s
for w in (1, 16):
    ratios = []
    for i in range(pairs):
        times = {}
        for on in ((1, 0) if i % 2 else (0, 1)):
            lib.dflash_set_wide_exponentials(on); run(w); times[on] = run(w)
        ratios.append(times[1] / times[0])
    print(f"context {ctx} width {w}: wide/narrow exponentials median {statistics.median(ratios):.3f} "
          f"(quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-{statistics.quantiles(ratios, n=4)[2]:.3f})")
