"""A chat's second turn with and without the prefix cache (SmolLM2-135M-Instruct, dflash+ngram, one thread):
how many prompt tokens it skipped, its TTFT, and a hash of both turns' tokens, which must match.

    .venv/bin/python scripts/prefix_turns.py
"""
import time

import torch

from dflash.engine import Engine, GenerationConfig
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions

torch.set_num_threads(1)
target = load_target_cached("smollm2-135m")
turns = [{"role": "user", "content": "Explain what a hash table is, in a few sentences."}]


def chat(engine, messages):
    seq = engine.submit(target.encode_messages(messages), GenerationConfig(64))
    engine.run()
    return seq.result


for budget in (0, 256 << 20, 0, 256 << 20):
    proposer, _ = build_proposer("dflash+ngram", target, MethodOptions())
    engine = Engine(target, proposer, max_batch=2, prefix_cache_bytes=budget)
    first = chat(engine, turns)
    history = turns + [{"role": "assistant", "content": first.text},
                       {"role": "user", "content": "Now give a short Python example of one."}]
    second = chat(engine, history)
    print(f"budget {budget >> 20} MB: second turn {second.stats.prompt_tokens} prompt tokens, "
          f"{second.stats.cached_prompt_tokens} cached, TTFT {1000 * second.stats.ttft_s:.0f} ms; "
          f"tokens {hash(tuple(first.tokens + second.tokens)) & 0xffff}")
