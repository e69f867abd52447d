"""Where the drafter's rounds stand beside prompt lookup's: `ngram@16` (prompt lookup with the continuation table,
up to 15 drafts, as the composite's lookup), `dflash+ngram`, and `dflash+ngram` whose drafter never runs,
interleaved prompt by prompt in one process (outputs identical). Each variant's rounds are counted by kind, with
their mean accepted drafts, drafting ms, verify ms and drafts verified: rounds that ran the drafter and verified its
drafts (for `ngram@16`: its own lookup's), ran it but verified the lookup's, verified the lookup's without drafting,
or verified none.

Usage: .venv/bin/python scripts/lookup_rounds_ab.py [DATASET] [LIMIT] [DTYPE]   (default: gsm8k 10 bfloat16; 2 threads)
"""

import collections
import statistics
import sys

import torch

from dflash.bench import read_prompts, resolve_dataset
from dflash.control import DraftController
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions

KINDS = {(True, False): "its proposer's drafts", (True, True): "drafted, then the lookup's",
         (False, True): "the lookup's, no drafting", (False, False): "none"}


def main(argv: list[str]) -> int:
    dataset = argv[0] if argv else "gsm8k"
    limit = int(argv[1]) if len(argv) > 1 else 10
    dtype = argv[2] if len(argv) > 2 else "bfloat16"
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", dtype)
    path, template = resolve_dataset(dataset)
    prompts = [target.encode_prompt(p.turns[0]) for p in read_prompts(path, template, limit)]
    config = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    decoders = {"ngram@16": SpeculativeDecoder(target, build_proposer("ngram", target, MethodOptions(block_size=16))[0]),
                "dflash+ngram": SpeculativeDecoder(target, build_proposer("dflash+ngram", target)[0]),
                "drafter off": SpeculativeDecoder(target, build_proposer("dflash+ngram", target)[0])}
    should_draft, record = DraftController.should_draft, DraftController.record
    rounds, current = collections.defaultdict(list), [None]

    def never(self, alternative=0.0):
        self.stats.skipped_drafting += 1
        return False

    def noted(self, drafted, confidences, verified, accepted, draft_seconds, verify_seconds, **kwargs):
        rounds[current[0]].append((drafted, kwargs.get("lookup", False), verified, accepted, draft_seconds,
                                   verify_seconds))
        return record(self, drafted, confidences, verified, accepted, draft_seconds, verify_seconds, **kwargs)

    DraftController.record = noted
    times = {name: [] for name in decoders}
    try:
        for name, decoder in decoders.items():  # warm-up
            current[0] = "warm-up"
            decoder.generate(prompts[0], GenerationConfig(max_new_tokens=16))
        for i, ids in enumerate(prompts):
            outputs = []
            for name in (list(decoders) if i % 2 == 0 else list(decoders)[::-1]):
                current[0] = name
                DraftController.should_draft = never if name == "drafter off" else should_draft
                try:
                    result = decoders[name].generate(ids, config)
                finally:
                    DraftController.should_draft = should_draft
                times[name].append(1000 * (result.stats.total_s - result.stats.ttft_s) / (len(result.tokens) - 1))
                outputs.append(result.tokens)
            assert all(o == outputs[0] for o in outputs), "outputs differ"
    finally:
        DraftController.record = record
    for name in decoders:
        ratio = statistics.median(a / b for a, b in zip(times[name], times["ngram@16"]))
        print(f"{name}: {statistics.median(times[name]):.2f} ms a token, {ratio:.3f}x ngram@16's time, "
              f"{len(rounds[name])} rounds")
        for key, kind in KINDS.items():
            chosen = [r for r in rounds[name] if (r[0], r[1]) == key]
            if chosen:
                mean = [statistics.mean(r[i] for r in chosen) for i in (3, 4, 5, 2)]
                print(f"    {kind:26s} {len(chosen):4d} rounds: {mean[0]:.2f} accepted, drafting {1000 * mean[1]:.2f} ms,"
                      f" verify {1000 * mean[2]:.2f} ms, {mean[3]:.2f} drafts verified")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
