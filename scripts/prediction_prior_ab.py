"""The predictions' prior (engine.Engine._learn_prediction_prior) on and off, side by side in one process: each
prompt's answer, then that answer (exact) and it with every fourth line changed (edited) as predictions, each run
with the prior learnt so far and with none (a fresh calibration, nothing folded in), interleaved, the median of 3.
Every output is checked to be the answer.

Usage: .venv/bin/python scripts/prediction_prior_ab.py [DATASET] [N] [MAX_TOKENS]   (defaults: gsm8k 8 192)
Prints, per kind of prediction, tokens/s with and without the prior and the ratio of their times per token.
"""

import statistics
import sys
import time
from pathlib import Path

import dflash.engine as engine_module
from dflash.llm import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prediction_bench import edited, prompts_of  # noqa: E402

KINDS = ("exact", "edited")


def main() -> None:
    dataset = sys.argv[1] if len(sys.argv) > 1 else "gsm8k"
    count = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 192
    llm = LLM("smollm2-135m")
    learn = engine_module.Engine._learn_prediction_prior
    key = ("prediction", llm.engine.proposer.max_draft)  # where the engine keeps the prior
    seconds = {(mode, kind): 0.0 for mode in ("on", "off") for kind in KINDS}
    tokens = 0
    for prompt in prompts_of(dataset, count):
        messages = [{"role": "user", "content": prompt}]
        answer = llm.chat(messages, max_tokens)
        tokens += len(answer.tokens)
        for kind, prediction in zip(KINDS, (answer.text, edited(answer.text))):
            times = {"on": [], "off": []}
            for _ in range(3):
                for mode in ("on", "off"):
                    # off: no prior to start from and nothing folded in; the learnt one is put back after
                    engine_module.Engine._learn_prediction_prior = learn if mode == "on" else lambda self, seq: None
                    saved = llm.engine.calibrations.pop(key, None) if mode == "off" else None
                    started = time.perf_counter()
                    result = llm.chat(messages, max_tokens, prediction=prediction)
                    times[mode].append(time.perf_counter() - started)
                    if saved is not None:
                        llm.engine.calibrations[key] = saved
                    assert result.tokens == answer.tokens
            for mode in ("on", "off"):
                seconds[(mode, kind)] += statistics.median(times[mode])
    engine_module.Engine._learn_prediction_prior = learn
    for kind in KINDS:
        on, off = seconds[("on", kind)], seconds[("off", kind)]
        print(f"{dataset} {kind}: prior on {tokens / on:.1f} tok/s, off {tokens / off:.1f} tok/s, time per token "
              f"on / off {on / off:.3f}")


if __name__ == "__main__":
    main()
