"""Attention through tiles, this session's version against the old, behind a temporary switch (dflash_set_attention_fused,
since removed: this records how prompt_attention.txt's runs were taken, it no longer runs as is).
Usage: .venv/bin/python fused_ab.py ROUNDS LENGTHS"""
import ctypes, statistics, sys, time, torch
from dflash.loading import load_target_cached, settle_heap
from dflash.models import native
from dflash.models.transformer import EVERY_PROMPT
torch.set_num_threads(2)
lib = native.library(); lib.dflash_set_attention_fused.argtypes = [ctypes.c_int]
target = load_target_cached("smollm2-135m", "bfloat16"); settle_heap()
eng = target.engine; eng.prompts_in_c_up_to = EVERY_PROMPT; eng.prompt_chunk = 256
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
ids = torch.randint(100, 40000, (1, 2048), generator=torch.Generator().manual_seed(0))
layers = (1, 8, 15, 22, 29)
def run(on, n):
    lib.dflash_set_attention_fused(on)
    cache = target.new_cache(capacity=n + 24)
    t = time.perf_counter(); out = target.forward(ids[:, :n], cache, layers, logits_at="last"); dt = time.perf_counter() - t
    return dt, out, cache
for n in tuple(int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "300,1024,2048").split(",")):
    ratios, same = [], True
    for r in range(rounds):
        order = (1, 0) if r % 2 else (0, 1)
        res = {on: run(on, n) for on in order}
        ratios.append(res[1][0] / res[0][0])
        same &= torch.equal(res[1][1].logits, res[0][1].logits) and torch.equal(res[1][1].features, res[0][1].features)
        same &= torch.equal(res[1][2].keys, res[0][2].keys) and torch.equal(res[1][2].values, res[0][2].values)
    print(f"prompt {n}: fused/old {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), bitwise same: {same}", flush=True)
# passes of width 1 and 16 after 1000 positions
cache = target.new_cache(capacity=1100); target.forward(ids[:, :1000], cache, logits_at="last")
for width in (1, 16):
    x = ids[:, 1000:1000 + width]
    ratios, same = [], True
    for r in range(40):
        res = {}
        for on in ((1, 0) if r % 2 else (0, 1)):
            lib.dflash_set_attention_fused(on)
            t = time.perf_counter(); out = target.forward(x, cache, layers); res[on] = (time.perf_counter() - t, out)
            cache.truncate(1000)
        ratios.append(res[1][0] / res[0][0]); same &= torch.equal(res[1][1].logits, res[0][1].logits)
    print(f"width {width} after 1000: fused/old {statistics.median(ratios):.3f}, bitwise same: {same}", flush=True)
