"""The `dflash` command: generate, data, train, bench, serve, fetch.

Each subcommand lives in its own module exposing `add_arguments(parser)` and `run(args) -> int`; this file wires
them up and holds the argument groups they share, so the same thing has the same flag everywhere:

    target options   --target --dtype --device --kernels            every command that loads a target
    method options   --method --drafter --block-size --draft-dtype --continuations   generate and serve (bench: --methods)
    sampling options --max-new-tokens --temperature --top-p --top-k --seed

User mistakes (UserError) print one line and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from . import threads
from .errors import UserError

SUBCOMMANDS = {
    "generate": ("dflash.cli", "speculative generation of one prompt"),
    "data": ("dflash.data", "build a prompt mix and regenerate responses with the target"),
    "train": ("dflash.trainer", "train a DFlash (or EAGLE-3) drafter"),
    "bench": ("dflash.bench", "benchmark methods side by side (tau, speedup, tokens/s)"),
    "serve": ("dflash.serving.app", "OpenAI-compatible HTTP server"),
    "fetch": ("dflash.hub", "download and convert registry target models into the cache"),
}


class ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own exit code is already 2; keep it to one line
        self.exit(2, f"dflash: error: {message}\n")


# ---- shared argument groups -------------------------------------------------------------------------------------
def add_target_arguments(p: argparse.ArgumentParser) -> None:
    from .hub import DEFAULT_TARGET
    from .models.target import KERNEL_CHOICES, TARGET_DTYPES

    group = p.add_argument_group("target")
    group.add_argument("--target", default=DEFAULT_TARGET,
                       help=f"registry name, HF folder, .gguf file or hub id (default: {DEFAULT_TARGET})")
    group.add_argument("--dtype", default="float32", choices=list(TARGET_DTYPES),
                       help="the target's dtype (default: float32, the exact one); int8: int8 weights in its decoder "
                            "layers, a scale per output row, with bfloat16 activations (CPU; like llama.cpp's Q8_0)")
    group.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu or cuda (default: cuda if present)")
    group.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads, fixed (default: one per core, or one fewer while that measures "
                            "faster, e.g. beside another busy process)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile our forward: with CUDA graphs, the graphed passes' layers (inductor's "
                            "fused kernels, captured by the graphs; each pass width compiles at its first use); "
                            "without, every layer (a minute or more at start; on 2 AMD EPYC cores it did not beat "
                            "the packed eager kernels, see docs/RESULTS.md)")
    group.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                       help="replay decode steps and verify passes as CUDA graphs (each shape captured on first use, "
                            "caches made at 2048 positions or more; default: on for generate and bench with a CUDA "
                            "target through our forward, where an H100 ran ar 13x faster than eagerly; off for "
                            "serve, data and train, whose batches change size; --no-cuda-graphs runs eagerly)")
    group.add_argument("--kernels", default="auto", choices=list(KERNEL_CHOICES),
                       help="CPU matmul kernels: auto = the fastest of packed oneDNN, plain PyTorch and our AVX2 "
                            "kernel per weight shape and row count, measured once per machine and cached "
                            "(default: auto)")


def add_method_arguments(p: argparse.ArgumentParser, several: bool = False) -> None:
    """--method (or --methods for bench) and how the methods draft."""
    from .methods import registry
    from .methods.base import DRAFT_PRECISIONS, MethodOptions

    group = p.add_argument_group("drafting method")
    if not several:
        group.add_argument("--method", default=registry.DEFAULT_METHOD, choices=registry.names(),
                           help="; ".join(f"{m.name}: {m.summary}" for m in registry.METHODS.values()))
    group.add_argument("--drafter", action="append", default=None, metavar="[METHOD=]PATH",
                       help="drafter folder (default: the one shipped for the target). METHOD=PATH names the method "
                            "it is for" + ("; repeat for several methods" if several else ""))
    group.add_argument("--block-size", type=int, default=MethodOptions.block_size, metavar="B",
                       help="tokens verified per round at most, the bonus included: dflash's block size, EAGLE-3's "
                            "chain depth + 1, ngram's copied drafts + 1; 2 to 64 (default: what the drafter was "
                            "trained with; ngram 8)")
    group.add_argument("--draft-dtype", default="auto", choices=["auto", *DRAFT_PRECISIONS],
                       help="the drafter's precision; int8: int8 weights, float32 activations (CPU, fbgemm); "
                            "int8-head: float32 layers on the target's kernels, an int8 LM head; auto = the fastest "
                            "of the target's dtype, bfloat16, int8 and int8-head, timed once per machine (default: "
                            "auto). Drafts never change the output")
    group.add_argument("--continuations", default=None, metavar="FOLDER|none",
                       help="the table of the target's own frequent continuations that prompt lookup (ngram, "
                            "NAME+ngram) drafts from where the text has no earlier match: a folder built by `dflash "
                            "data --out DATA_FOLDER --table FOLDER`, or none (default: the one shipped for a "
                            "registry target, none for others)")
    if not several:
        group.add_argument("--tree", type=int, default=None, metavar="N",
                           help="verify a tree of N drafts a round (1-63): the drafter's top candidates at each block "
                                "position (dflash) or a dynamic tree (eagle3), kept best first by their probability, "
                                "checked in one target pass with a tree mask (our forward); each round verifies the "
                                "most valuable first nodes (all with --whole-blocks). Default: a chain (bench: "
                                "NAME:treeN)")
    group.add_argument("--whole-blocks", action="store_true",
                       help="draft and verify every draft of every round (the paper's setting). Default: each round "
                            "verifies the number of drafts that maximises tokens/s on this machine, from the drafter's "
                            "calibrated confidence and the measured cost of the target's passes, and skips drafting "
                            "while it does not pay. Neither changes the output")


def drafter_paths(values: list[str] | None, methods: list[str]) -> dict[str, str]:
    """--drafter values as {method: path}, keyed by the method whose drafter it is (dflash for dflash+ngram). A bare
    PATH belongs to the only drafter that `methods` load; METHOD=PATH names it."""
    from .methods import registry

    paths: dict[str, str] = {}
    drafting = list(dict.fromkeys(registry.drafter_of(m) for m in methods if registry.get(m).uses_drafter))
    for value in values or []:
        method, sep, path = value.partition("=")
        if sep and method in registry.METHODS:
            if not registry.get(method).uses_drafter:
                raise UserError(f"--drafter {value}: {method} loads no drafter")
            method = registry.drafter_of(method)
            if method not in drafting:  # a warning, not an error: scripts pass one drafter to runs of any methods
                print(f"[dflash] --drafter {value}: no method here loads {method}'s drafter "
                      f"({', '.join(methods)}); not used", file=sys.stderr)
        else:
            if len(drafting) != 1:
                which = ", ".join(drafting) or "none of the methods asked for"
                raise UserError(f"--drafter {value}: say which method it is for (METHOD=PATH; drafters: {which})")
            method, path = drafting[0], value
        if method in paths:
            raise UserError(f"--drafter given twice for {method}")
        paths[method] = path
    return paths


def check_drafter_folders(values: list[str] | None, methods: list[str]) -> None:
    """Each --drafter folder exists: said before the target loads, not after a minute of loading and timing it."""
    for method, path in drafter_paths(values, methods).items():
        if not Path(path).exists():
            raise UserError(f"{method}'s drafter folder not found: {path}")


def method_options(args, method: str, block_size: int | None = None, several: bool = False,
                   tree: int | None = None):
    """MethodOptions for one method from the shared arguments (`block_size`, `tree`: a bench NAME@B:treeN
    override). Among `several` methods (bench), --continuations goes to those that use prompt lookup; for one, it
    must be one."""
    from .methods import registry
    from .methods.base import MethodOptions

    asked = getattr(args, "continuations", None)
    continuations = asked if registry.uses_lookup(method) else None
    if asked is not None and continuations is None and not several:
        raise UserError(f"--continuations applies to prompt lookup (ngram, NAME+ngram), not --method {method}")
    tree = tree if tree is not None else getattr(args, "tree", None)
    if tree is not None and registry.drafter_of(method) not in ("dflash", "eagle3"):
        raise UserError(f"a tree of drafts needs a drafter (dflash, eagle3, NAME+ngram), not {method}")
    return MethodOptions(
        drafter=drafter_paths(args.drafter, [method]).get(registry.drafter_of(method)),
        block_size=block_size if block_size is not None else args.block_size,
        draft_dtype=args.draft_dtype,
        continuations=continuations,
        tree=tree,
    )


def add_sampling_arguments(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    group = p.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                       help=f"stop after this many new tokens (default: {max_new_tokens})")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1 = off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0 = off)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtracted from the logit of every token generated so far, in [-2, 2] (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtracted once per time a token was generated so far, in [-2, 2] (default: 0)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="divides the positive logits (multiplies the negative) of tokens in the prompt or output, "
                            "as transformers does (default: 1 = off)")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


# ---- generate -------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    add_method_arguments(p)
    add_sampling_arguments(p)
    p.add_argument("--no-chat", action="store_true", help="send the prompt raw, without the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--logprobs", type=int, default=None, metavar="K",
                   help="with --json: each token's log-probability (the target's, before temperature, top-k and "
                        "top-p) and the K most likely at its position, K in [0, 20]")
    p.add_argument("--compare-ar", action="store_true",
                   help="also run plain autoregressive decoding and print the speedup (median of 3 interleaved runs)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens tokens, past end-of-sequence (for timing fixed lengths, "
                        "as in bench; the server's ignore_eos)")
    p.add_argument("prompt", help="the prompt text")


def run(args) -> int:
    from .engine import GenerationConfig, SpeculativeDecoder
    from .loading import build_proposer, settle_heap, target_from_args
    from .sampling import SamplingConfig

    if not args.prompt.strip():
        raise UserError("the prompt is empty")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed, args.presence_penalty,
                              args.frequency_penalty, args.repetition_penalty)
    if args.logprobs is not None and not args.json:
        raise UserError("--logprobs goes with --json")
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, logprobs=args.logprobs,
                              ignore_eos=args.ignore_eos)
    config.validate()
    check_drafter_folders(args.drafter, [args.method])
    options = method_options(args, args.method)
    target = target_from_args(args, release_plain=True)
    proposer, note = build_proposer(args.method, target, options)
    if note:
        print(f"[dflash] {note}", file=sys.stderr)
    prompt_ids = target.encode_prompt(args.prompt, chat=not args.no_chat)
    decoder = SpeculativeDecoder(target, proposer, adaptive=not args.whole_blocks)
    settle_heap()
    decoder.generate(prompt_ids, GenerationConfig(max_new_tokens=WARM_UP_TOKENS, sampling=sampling))  # warm-up
    streaming = None
    if args.compare_ar and args.method != "ar":
        result, ar_result = compare_with_ar(decoder, SpeculativeDecoder(target), prompt_ids, config)
    else:
        streaming = None if args.json else live_text(target, config)
        result, ar_result = decoder.generate(prompt_ids, config, streaming), None
        if streaming is not None:
            streaming.finish(result.text)
    stats = result.stats
    if args.json:
        payload = {
            "text": result.text, "tokens": result.tokens, "finish_reason": result.finish_reason,
            "method": args.method, "tau": stats.tau, "tokens_per_s": stats.tokens_per_s,
            "per_position_acceptance": stats.per_position_acceptance, "tau_histogram": stats.tau_histogram,
            "draft_length_histogram": stats.draft_length_histogram, "skipped_drafting": stats.skipped_drafting,
            "lookup_rounds": stats.lookup_rounds, "table_rounds": stats.table_rounds,
            "adaptive": not args.whole_blocks, "num_rounds": stats.num_rounds, "ttft_ms": 1000 * stats.ttft_s,
            "tpot_ms": stats.tpot_ms, "engine": target.backend, "kernels": target.kernel_report,
            "drafter": proposer.report,
        }
        if result.logprobs is not None:
            payload["logprobs"] = [logprob_json(target, entry) for entry in result.logprobs]
        if ar_result is not None:
            payload["ar_tokens_per_s"] = ar_result.stats.tokens_per_s
            payload["speedup"] = stats.tokens_per_s / ar_result.stats.tokens_per_s
        print(json.dumps(payload))
        return 0
    if streaming is None:
        print(result.text)
    table = f"{stats.table_rounds} from the continuation table" if stats.table_rounds else ""
    lookup = (f" ({stats.lookup_rounds} by prompt lookup{', ' + table if table else ''})" if stats.lookup_rounds
              else f" ({table})" if table else "")
    line = (
        f"[{args.method}] {stats.new_tokens} tokens, tau {stats.tau:.2f} over {stats.num_rounds} rounds{lookup}, "
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


# Enough rounds for the thread chooser's first probe and its confirmation (threads.py), so that beside a busy core
# the measured generation, its prefill included, already runs on the faster count.
WARM_UP_TOKENS = 12


def live_text(target, config) -> "LiveText | None":
    """Where stdout is a terminal, the text is printed as it is generated; a pipe gets it whole at the end."""
    return LiveText(target, config) if sys.stdout.isatty() else None


class LiveText:
    """Prints a generation's text as its tokens come: pieces that never show a stop token or the start of a stop
    string (serving/streaming.py), then the rest of the final text."""

    def __init__(self, target, config):
        from .serving.streaming import TextDeltas

        self.deltas = TextDeltas(target.decode, config.stop_strings, config.stop_ids(target.eos_token_ids))

    def __call__(self, new_ids: list[int]) -> None:
        print(self.deltas.push(new_ids), end="", flush=True)

    def finish(self, text: str) -> None:
        print(self.deltas.finish(text), flush=True)


def logprob_json(target, entry) -> dict:
    """One token's log-probability as --json prints it: ids with their text, most likely alternatives first."""
    return {"token": entry.token, "text": target.decode([entry.token]), "logprob": entry.logprob,
            "top": [{"token": t, "text": target.decode([t]), "logprob": lp} for t, lp in entry.top]}


