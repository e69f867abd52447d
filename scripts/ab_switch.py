"""One engine switch off against on, generation by generation in one process, with identical outputs checked.

Usage: .venv/bin/python scripts/ab_switch.py SWITCH [DATASET] [LIMIT] [METHODS] [MAX_NEW] [--draft-dtype D]
       [--repeats N] [--dtype float32|bfloat16] [--batch ROWS] [--json FILE]
(defaults: gsm8k, 6 prompts, dflash,dflash:whole,eagle3, 128 new tokens; float32 SmolLM2-135M-Instruct, greedy,
the shipped drafters in the CLI's draft dtype (`--draft-dtype auto`: the faster one measured; the twelfth and
thirteenth sessions' runs drafted in float32, `--draft-dtype float32`); the thread count is torch's, so set
OMP_NUM_THREADS to fix it)

Switches (the "on" variant is each one's default):
  deferred-logits   a verify round's LM head stops at the first rejected draft (`TargetModel.defer_logits`), against
                    one head over every verified position
  read-steps        DFlash reads its drafts' LM head FIRST_READ positions first, and the rest only while the
                    controller could still verify more and stepping measures as paying (`methods/dflash/proposer.py`),
                    against reading every position at once
  screened-head     greedy rounds take their tokens from a screen of the LM head (bfloat16 or int8, the faster here)
                    and a few float32 sums (`models/screening.py`), against the float32 head's argmax
  bf16-pairs        a bfloat16 target's (and drafter's) weights in pairs for VDPBF16PS (AVX512-BF16 only;
                    `models/native.py`), against widened to float32 for FMAs. Its outputs may differ: the two kernels
                    round bfloat16 sums differently (each is lossless against its own `ar`), so "identical" is not
                    asked of it. Use with --dtype bfloat16 (a float32 target has no bfloat16 weights)
  amx               products in pairs run through AMX tiles (TDPBF16PS; Intel Sapphire Rapids and later;
                    `models/native.c`), against VDPBF16PS chains, each variant with the kernel plan measured under it
                    (`choose_kernels`: cached per kernel build, so the first switch may measure for a few seconds).
                    Its outputs may differ in the last bits, as between the two product kernels. Use with --dtype
                    bfloat16 on a CPU with AMX
  narrow-passes     products of a few rows read the panels one at a time with the next chunk requested from 2 rows
                    (`native.narrow_passes` "one-panel"), against two panels at a time up to 4 rows ("two-panels",
                    the choice on AMD EPYC); outputs identical
  screen-tiles      the int8 screen of the LM head sums more than one row through AMX tiles (TDPBSUD, AMX-INT8;
                    `native.screen_tiles`), against VPDPBUSD, each with its own measured switch to wide inputs
                    (`timings.measured_wide_from`); the same integer sums, outputs identical. Needs a CPU with AMX
  f32-zmm           float32 panels run in 512-bit code, a panel's columns 0-15 in one register
                    (`native.f32_kernel` "avx512-zmm"), against 256-bit AVX-512VL code ("avx512"); outputs identical.
                    Needs a CPU with AVX-512VL
  attention-tiles   a bfloat16 target whose products run through AMX tiles scores attention and sums its values
                    through tiles too (`native.set_attention_tiles`; native.c's tile_scores, tile_values), against
                    VDPBF16PS; its outputs may differ in the last bits. Use with --dtype bfloat16 on a CPU with AMX
  continuations     prompt lookup (ngram, and beside a drafter) falls back to the target's shipped table of its own
                    frequent continuations (`methods/continuations.py`), against prompt lookup alone
  attention-pairs   a bfloat16 target whose products run in pairs scores attention with VDPBF16PS too (`native.c`:
                    block_scores_pairs), against FMAs over widened keys; its outputs may differ in the last bits, as
                    between the two product kernels. Use with --dtype bfloat16 on an AVX512-BF16 CPU
  backoff-contexts  the continuation table drafts from the longest of its 8/5/3/2-token contexts, and before a 1-token
                    prompt match (`methods/continuations.py`, `ngram.WEAK_MATCH`), against 3-token contexts (built
                    from the committed corpus with the same thresholds) after every prompt match
  screen-steps      greedy rounds read the head's screen for engine.FIRST_SCREENED positions first, then the rest
                    for the rows that accepted them all, against every verified position in one screen
  long-matches      prompt lookup looks for the sequence's last LONG_MATCH (`ngram.MAX_MATCH`, 5) tokens first, then
                    fewer, each length calibrated apart, against 3 tokens at most
  draft-head        a DFlash drafter's LM head is timed on our float and int8 (VNNI) kernels too, and the fastest
                    drafting pass kept (`methods/dflash/proposer.py`: settled_kernels), against its plan's kernel
                    (oneDNN's, for the 16K-row head no plan measured)
  int8-vnni         the int8 screen of the head sums in integers (VPDPBUSD; AVX512-VNNI only;
                    `models/native.c`), against float32 FMAs over its widened weights; both pin the int8 screen
  screen-wide       that integer screen rounds its inputs wide where many rows are screened (all but each row's 8
                    largest channels in a byte, their high bytes summed apart; `models/native.c`), against dense
                    inputs (every channel in two bytes, int16's precision) everywhere; both pin the integer screen
  chained-prior     a draft position without a confidence (prompt lookup's) starts from the estimate of the position
                    before it (`control.Calibration`), against 0.5 at every position
  prompts-in-c      prompts go through the C stack (`Transformer.prompts_in_c_up_to`, passes of `prompt_chunk`),
                    against torch's layers whole; mostly a matter of TTFT (printed beside the time per token). A
                    bfloat16 target's outputs may differ: the two round a prompt's sums differently
  prompt-chunk      prompts through the C stack in passes of 256 tokens (`Transformer.prompt_chunk`), against 64;
                    a matter of TTFT only (each token takes the chains of a step either way: outputs identical)
  native-build      this checkout's native.c against the build of the file AB_OLD_NATIVE names (e.g. `.venv/bin/python
                    scripts/native_source.py REV > /tmp/old.c`), libraries swapped in one process as
                    scripts/ab_native.py does, on whole generations; both builds must share the tile layout and
                    the C functions' arguments (this checkout's Python calls both: a build from before 0324e6e, whose
                    dflash_stack took no feature_stride, crashes as soon as a drafter asks for features)

For every prompt and method, the two variants generate in turn, the order flipping every prompt, each with its own
decoder (its own learnt costs; the switch is set around both its construction and its runs). Prints, per method,
the median time per output token of each variant, the median and range of the per-prompt ratio (on / off; below 1:
the switch makes generation faster), and whether every output was identical; --json FILE writes the same.
"""

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from dflash.bench import parse_method, read_prompts, resolve_dataset
from dflash import control, engine
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.timings import measured_screening, measured_wide_from
from dflash.loading import build_proposer, load_target_cached
from dflash.corpus import read_packed
from dflash.methods import continuations, ngram
from dflash.methods.base import SHIPPED_DRAFTERS, MethodOptions
from dflash.methods.dflash import proposer as dflash_proposer
from dflash.models import native
from dflash.models.target import choose_kernels
from dflash.models.transformer import EVERY_PROMPT, PROMPT_CHUNKS
from batch_methods import run_batch

