"""How much of a bfloat16 dflash+ngram generation runs outside our C calls (a timer around native.stack,
greedy_screened, drafter_stack, linear): 4 GSM8K prompts x 256 tokens, REPS times.
Usage: python python_share.py bfloat16 REPS (this session: 2; 1.14 ms of a 12.86 ms round, 8.9%)"""
import sys, time, json
from dflash.loading import load_target_cached, build_proposer, settle_heap
from dflash.engine import SpeculativeDecoder, GenerationConfig
from dflash.models import native
inside = [0.0, 0]
def timed(fn):
    def wrapper(*a, **k):
        s = time.perf_counter()
        try: return fn(*a, **k)
        finally: inside[0] += time.perf_counter() - s; inside[1] += 1
    return wrapper
for name in ("stack", "greedy_screened", "drafter_stack", "linear", "rms_norm", "greedy_screened_normed"):
    if hasattr(native, name): setattr(native, name, timed(getattr(native, name)))
dtype = sys.argv[1]; reps = int(sys.argv[2])
target = load_target_cached("smollm2-135m", dtype=dtype)
proposer, _ = build_proposer("dflash+ngram", target)
settle_heap()
dec = SpeculativeDecoder(target, proposer)
tok = target.tokenizer
rows = [json.loads(l) for l in open("/work/shared/data/gsm8k_test.jsonl")][:4]
prompts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True) for r in rows]
prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
cfg = GenerationConfig(max_new_tokens=256, ignore_eos=True)
dec.generate(prompts[0], cfg)
inside[:] = [0.0, 0]
t = time.perf_counter(); n = 0; rounds = 0
for _ in range(reps):
    for p in prompts:
        r = dec.generate(p, cfg); n += len(r.tokens); rounds += r.stats.num_rounds
wall = time.perf_counter() - t
print(f"{n / wall:.1f} tok/s, {rounds} rounds, {1000 * wall / rounds:.2f} ms a round; in native calls {inside[0] / wall:.1%} "
      f"({inside[1] / rounds:.1f} calls a round), outside {1000 * (wall - inside[0]) / rounds:.2f} ms a round")