def compare_with_ar(decoder, ar_decoder, prompt_ids, config):
    """(method result, ar result), each the run of median speed out of COMPARE_RUNS, alternating which goes first:
    on a shared machine one run of each swings by 10% or more. Every run's output is compared with the first ar's."""
    ar_decoder.generate(prompt_ids, replace(config, max_new_tokens=WARM_UP_TOKENS))  # warm-up, as the method had
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
    """Every subcommand's parser. A subcommand whose module fails to import is an error, never silently absent."""
    parser = ArgumentParser(prog="dflash", description="Lossless block-diffusion speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=ArgumentParser)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(handler=module.run)
    return parser


@contextmanager
def kill_stops_like_ctrl_c():
    """`kill` (SIGTERM, as `timeout` sends) raises KeyboardInterrupt inside the block, as Ctrl-C does, so that long
    work (a bench, a regeneration) writes what it finished before `main` exits with 130. In the main thread only,
    where Python handles signals; the previous handler is put back after."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "threads", None) is not None:
            if args.threads < 1:
                raise UserError(f"--threads must be >= 1, got {args.threads}")
            import torch

            torch.set_num_threads(args.threads)
            threads.pin()  # without --threads the engine times its passes on n and n - 1 threads (threads.py)
        return args.handler(args) or 0
    except UserError as exc:
        print(f"dflash: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
