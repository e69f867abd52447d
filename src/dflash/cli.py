"""The `dflash` command: generate, data, train, bench, serve.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`; this file only
wires them up. User mistakes (UserError) print one line and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import replace

from .errors import UserError

SUBCOMMANDS = {
    "generate": ("dflash.cli", "speculative generation of one prompt"),
    "data": ("dflash.data", "build a prompt mix and regenerate responses with the target"),
    "train": ("dflash.trainer", "train a DFlash (or EAGLE-3) drafter"),
    "bench": ("dflash.bench", "benchmark methods side by side (tau, speedup, tokens/s)"),
    "serve": ("dflash.server", "OpenAI-compatible HTTP server"),
    "fetch": ("dflash.hub", "download and convert registry target models into the cache"),
}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is already 2; keep it to one line
        self.exit(2, f"dflash: error: {message}\n")


def add_model_arguments(p: argparse.ArgumentParser, with_method: bool = True) -> None:
    """Arguments shared by every command that loads a target (and maybe a drafter)."""
    from .hub import DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET, help="registry name, HF folder, .gguf file or hub id")
    p.add_argument("--drafter", default=None, help="drafter folder (default: the shipped drafter for the target)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--block-size", type=int, default=None, help="DFlash block size (<= the drafter's)")
    p.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="run the drafter in this dtype (default: the target's); drafts never change the output")
    p.add_argument("--min-confidence", type=float, default=None, metavar="P",
                   help="dflash: verify only the leading drafts the drafter itself believes in, i.e. while the "
                        "running product of its top probabilities stays >= P. Default: 0.05 on CPU, where each "
                        "verified token costs time; 0 (the whole block) elsewhere. Never changes the output")
    if with_method:
        p.add_argument("--method", default="dflash", choices=["dflash", "ar", "ngram", "eagle3"])


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# ---- generate -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--compare-ar", action="store_true",
                   help="also run plain autoregressive decoding and print the speedup (median of 3 interleaved runs)")
    p.add_argument("prompt", help="the prompt text")


def run(args) -> int:
    from .engine import GenerationConfig, SpeculativeDecoder
    from .loading import build_proposer, load_target_cached
    from .sampling import SamplingConfig

    if not args.prompt.strip():
        raise UserError("the prompt is empty")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling)
    config.validate()
    target = load_target_cached(args.target, args.dtype, args.device)
    proposer, note = build_proposer(
        args.method, target, args.drafter, args.block_size, args.draft_dtype, args.min_confidence
    )
    if note:
        print(f"[dflash] {note}", file=sys.stderr)
    prompt_ids = target.encode_prompt(args.prompt, chat=not args.no_chat)
    decoder = SpeculativeDecoder(target, proposer)
    decoder.generate(prompt_ids, GenerationConfig(max_new_tokens=4, sampling=sampling))  # warm-up
    if args.compare_ar and args.method != "ar":
        result, ar_result = compare_with_ar(decoder, SpeculativeDecoder(target), prompt_ids, config)
    else:
        result, ar_result = decoder.generate(prompt_ids, config), None
    stats = result.stats
    if args.json:
        payload = {
            "text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
            "method": args.method, "tau": stats.tau, "tokens_per_s": stats.tokens_per_s,
            "per_position_acceptance": stats.per_position_acceptance, "tau_histogram": stats.tau_histogram,
            "num_rounds": stats.num_rounds, "ttft_ms": 1000 * stats.ttft_s, "tpot_ms": stats.tpot_ms,
        }
        if ar_result is not None:
            payload["ar_tokens_per_s"] = ar_result.stats.tokens_per_s
            payload["speedup"] = stats.tokens_per_s / ar_result.stats.tokens_per_s
        print(json.dumps(payload))
        return 0
    print(result.text)
    line = (
        f"[{args.method}] {stats.new_tokens} tokens, tau {stats.tau:.2f} over {stats.num_rounds} rounds, "
        f"{stats.tokens_per_s:.1f} tok/s, TTFT {1000 * stats.ttft_s:.0f} ms, TPOT {stats.tpot_ms:.1f} ms"
    )
    if ar_result is not None:
        same = "identical" if ar_result.tokens == result.tokens else "DIFFERENT"
        line += (f" | ar {ar_result.stats.tokens_per_s:.1f} tok/s -> speedup "
                 f"{stats.tokens_per_s / ar_result.stats.tokens_per_s:.2f}x (outputs {same}; median of "
                 f"{COMPARE_RUNS} interleaved runs each)")
    print(line, file=sys.stderr)
    return 0


COMPARE_RUNS = 3


def compare_with_ar(decoder, ar_decoder, prompt_ids, config):
    """(method result, ar result), each the run of median speed out of COMPARE_RUNS, alternating which goes first:
    on a shared machine one run of each swings by 10% or more. Every run's output is compared with the first ar's."""
    ar_decoder.generate(prompt_ids, replace(config, max_new_tokens=4))  # warm-up, as the method had
    runs, ar_runs = [], []
    for i in range(COMPARE_RUNS):
        pair = (decoder, ar_decoder) if i % 2 == 0 else (ar_decoder, decoder)
        for d in pair:
            (runs if d is decoder else ar_runs).append(d.generate(prompt_ids, config))
    reference = ar_runs[0].tokens
    for r in runs + ar_runs:  # a differing run must show as DIFFERENT, whichever run is the median
        if r.tokens != reference:
            return r, ar_runs[0]

    def median(results):
        return sorted(results, key=lambda r: r.stats.tokens_per_s)[len(results) // 2]
    return median(runs), median(ar_runs)


# ---- entry point ------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="dflash", description="Lossless block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("dflash"):
                continue  # a subcommand whose module is not part of this build
            raise
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except UserError as exc:
        print(f"dflash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
