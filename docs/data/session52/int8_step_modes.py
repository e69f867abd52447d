"""An int8 step's parts: mode 0 as shipped, 1 without the expansion, 2 without the tiles, 3 the prefetches
alone. Ran against a temporary switch in product.c's amx_panels (dflash_set_int8_mode), not committed."""
import sys, time, torch, statistics
from dflash.loading import load_target_cached
from dflash.models import native
torch.set_num_threads(2)
t = load_target_cached("smollm2-135m", "int8")
lib = native.library()
ctx = 200
cache = t.new_cache(capacity=ctx + 20)
t.forward(torch.arange(5, 5 + ctx)[None] % 1000, cache)
def run(w):
    s = time.perf_counter(); t.forward(torch.arange(5, 5 + w)[None], cache, (), logits_at="hidden"); e = time.perf_counter()
    cache.truncate(ctx); return e - s
for w in (1, 16):
    ms = {m: [] for m in (0, 1, 2, 3)}
    for i in range(30):
        for m in (0, 1, 2, 3):
            lib.dflash_set_int8_mode(m); run(w); ms[m].append(run(w))
    lib.dflash_set_int8_mode(0)
    print(w, {m: round(1000 * statistics.median(v), 2) for m, v in ms.items()})