VARIANTS = ("off", "on")


def set_deferred_logits(target, on: bool) -> None:
    target.defer_logits = on


def set_read_steps(target, on: bool) -> None:
    dflash_proposer.FIRST_READ = DEFAULT_FIRST_READ if on else None


def set_screened_head(target, on: bool) -> None:
    # on: whichever screen measures fastest here (timed once, cached), as the engine decides it
    target.screen_greedy = measured_screening(target) if on else False


def set_bf16_pairs(target, on: bool) -> None:
    if native.bf16_pairs() != on:
        native.set_bf16_pairs(on)
        cache = target.new_cache()  # lay the weights out again now, not inside a timed generation
        for width in (1, 8):
            target.forward(torch.arange(5, 5 + width)[None], cache)


def set_amx(target, on: bool) -> None:
    if getattr(target, "_ab_amx", None) != on:
        native.set_amx(on)
        choose_kernels(target)  # the plan measured under this kernel (cached per build: "+amx" in its key)
        target._ab_amx = on


def set_screen_tiles(target, on: bool) -> None:
    if getattr(target, "_ab_screen_tiles", None) != on:
        native.set_screen_tiles(on)
        measured_wide_from(target)  # from how many rows the screen goes wide, measured under this kernel
        target._ab_screen_tiles = on


def set_f32_zmm(target, on: bool) -> None:
    native.set_f32_kernel("avx512-zmm" if on else "avx512")


def set_narrow_passes(target, on: bool) -> None:
    native.set_narrow_passes("one-panel" if on else "two-panels")


def set_int8_vnni(target, on: bool) -> None:
    target.screen_greedy, target.screen_kind = True, "int8"
    if native.int8_vnni() != on:
        native.set_int8_vnni(on)
        target.engine.screen("int8")  # quantise and lay the head out again now, not inside a timed generation


def set_screen_wide(target, on: bool) -> None:
    target.screen_greedy, target.screen_kind = True, "int8"
    if not native.int8_vnni():
        native.set_int8_vnni(True)
    if native.screen_wide() != on:
        native.set_screen_wide(on)
    target.engine.screen("int8")  # quantise and lay the head out again now, not inside a timed generation


