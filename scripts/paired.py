"""Two variants of one pass timed pair by pair in one process (scripts/ab_native.py, scripts/ab_pages.py).
AB_PAIRS=N sets the number of pairs (default 15).

On a shared 2-core machine whole-pass timings move by 20-50% within minutes; passes that alternate, the order
flipping every round, meet the same moments, so the ratio of each pair is what separates a 5% change.
"""

import os
import time
from typing import Callable

PAIRS = int(os.environ.get("AB_PAIRS", "15"))  # more pairs resolve smaller changes (odd: a median)


def alternate(labels: tuple[str, str], widths: tuple[int, ...], run: Callable[[str, int], None]) -> dict:
    """Seconds of run(label, width) for each label and width, PAIRS pairs after one warm-up pair that is dropped."""
    seconds = {(label, width): [] for label in labels for width in widths}
    for pair in range(PAIRS + 1):
        for width in widths:
            for label in labels if pair % 2 == 0 else labels[::-1]:
                start = time.perf_counter()
                run(label, width)
                if pair > 0:
                    seconds[(label, width)].append(time.perf_counter() - start)
    return seconds


def report(prefix: str, labels: tuple[str, str], widths: tuple[int, ...], seconds: dict) -> None:
    """One line per width: each label's median milliseconds, and the median (range) of second / first per pair."""
    first, second = labels
    for width in widths:
        a, b = seconds[(first, width)], seconds[(second, width)]
        ratios = sorted(y / x for x, y in zip(a, b))
        print(f"{prefix} width {width}: {first} {1e3 * sorted(a)[PAIRS // 2]:.1f} ms, {second} "
              f"{1e3 * sorted(b)[PAIRS // 2]:.1f} ms, {second}/{first} median {ratios[PAIRS // 2]:.3f} "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f})")


def generation_setup(argv: list[str]):
    """[DTYPE] [DATASET] [PROMPTS] [REPEATS] (defaults bfloat16, mt_bench, 4, 3) -> (dtype, SmolLM2 target, its
    prompts' ids, a 128-token greedy config, repeats), 2 threads (scripts/drafter_overhead.py,
    scripts/weights_held_ab.py)."""
    import torch

    from dflash.bench import read_prompts, resolve_dataset
    from dflash.engine import GenerationConfig
    from dflash.loading import load_target_cached

    dtype, dataset, count, repeats = (argv + ["bfloat16", "mt_bench", "4", "3"][len(argv):])[:4]
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    path, template = resolve_dataset(dataset)
    prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, int(count))]
    return dtype, target, prompts, GenerationConfig(max_new_tokens=128, ignore_eos=True), int(repeats)
