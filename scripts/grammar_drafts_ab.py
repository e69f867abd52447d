"""What a grammar does to drafting, off against on, prompt by prompt in one process, identical outputs checked.

Usage: .venv/bin/python scripts/grammar_drafts_ab.py SWITCH FORMAT [METHODS] [REPEATS]
SWITCH: cut (engine.within_grammar: a chain of drafts cut before its first token the grammar refuses) or forced
(JsonConstraint.forced: the tokens of the bytes the grammar forces, a free draft beside the lookup's) or steer
(engine.GRAMMAR_RUNNERS_UP: a drafter's runner-up taking the place of a draft the grammar refuses);
FORMAT: json_object, a JSON Schema file (prompts: docs/data/session56/json_prompts.jsonl), or tools:CHOICE (the
functions and questions of scripts/tool_calls_bench.py, tool_choice CHOICE: required or auto); METHODS:
comma-separated (default dflash+ngram,dflash); float32 SmolLM2-135M-Instruct, greedy, 128 new tokens. Each repeat
runs every prompt and method in both modes, the mode order alternating between repeats.
"""

import json
import sys
from pathlib import Path

import dflash.engine as engine
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached, settle_heap
from dflash.structured import JsonConstraint
from dflash.tools import conversation, tool_request

PROMPTS = Path(__file__).resolve().parent.parent / "docs" / "data" / "session56" / "json_prompts.jsonl"


def switch(name: str):
    """set(on): the switch's function, or the one that does without it."""
    owner, attribute, without = {"cut": (engine, "within_grammar", lambda seq, draft: draft),
                                 "forced": (JsonConstraint, "forced", lambda self, output: []),
                                 "steer": (engine, "GRAMMAR_RUNNERS_UP", 0)}[name]
    default = getattr(owner, attribute)
    return lambda on: setattr(owner, attribute, default if on else without)


def main() -> None:
    turn, fmt = switch(sys.argv[1]), sys.argv[2]
    methods = (sys.argv[3] if len(sys.argv) > 3 else "dflash+ngram,dflash").split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    target = load_target_cached("smollm2-135m", release_plain=True)
    if fmt.startswith("tools:"):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tool_calls_bench import QUESTIONS, TOOLS

        request = tool_request(TOOLS, fmt.removeprefix("tools:"))
        output = dict(zip(("response_format", "json_schema"), request.output_format()))
        prompts = [target.encode_messages(conversation([{"role": "user", "content": q}], request))
                   for q in QUESTIONS]
    else:
        output = dict(response_format=fmt) if fmt == "json_object" else dict(
            response_format="json_schema", json_schema=json.loads(Path(fmt).read_text()))
        prompts = [target.encode_prompt(json.loads(line)["prompt"]) for line in PROMPTS.read_text().splitlines()]
    decoders = {m: SpeculativeDecoder(target, build_proposer(m, target)[0]) for m in methods}
    settle_heap()
    totals = {(m, mode): [0, 0.0, 0] for m in methods for mode in ("off", "on")}  # tokens, seconds, rounds
    for repeat in range(repeats):
        for ids in prompts:
            for method in methods:
                tokens = {}
                for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                    turn(mode == "on")
                    result = decoders[method].generate(ids, GenerationConfig(128, **output))
                    tokens[mode] = result.tokens
                    total = totals[(method, mode)]
                    total[0] += len(result.tokens)
                    total[1] += result.stats.total_s
                    total[2] += result.stats.num_rounds
                assert tokens["on"] == tokens["off"], (method, target.decode(ids))
    turn(True)
    for method in methods:
        off, on = totals[(method, "off")], totals[(method, "on")]
        print(f"{fmt} {method}: off {off[0] / off[1]:.1f} tok/s tau {off[0] / off[2]:.2f} | on {on[0] / on[1]:.1f} "
              f"tok/s tau {on[0] / on[2]:.2f} | time a token on/off {(on[1] / on[0]) / (off[1] / off[0]):.3f}")


if __name__ == "__main__":
    main()