def set_draft_head(target, on: bool) -> None:
    dflash_proposer.HEAD_KERNELS = DEFAULT_HEAD_KERNELS if on else {}  # read when a proposer is built


def set_continuations(target, on: bool) -> None:
    os.environ["DFLASH_CONTINUATIONS"] = "1" if on else "0"  # read when a proposer is built: each variant keeps its own


def set_backoff_contexts(target, on: bool) -> None:
    ngram.WEAK_MATCH = DEFAULT_WEAK_MATCH if on else 0
    folder = SHIPPED_DRAFTERS / f"{target.name}-continuations"
    continuations._SHIPPED.pop(folder, None)  # read when a proposer is built: each variant keeps its own
    if not on:
        if folder not in THREE_TOKEN_TABLES:
            records = read_packed(Path("corpus") / target.name)
            THREE_TOKEN_TABLES[folder] = continuations.ContinuationTable.build(
                [r["input_ids"][r["loss_start"]:] for r in records], target.vocab_size, lengths=(3,))
        continuations._SHIPPED[folder] = THREE_TOKEN_TABLES[folder]


def set_attention_pairs(target, on: bool) -> None:
    native.set_attention_pairs(on)


def set_attention_tiles(target, on: bool) -> None:
    native.set_attention_tiles(on)


def set_long_matches(target, on: bool) -> None:
    ngram.MAX_MATCH = LONG_MATCH if on else 3  # read when a proposer is built: each variant keeps its own


NATIVE_BUILDS = {}


def set_native_build(target, on: bool) -> None:
    if not NATIVE_BUILDS:  # both libraries loaded side by side (ctypes keeps each one's symbols apart)
        NATIVE_BUILDS[True] = native.library()
        source = native.SOURCE
        native.SOURCE, native._tried, native._library = Path(os.environ["AB_OLD_NATIVE"]), False, None
        NATIVE_BUILDS[False] = native.library()
        native.SOURCE = source
        if None in NATIVE_BUILDS.values():
            sys.exit(f"cannot build both native libraries: {native.why_not}")
    native._library = NATIVE_BUILDS[on]


def set_chained_prior(target, on: bool) -> None:
    control.CHAINED_PRIOR = on  # read at every price; each variant's decoder keeps its own calibrations


def set_prompts_in_c(target, on: bool) -> None:
    target.engine.prompts_in_c_up_to = EVERY_PROMPT if on else 0


def set_prompt_chunk(target, on: bool) -> None:
    target.engine.prompts_in_c_up_to = EVERY_PROMPT
    target.engine.prompt_chunk = PROMPT_CHUNKS[-1] if on else PROMPT_CHUNKS[0]


def set_screen_steps(target, on: bool) -> None:
    engine.FIRST_SCREENED = DEFAULT_FIRST_SCREENED if on else 64


SWITCHES = {"deferred-logits": set_deferred_logits, "read-steps": set_read_steps, "screened-head": set_screened_head,
            "bf16-pairs": set_bf16_pairs, "int8-vnni": set_int8_vnni, "screen-steps": set_screen_steps,
            "continuations": set_continuations, "backoff-contexts": set_backoff_contexts,
            "attention-pairs": set_attention_pairs, "long-matches": set_long_matches, "draft-head": set_draft_head,
            "screen-wide": set_screen_wide, "native-build": set_native_build, "prompts-in-c": set_prompts_in_c,
            "chained-prior": set_chained_prior, "amx": set_amx,
            "narrow-passes": set_narrow_passes, "f32-zmm": set_f32_zmm, "screen-tiles": set_screen_tiles,
            "attention-tiles": set_attention_tiles, "prompt-chunk": set_prompt_chunk}
# switches whose variants may differ in output (each lossless on its own)
CHANGES_ROUNDING = {"amx", "bf16-pairs", "attention-pairs", "attention-tiles", "prompts-in-c"}
DEFAULT_FIRST_READ = dflash_proposer.FIRST_READ
DEFAULT_HEAD_KERNELS = dict(dflash_proposer.HEAD_KERNELS)
DEFAULT_FIRST_SCREENED = engine.FIRST_SCREENED
DEFAULT_WEAK_MATCH = ngram.WEAK_MATCH
LONG_MATCH = int(os.environ.get("LONG_MATCH", ngram.MAX_MATCH))
THREE_TOKEN_TABLES = {}


