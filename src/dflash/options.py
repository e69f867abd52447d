"""What the commands share: the argument groups (so the same thing has the same flag everywhere), what those
arguments mean to a method (`method_options`, the --drafter folders), and how `kill` stops long work.

    target options   --target --dtype --device --threads --compile --cuda-graphs --chat-template --kernels
                     every command that loads a target
    method options   --method --drafter --block-size --draft-dtype --continuations --tree --whole-blocks
                     generate and serve (bench: --methods)
    sampling options --max-new-tokens --temperature --top-p --top-k --seed and the penalties
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    from .hub import DEFAULT_TARGET
    from .models.target import KERNEL_CHOICES, TARGET_DTYPES

    group = p.add_argument_group("target")
    group.add_argument("--target", "--model", "--model-path", default=DEFAULT_TARGET,
                       help=f"registry name, HF folder, .gguf file or hub id (default: {DEFAULT_TARGET}; --model is "
                            "vLLM's name for it, --model-path SGLang's)")
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
    group.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (a file, or the template itself) in place of the target's own, as "
                            "vLLM's --chat-template (e.g. one that writes tool calls in <tool_call> tags)")
    group.add_argument("--kernels", default="auto", choices=list(KERNEL_CHOICES),
                       help="CPU matmul kernels: auto = the fastest of packed oneDNN, plain PyTorch and our AVX2 "
                            "kernel per weight shape and row count, measured once per machine and cached "
                            "(default: auto)")


def add_tool_format_argument(p: argparse.ArgumentParser) -> None:
    from .tools import STYLES

    p.add_argument("--tool-format", default="auto", choices=list(STYLES),
                   help="how the target writes tool calls: auto = its chat template's own, hermes (<tool_call> tags) "
                        "or llama3_json (Llama 3's {\"name\", \"parameters\"} objects), where the template writes "
                        "them, else json (dflash's own: a JSON array of calls, the tools described in the system "
                        "message) (default: auto)")


def add_reasoning_argument(p: argparse.ArgumentParser) -> None:
    from .reasoning import PARSERS

    p.add_argument("--reasoning-parser", default=None, choices=["none", *PARSERS],
                   help="return a reasoning model's <think>...</think> apart from its answer (`reasoning` beside "
                        "`content`); structured output and tool calls then hold the answer after the thinking "
                        "(qwen3 and deepseek_r1 are vLLM's names for the same format)")


def add_method_arguments(p: argparse.ArgumentParser, several: bool = False) -> None:
    """--method (or --methods for bench) and how the methods draft."""
    from .methods import registry
    from .methods.base import DRAFT_PRECISIONS, MethodOptions

    group = p.add_argument_group("drafting method")
    if not several:
        group.add_argument("--method", "--speculative-algorithm", default=registry.DEFAULT_METHOD, type=str.lower,
                           choices=registry.names(),
                           help="; ".join(f"{m.name}: {m.summary}" for m in registry.METHODS.values())
                           + " (--speculative-algorithm DFLASH, EAGLE3 or NGRAM: SGLang's flag)")
        group.add_argument("--speculative-config", default=None, metavar="JSON",
                           help="vLLM's speculative config in place of --method, --drafter and --block-size: "
                                "'{\"method\": \"dflash\", \"model\": \"FOLDER\", \"num_speculative_tokens\": "
                                "15}' (methods dflash, eagle3, ngram, or dflash's NAME+ngram; an ngram's "
                                "prompt_lookup_max and _min: prompt lookup's longest and shortest match)")
    group.add_argument("--drafter", "--speculative-draft-model-path", action="append", default=None,
                       metavar="[METHOD=]PATH",
                       help="drafter folder (default: the one shipped for the target). METHOD=PATH names the method "
                            "it is for" + ("; repeat for several methods" if several else "")
                            + " (--speculative-draft-model-path: SGLang's flag)")
    group.add_argument("--block-size", "--speculative-num-draft-tokens", type=int, default=MethodOptions.block_size,
                       metavar="B",
                       help="tokens verified per round at most, the bonus included: dflash's block size, EAGLE-3's "
                            "chain depth + 1, ngram's copied drafts + 1; 2 to 64 (default: what the drafter was "
                            "trained with; ngram 8; --speculative-num-draft-tokens: SGLang's flag)")
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


def apply_speculative_config(args) -> None:
    """--speculative-config (vLLM's) as the --method, --drafter and --block-size it says, checked before anything
    loads; given beside any of them, an error."""
    import json

    from .methods import registry

    if getattr(args, "speculative_config", None) is None:
        return
    if args.method != registry.DEFAULT_METHOD or args.drafter or args.block_size is not None:
        raise UserError("--speculative-config says the method, drafter and block size: give it or --method, "
                        "--drafter and --block-size, not both")
    try:
        config = json.loads(args.speculative_config)
    except json.JSONDecodeError as exc:
        raise UserError(f"--speculative-config is not valid JSON ({exc.msg}): {args.speculative_config!r}") from None
    args.method, fields = registry.from_speculative_config(config)
    args.drafter = None if fields["drafter"] is None else [fields["drafter"]]
    args.block_size = fields["block_size"]
    args.prompt_lookup_max, args.prompt_lookup_min = fields.get("prompt_lookup_max"), fields.get("prompt_lookup_min")


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
    from .checkpoint import check_folder, folder_not_found

    for method, path in drafter_paths(values, methods).items():
        if not Path(path).exists():
            raise folder_not_found(path, f"{method}'s drafter")
        check_folder(path, f"{method} drafter")


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
        prompt_lookup_max=getattr(args, "prompt_lookup_max", None) if registry.uses_lookup(method) else None,
        prompt_lookup_min=getattr(args, "prompt_lookup_min", None) if registry.uses_lookup(method) else None,
    )


def add_sampling_arguments(p: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    group = p.add_argument_group("sampling")
    group.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                       help=f"stop after this many new tokens (default: {max_new_tokens})")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1 = off)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (default: 0 = off)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="sample among the tokens at least this times as likely as the likeliest (default: 0 = off)")
    group.add_argument("--min-tokens", type=int, default=0,
                       help="no stop token (EOS, stop ids) before this many new tokens; stop strings still end the "
                            "output (default: 0)")
    group.add_argument("--seed", type=int, default=None, help="sampling seed (default: unseeded)")
    group.add_argument("--stop", action="append", default=None, metavar="TEXT",
                       help="a string that ends the output, itself left out (repeat for several)")
    group.add_argument("--include-stop-str", action="store_true",
                       help="keep the stop string that ended the output (vLLM's include_stop_str_in_output)")
    group.add_argument("--stop-token-ids", type=token_ids, default=None, metavar="ID,ID,...",
                       help="token ids that end the output too, beside the target's EOS")
    group.add_argument("--allowed-token-ids", type=token_ids, default=None, metavar="ID,ID,...",
                       help="the only tokens the output may have (vLLM's allowed_token_ids)")
    group.add_argument("--bad-words", action="append", default=None, metavar="WORD",
                       help="a word the output never completes (vLLM's bad_words; repeat for several)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtracted from the logit of every token generated so far, in [-2, 2] (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtracted once per time a token was generated so far, in [-2, 2] (default: 0)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="divides the positive logits (multiplies the negative) of tokens in the prompt or output, "
                            "as transformers does (default: 1 = off)")
    group.add_argument("--response-format", choices=["text", "json_object"], default="text",
                       help="json_object: the output is always a JSON object (OpenAI's JSON mode; still lossless: "
                            "the target's own constrained choices) (default: text)")
    group.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                       help="the output is always an object this JSON Schema allows (a file, or the schema itself)")
    add_pattern_arguments(group)


def token_ids(text: str) -> tuple[int, ...]:
    """Token ids as one argument, "5,17,42" (several arguments would swallow the prompt after them)."""
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"token ids are integers separated by commas, got {text!r}") from None


def add_pattern_arguments(group) -> None:
    """--regex, --choice (regex_grammar.py), --grammar (ebnf.py) and --structural-tag (structural_tags.py), beside
    --response-format and --json-schema."""
    group.add_argument("--regex", default=None, metavar="PATTERN",
                       help="the whole output matches this regular expression (vLLM's structured outputs regex)")
    group.add_argument("--choice", nargs="+", default=None, metavar="TEXT",
                       help="the output is exactly one of these strings (vLLM's structured outputs choice)")
    group.add_argument("--grammar", default=None, metavar="FILE|EBNF",
                       help="the whole output is one this grammar allows: EBNF as xgrammar and llama.cpp's GBNF write "
                            "it, `root ::= ...`, or Lark's `start: ...` (a file, or the grammar itself; vLLM's "
                            "structured outputs grammar)")
    group.add_argument("--structural-tag", default=None, metavar="FILE|JSON",
                       help="free text in which each trigger opens a JSON document between a structure's begin and "
                            "end: {\"structures\": [{\"begin\": ..., \"schema\": {...}, \"end\": ...}], "
                            "\"triggers\": [...]} (a file, or the JSON itself; vLLM's and SGLang's structural_tag)")


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


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
