"""Float32 attention scores two queries at once (native.set_scores_two) on and off, interleaved in one process:
prompts in passes of 256 and passes of 1 and 16 tokens after 1000, with every output compared bitwise.
Usage: .venv/bin/python docs/data/session54/scores_two_ab.py ROUNDS LENGTHS [DTYPE]   (e.g. 7 300,1024,2048 float32)"""
import statistics, sys, time, torch
from dflash.loading import load_target_cached, settle_heap
from dflash.models import native
from dflash.models.transformer import EVERY_PROMPT
torch.set_num_threads(2)
dtype = sys.argv[3] if len(sys.argv) > 3 else "float32"
target = load_target_cached("smollm2-135m", dtype); settle_heap()
eng = target.engine; eng.prompts_in_c_up_to = EVERY_PROMPT; eng.prompt_chunk = 256
rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
ids = torch.randint(100, 40000, (1, 2048), generator=torch.Generator().manual_seed(0))
layers = (1, 8, 15, 22, 29)
def run(on, n):
    native.set_scores_two(bool(on))
    cache = target.new_cache(capacity=n + 24)
    t = time.perf_counter(); out = target.forward(ids[:, :n], cache, layers, logits_at="last"); dt = time.perf_counter() - t
    return dt, out, cache
for n in tuple(int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "300,1024").split(",")):
    ratios, same = [], True
    for r in range(rounds):
        res = {on: run(on, n) for on in ((1, 0) if r % 2 else (0, 1))}
        ratios.append(res[1][0] / res[0][0])
        same &= torch.equal(res[1][1].logits, res[0][1].logits) and torch.equal(res[1][1].features, res[0][1].features)
        same &= torch.equal(res[1][2].keys, res[0][2].keys) and torch.equal(res[1][2].values, res[0][2].values)
    print(f"{dtype} prompt {n}: two/old {statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}), bitwise same: {same}", flush=True)
cache = target.new_cache(capacity=1100); target.forward(ids[:, :1000], cache, logits_at="last")
for width in (1, 16):
    x = ids[:, 1000:1000 + width]
    ratios, same = [], True
    for r in range(30):
        res = {}
        for on in ((1, 0) if r % 2 else (0, 1)):
            native.set_scores_two(bool(on))
            t = time.perf_counter(); out = target.forward(x, cache, layers); res[on] = (time.perf_counter() - t, out)
            cache.truncate(1000)
        ratios.append(res[1][0] / res[0][0]); same &= torch.equal(res[1][1].logits, res[0][1].logits)
    print(f"{dtype} width {width} after 1000: two/old {statistics.median(ratios):.3f}, bitwise same: {same}", flush=True)
