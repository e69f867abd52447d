"""Tree rounds against `ar`, greedy, on a real target: trees that hold `ar`'s own continuation as a path among
random siblings (tests/conftest.py's OracleTree), so rounds accept deep paths, well past a sliding window.

Usage: .venv/bin/python scripts/oracle_tree_check.py [TARGET] [DTYPE] [NEW_TOKENS]
       (defaults: gemma3-270m bfloat16 700: past Gemma3's 512-token window; 2 threads)

Prints, for two seeds of the trees, whether the output equals `ar`'s, where it first differs, and the seconds each
took. A tree pass whose nodes summed otherwise than steps along their paths would show here as a difference.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import OracleTree  # noqa: E402

from dflash.engine import GenerationConfig, SpeculativeDecoder  # noqa: E402
from dflash.loading import load_target_cached  # noqa: E402


def main(argv: list[str]) -> int:
    name, dtype, count = (argv + ["gemma3-270m", "bfloat16", "700"][len(argv):])[:3]
    torch.set_num_threads(2)
    target = load_target_cached(name, dtype)
    prompt = target.tokenizer("The history of the city of Rome begins", return_tensors=None)["input_ids"]
    config = GenerationConfig(max_new_tokens=int(count), ignore_eos=True)
    started = time.perf_counter()
    reference = SpeculativeDecoder(target).generate(prompt, config).tokens
    print(f"ar: {time.perf_counter() - started:.1f} s")
    for seed in range(2):
        started = time.perf_counter()
        trees = OracleTree(reference, len(prompt), 15, target.vocab_size, seed=seed)
        out = SpeculativeDecoder(target, trees, adaptive=False).generate(prompt, config).tokens
        first = next((i for i, (a, b) in enumerate(zip(out, reference)) if a != b), None)
        print(f"trees, seed {seed}: equal {out == reference}, first difference {first}, "
              f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
