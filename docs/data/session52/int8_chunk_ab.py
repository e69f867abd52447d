"""The int8 tile path's chunk and prefetch distance (pairs), each setting against the first.
Ran against a temporary switch (dflash_set_int8_chunk CHUNK AHEAD), not committed.
Usage: python int8_chunk_ab.py 32:64,64:64,16:64 30"""
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
settings = [tuple(int(v) for v in s.split(":")) for s in sys.argv[1].split(",")]
ref = settings[0]
for w in (1, 16):
    ratios = {s: [] for s in settings}; ms = {s: [] for s in settings}
    for i in range(int(sys.argv[2])):
        order = settings[i % len(settings):] + settings[:i % len(settings)]
        got = {}
        for s in order:
            lib.dflash_set_int8_chunk(*s); run(w); got[s] = run(w); ms[s].append(got[s])
        for s in settings: ratios[s].append(got[s] / got[ref])
    lib.dflash_set_int8_chunk(32, 64)
    print(w, "  ".join(f"{s}: {1000*statistics.median(ms[s]):.2f} ms {statistics.median(ratios[s]):.3f}" for s in settings))
