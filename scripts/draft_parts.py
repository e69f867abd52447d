"""Where a DFlash drafting pass goes, part by part, as an adaptive round runs it (milliseconds, medians).

Usage: .venv/bin/python scripts/draft_parts.py [TARGET_DTYPE] [DRAFT_DTYPE] [--head packed|native|vnni]
       (defaults: float32 target, bfloat16 drafter, the head's kernel as settled; 2 threads)

Each of 110 rounds (the first 10 dropped) runs a target step (whose weights evict the drafter's from the caches),
then the steps of `DFlashProposer.propose` one by one, each timed: the feature product and its norm, RoPE, the
block's embeddings, the layers (one C call where they run in C), the final norm, and reading the first 4 drafts
(the LM head and the choice of tokens).
"""

import sys
import time

import torch

from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions
from dflash.methods.dflash.proposer import DFlashProposer

PARTS = ("feature product + norm", "rope", "embed", "layers", "final norm", "read 4 drafts", "total")


def main(argv: list[str]) -> int:
    head = argv[argv.index("--head") + 1] if "--head" in argv else None
    args = [a for a in argv if not a.startswith("--") and a != head]
    target_dtype, draft_dtype = (args + ["float32", "bfloat16"][len(args):])[:2]
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", target_dtype)
    proposer = build_proposer("dflash", target, MethodOptions(draft_dtype=draft_dtype))[0]
    if head:
        proposer.lm_head._kernel_by_bucket = (head,) * 3
    drafter, dtype = proposer.drafter, proposer.drafter.fc.weight.dtype
    fc = drafter.fast_fc if drafter.fast_fc is not None else drafter.fc
    prompt = target.encode_prompt("Janet's ducks lay 16 eggs per day. How much does she make every day?")
    features = target.forward(torch.tensor([prompt]), None, proposer.feature_layers).features
    cache = target.new_cache(capacity=512)
    target.forward(torch.arange(5, 205)[None], cache)
    stop = lambda confidence: False  # noqa: E731 (a controller that wants no drafts past the first read)
    times = {part: [] for part in PARTS}
    with torch.inference_mode():
        for round_ in range(110):
            if round_ % 40 == 0:
                proposer.start(prompt, features)
                sequence = prompt + [5]
            target.forward(torch.tensor([[5]]), cache)
            cache.truncate(200)
            clock = [time.perf_counter()]
            pending = torch.cat(proposer.pending, dim=1)
            start, done = len(sequence) - 1, proposer.cache.lengths[0]
            ctx = drafter.hidden_norm.rows(fc(pending.to(dtype)))  # as forward takes it
            clock.append(time.perf_counter())
            rope_ctx = drafter.rope_of(torch.arange(done, start)[None], dtype, from_table=True)
            positions = torch.arange(start, start + proposer.block_size)[None]
            rope_block = drafter.rope_of(positions, dtype, from_table=True)
            clock.append(time.perf_counter())
            block = torch.tensor([[sequence[-1]] + [proposer.mask_token_id] * proposer.max_draft])
            x = target.embed_tokens(block).to(dtype)
            clock.append(time.perf_counter())
            proposer.cache.reserve(done + ctx.shape[1] + x.shape[1])
            out = drafter._native_forward(x, rope_block, ctx, rope_ctx, positions, proposer.cache)
            if out is None:  # layers C does not run (e.g. float32 ones on a bfloat16 target): torch's, as forward
                out = x
                for i, layer in enumerate(drafter.layers):
                    ctx_k, ctx_v = layer.self_attn.context_kv(ctx, rope_ctx)
                    out = layer(out, rope_block, ctx_k, ctx_v, None, proposer.cache, i)
            proposer.cache.advance(ctx.shape[1])
            clock.append(time.perf_counter())
            hidden = drafter.norm.rows(out)  # as DFlashDrafter.forward takes it
            clock.append(time.perf_counter())
            proposer.pending = []
            DFlashProposer._read_in_steps([proposer], hidden[:, 1:], [stop])
            clock.append(time.perf_counter())
            if round_ >= 10:
                for part, a, b in zip(PARTS, clock, clock[1:]):
                    times[part].append(b - a)
                times["total"].append(clock[-1] - clock[0])
            proposer.commit([5, 7], features[:, -2:])
            sequence += [5, 7]
    print(f"{target_dtype} target, {draft_dtype} drafter, head on {proposer.lm_head.kernel_for_rows(4)}:")
    for part in PARTS:
        print(f"  {part:24s} {1000 * sorted(times[part])[len(times[part]) // 2]:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