def tpot_ms(result) -> float:
    decode = result.stats.total_s - result.stats.ttft_s
    return 1000 * decode / max(1, len(result.tokens) - 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("switch", choices=sorted(SWITCHES))
    p.add_argument("dataset", nargs="?", default="gsm8k")
    p.add_argument("limit", nargs="?", type=int, default=6)
    p.add_argument("methods", nargs="?", default="dflash,dflash:whole,eagle3")
    p.add_argument("max_new", nargs="?", type=int, default=128)
    p.add_argument("--draft-dtype", default="auto")
    p.add_argument("--repeats", type=int, default=1, help="generations of each prompt per variant (alternating)")
    p.add_argument("--dtype", default="float32", help="the target's dtype (float32 or bfloat16)")
    p.add_argument("--batch", type=int, default=1,
                   help="rows decoded together through the engine (continuous batching, scripts/batch_methods.py), "
                        "the time per output token then the batch's; 1 (default): one generation at a time")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    target = load_target_cached("smollm2-135m", args.dtype)
    path, template = resolve_dataset(args.dataset)
    prompts = [target.encode_prompt(prompt.turns[0]) for prompt in read_prompts(path, template, args.limit)]
    prompts = [ids for ids in prompts for _ in range(args.repeats)]
    config = GenerationConfig(max_new_tokens=args.max_new, ignore_eos=True)
    switch = SWITCHES[args.switch]
    decoders, proposers = {}, {}
    for method in args.methods.split(","):
        spec = parse_method(method)
        for variant in VARIANTS:
            switch(target, variant == "on")
            options = MethodOptions(block_size=spec.size, draft_dtype=args.draft_dtype)
            proposer, _ = build_proposer(spec.name, target, options)
            proposers[method, variant] = proposer
            decoders[method, variant] = SpeculativeDecoder(target, proposer, adaptive=not spec.whole_blocks)
    times = {key: [] for key in decoders}
    ttfts = {key: [] for key in decoders}  # milliseconds to the first token, single generations only
    identical = {method: True for method, _ in decoders}
    groups = [prompts[i: i + args.batch] for i in range(0, len(prompts), args.batch)]
    for index, group in enumerate(groups):
        for method in dict.fromkeys(m for m, _ in decoders):
            outputs = {}
            for variant in VARIANTS if index % 2 == 0 else VARIANTS[::-1]:
                switch(target, variant == "on")
                if args.batch > 1:
                    whole = parse_method(method).whole_blocks
                    seconds, _, _, outputs[variant] = run_batch(target, proposers[method, variant], group, config,
                                                                adaptive=not whole)
                    times[method, variant].append(1000 * seconds / sum(map(len, outputs[variant])))
                    continue
                result = decoders[method, variant].generate(group[0], config)
                times[method, variant].append(tpot_ms(result))
                ttfts[method, variant].append(1000 * result.stats.ttft_s)
                outputs[variant] = result.tokens
            identical[method] &= outputs["off"] == outputs["on"]
            print(f"{'batch' if args.batch > 1 else 'prompt'} {index}: {method:14s} " + "  ".join(
                f"{v} {times[method, v][-1]:5.1f} ms" for v in VARIANTS), file=sys.stderr, flush=True)
    report = {"switch": args.switch, "draft_dtype": args.draft_dtype, "threads": torch.get_num_threads(),
              "dataset": args.dataset, "prompts": len(prompts), "batch": args.batch, "methods": {}}
    print(f"{'method':14s} {'off ms':>8s} {'on ms':>8s}  on/off median (range)  identical")
    for method in identical:
        off, on = times[method, "off"], times[method, "on"]
        ratios = sorted(a / b for a, b in zip(on, off))
        row = {"off_tpot_ms": statistics.median(off), "on_tpot_ms": statistics.median(on),
               "ratio_median": statistics.median(ratios), "ratio_min": ratios[0], "ratio_max": ratios[-1],
               "identical": identical[method]}
        ttft = ""
        if ttfts[method, "off"]:
            row.update({f"{v}_ttft_ms": statistics.median(ttfts[method, v]) for v in VARIANTS})
            row["ttft_ratio_median"] = statistics.median(a / b for a, b in zip(ttfts[method, "on"],
                                                                               ttfts[method, "off"]))
            ttft = (f"  TTFT off {row['off_ttft_ms']:.0f} ms, on {row['on_ttft_ms']:.0f} ms, on/off median "
                    f"{row['ttft_ratio_median']:.3f}")
        report["methods"][method] = row
        print(f"{method:14s} {row['off_tpot_ms']:8.1f} {row['on_tpot_ms']:8.1f}  "
              f"{row['ratio_median']:.3f} ({row['ratio_min']:.3f}-{row['ratio_max']:.3f})  {identical[method]}{ttft}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if all(identical.values()) or args.switch in CHANGES_ROUNDING else 1


if __name__ == "__main__":
    sys.exit(main())
