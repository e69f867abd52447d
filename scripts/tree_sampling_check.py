"""Seeded sampling through draft trees gives plain sampling's tokens on the real model: each tree round samples
the target's token at the nodes it visits, seeded by sequence position as every round is. Prints, per prompt and
drafter, whether the output equals `ar`'s and the tree's tau.

Usage: .venv/bin/python scripts/tree_sampling_check.py [NODES] [NEW_TOKENS]
(defaults: 15 64; SmolLM2-135M-Instruct in float32, T=0.8, top-p 0.95, seed 11, three prompts)
"""

import sys

import torch

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions
from dflash.sampling import SamplingConfig

PROMPTS = ["Write a short poem about rain.", "What is 12 * 13? Explain.", "List three uses of Python."]


def main(argv: list[str]) -> int:
    nodes = int(argv[0]) if argv else 15
    new = int(argv[1]) if len(argv) > 1 else 64
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "float32")
    config = GenerationConfig(max_new_tokens=new, sampling=SamplingConfig(temperature=0.8, top_p=0.95, seed=11))
    same = total = 0
    for prompt in PROMPTS:
        ids = target.encode_prompt(prompt)
        reference = SpeculativeDecoder(target).generate(ids, config).tokens
        for method in ("dflash", "eagle3"):
            proposer = build_proposer(method, target, MethodOptions(tree=nodes))[0]
            result = SpeculativeDecoder(target, proposer).generate(ids, config)
            same, total = same + (result.tokens == reference), total + 1
            print(f"{method} --tree {nodes}: same as ar {result.tokens == reference}, tau {result.stats.tau:.2f}")
    print(f"{same} of {total} outputs equal plain sampling's")
    return 0 if same == total else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
