"""An int8 (or bfloat16) target's passes with products through AMX tiles against VDPBF16PS (native.set_amx),
interleaved pass by pass after CONTEXT tokens. Usage: python int8_amx_ab.py int8 200 30"""
import sys, time, torch, statistics
from dflash.loading import load_target_cached
from dflash.models import native
torch.set_num_threads(2)
dtype = sys.argv[1]; ctx = int(sys.argv[2]); pairs = int(sys.argv[3])
widths = [int(w) for w in (sys.argv[4] if len(sys.argv) > 4 else "1,2,4,16").split(",")]
t = load_target_cached("smollm2-135m", dtype)
cache = t.new_cache(capacity=ctx + 20)
t.forward(torch.arange(5, 5 + ctx)[None] % 1000, cache)
def run(w):
    s = time.perf_counter(); t.forward(torch.arange(5, 5 + w)[None], cache, (), logits_at="hidden"); e = time.perf_counter()
    cache.truncate(ctx); return e - s
ratios = {w: [] for w in widths}; ms = {(w, on): [] for w in widths for on in (0, 1)}
for i in range(pairs):
    for w in widths:
        times = {}
        for on in ((1, 0) if i % 2 else (0, 1)):
            native.set_amx(bool(on)); run(w); times[on] = run(w); ms[w, on].append(times[on])
        ratios[w].append(times[0] / times[1])
native.set_amx(True)
for w in widths:
    q = statistics.quantiles(ratios[w], n=4)
    print(f"{dtype} ctx {ctx} width {w:2d}: amx {1000*statistics.median(ms[w,1]):.2f} ms, no amx {1000*statistics.median(ms[w,0]):.2f} ms; off/on {statistics.median(ratios[w]):.3f} ({q[0]:.3f}-{q[2]:.3f})")
