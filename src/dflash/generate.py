"""`dflash generate`: speculative generation of one prompt, printed as it comes where stdout is a terminal, with
the acceptance and speed figures after it (and, with --compare-ar, the speedup over plain decoding of the same prompt
through the same engine, outputs compared)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

from .errors import UserError
from .options import (add_method_arguments, add_reasoning_argument, add_sampling_arguments, add_target_arguments,
                      add_tool_format_argument, check_drafter_folders, method_options)
from .prediction import prediction_ids
from .reasoning import check_parser, split, thinking_of
from .models.target import TemplateOptions
from .tools import ToolRequest, encode_chat, for_target, reply_format, tool_request


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
    p.add_argument("--tools", default=None, metavar="FILE|JSON",
                   help="functions and custom tools the reply may call: OpenAI's `tools` list (a file, or the list "
                        "itself); the calls are printed as the reply's JSON, and with --json as `tool_calls`")
    p.add_argument("--tool-choice", default=None, metavar="auto|required|none|NAME",
                   help="with --tools: auto (default; the reply may answer in words), required, none, or a tool's "
                        "name (one call of it)")
    add_tool_format_argument(p)
    add_reasoning_argument(p)
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="the chat template's own variables, e.g. '{\"enable_thinking\": false}' for Qwen3")
    p.add_argument("--prediction", default=None, metavar="FILE|TEXT",
                   help="the output you expect (a file, or the text itself), as OpenAI's Predicted Outputs: its "
                        "tokens are drafted where the output follows them (a file with a few edits comes back "
                        "fast); the output is the same")
    p.add_argument("prompt", help="the prompt text, or - to read it from standard input (e.g. a file: - < FILE)")


def run(args) -> int:
    from .engine import SpeculativeDecoder
    from .loading import settle_heap

    if args.prompt == "-":
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("the prompt is - (standard input), but nothing is piped in: dflash generate - < FILE")
        args.prompt = sys.stdin.read()
    if not args.prompt.strip():
        raise UserError("the prompt is empty")
    if args.logprobs is not None and not args.json:
        raise UserError("--logprobs goes with --json")
    config = config_from_args(args, logprobs=args.logprobs, ignore_eos=args.ignore_eos)
    prediction = text_or_file(args.prediction)
    tools = tools_from_args(args)
    template = template_options_from_args(args)
    if template.kwargs and args.no_chat:
        raise UserError("--chat-template-kwargs goes to the chat template: drop --no-chat")
    response_format, json_schema = reply_format(tools, config.response_format, config.json_schema)
    config = replace(config, response_format=response_format, json_schema=json_schema)
    target, proposer = load_method(args, config)
    config = with_bad_words(config, target, args)
    if tools is not None:  # in the target's call format, known now that it has loaded
        tools = for_target(tools, target.tokenizer, args.tool_format)
        config = replace(config, **dict(zip(("response_format", "json_schema"), tools.output_format())))
    prompt_ids = encode_chat(target, [{"role": "user", "content": args.prompt}], tools, template) \
        if tools is not None or template.kwargs else target.encode_prompt(args.prompt, chat=not args.no_chat)
    parser = check_parser(args.reasoning_parser)
    config = replace(config, thinking=thinking_of(target, prompt_ids, parser),
                     prediction=prediction_ids(target.tokenizer, prediction))
    decoder = SpeculativeDecoder(target, proposer, adaptive=not args.whole_blocks)
    settle_heap()
    warm_up = replace(config, max_new_tokens=WARM_UP_TOKENS, logprobs=None, ignore_eos=False)
    decoder.generate(prompt_ids, warm_up)
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
            "accepted_prediction_tokens": stats.prediction_accepted,
            "rejected_prediction_tokens": stats.prediction_rejected, "adaptive": not args.whole_blocks,
            "num_rounds": stats.num_rounds, "ttft_ms": 1000 * stats.ttft_s,
            "tpot_ms": stats.tpot_ms, "engine": target.backend, "kernels": target.kernel_report,
            "drafter": proposer.report,
        }
        thought, answer = split(result.text, config.thinking)
        if parser is not None:
            payload.update(reasoning=thought, content=answer)
        if tools is not None:
            payload["tool_calls"] = tools.calls(answer)
        if result.logprobs is not None:
            payload["logprobs"] = [logprob_json(target, entry) for entry in result.logprobs]
        if ar_result is not None:
            payload["ar_tokens_per_s"] = ar_result.stats.tokens_per_s
            payload["speedup"] = stats.tokens_per_s / ar_result.stats.tokens_per_s
        print(json.dumps(payload))
        return 0
    if streaming is None:
        print(result.text)
    line = figures_line(args.method, stats)
    if ar_result is not None:
        same = "identical" if ar_result.tokens == result.tokens else "DIFFERENT"
        line += (f" | ar {ar_result.stats.tokens_per_s:.1f} tok/s -> speedup "
                 f"{stats.tokens_per_s / ar_result.stats.tokens_per_s:.2f}x (outputs {same}; median of "
                 f"{COMPARE_RUNS} interleaved runs each)")
    print(line, file=sys.stderr)
    return 0


COMPARE_RUNS = 3


def config_from_args(args, **more):
    """The GenerationConfig of the sampling options (add_sampling_arguments) and `more` of its fields."""
    from .engine import GenerationConfig

    response_format, json_schema = output_format_from_args(args)
    if args.include_stop_str and not args.stop:
        raise UserError("--include-stop-str keeps the --stop string that ended the output: give --stop")
    if any(not word.strip() for word in args.bad_words or ()):
        raise UserError("--bad-words takes non-empty words")
    return GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling_from_args(args),
                            stop_strings=tuple(args.stop or ()), include_stop_strings=args.include_stop_str,
                            stop_token_ids=tuple(args.stop_token_ids or ()),
                            response_format=response_format, json_schema=json_schema, **more)


def output_format_from_args(args) -> tuple[str | None, dict | None]:
    """(response_format, json_schema) of --response-format, --json-schema, --regex, --choice, --grammar or
    --structural-tag (one of them)."""
    from .ebnf import grammar_format
    from .regex_grammar import pattern_format
    from .structural_tags import structural_tag_format

    given = [name for name, value in (("--response-format", args.response_format != "text"),
                                      ("--json-schema", args.json_schema), ("--regex", args.regex),
                                      ("--choice", args.choice), ("--grammar", args.grammar),
                                      ("--structural-tag", args.structural_tag)) if value]
    if len(given) > 1:
        raise UserError(f"{' and '.join(given)} each constrain the output: give one")
    if args.grammar is not None:
        return grammar_format(grammar_text(args.grammar))
    if args.structural_tag is not None:
        return structural_tag_format(json_option(args.structural_tag, "--structural-tag",
                                                 "a structural tag's file or its JSON", "{"))
    pattern = pattern_format(args.regex, args.choice)
    if pattern is not None:
        return pattern
    schema = json_schema_from(args.json_schema)
    if schema is not None:
        return "json_schema", schema
    return (None, None) if args.response_format == "text" else (args.response_format, None)


def text_or_file(given: str | None) -> str | None:
    """An option that takes a file or the text itself: the file's text where `given` names one."""
    if given is None:
        return None
    path = Path(given)
    try:
        return path.read_text() if len(given) < 4096 and "\n" not in given and path.is_file() else given
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read {given}: {error}") from None


def grammar_text(given: str) -> str:
    """--grammar: a file holding the grammar, or the grammar itself (EBNF's `root ::= ...` or Lark's `start: ...`)."""
    from .lark_grammar import looks_like_lark

    text = text_or_file(given)
    if text is given and "::=" not in given and not looks_like_lark(given):
        raise UserError(f"--grammar takes a grammar (EBNF's `root ::= ...`, Lark's `start: ...`) or a file holding "
                        f"one; {given!r} is neither")
    return text


def json_schema_from(given: str | None) -> dict | None:
    """--json-schema: a file holding the schema, or the schema itself."""
    schema = json_option(given, "--json-schema", "a JSON Schema file or the schema as JSON", "{")
    if schema is not None and not isinstance(schema, dict):
        raise UserError("--json-schema must be a JSON object")
    return schema


def tools_from_args(args) -> ToolRequest | None:
    """--tools (a file holding OpenAI's list, or the list itself) and --tool-choice, checked before the target loads."""
    if args.tools is None:
        if args.tool_choice is not None:
            raise UserError("--tool-choice goes with --tools")
        return None
    if args.no_chat:
        raise UserError("--tools needs the chat template (no --no-chat): the tools are described in its system "
                        "message")
    tools = json_option(args.tools, "--tools", "a file holding OpenAI's tools list or the list as JSON", "[")
    choice = args.tool_choice
    if choice is not None and choice not in ("auto", "required", "none"):  # a tool's name: a function's or custom's
        custom = isinstance(tools, list) and any(
            isinstance(tool, dict) and tool.get("type") == "custom" and isinstance(tool.get("custom"), dict)
            and tool["custom"].get("name") == choice for tool in tools)
        kind = "custom" if custom else "function"
        choice = {"type": kind, kind: {"name": choice}}
    return tool_request(tools, choice)


def template_options_from_args(args) -> TemplateOptions:
    """--chat-template-kwargs as the chat template's options, checked before the target loads."""
    kwargs = json_option(args.chat_template_kwargs, "--chat-template-kwargs", "a JSON object", "{")
    options = TemplateOptions({} if kwargs is None else kwargs)
    options.check([])
    return options


def json_option(given: str | None, flag: str, wanted: str, opening: str):
    """A JSON option's value: a file holding it, or the JSON itself (text that opens with `opening`)."""
    if given is None:
        return None
    path = Path(given)
    text = path.read_text() if not given.lstrip().startswith(opening) and path.is_file() else given
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise UserError(f"{flag} takes {wanted}: {error}") from None


def sampling_from_args(args):
    from .sampling import SamplingConfig

    return SamplingConfig(args.temperature, args.top_k, args.top_p, args.seed, args.presence_penalty,
                          args.frequency_penalty, args.repetition_penalty, min_p=args.min_p,
                          min_tokens=args.min_tokens, allowed_token_ids=tuple(args.allowed_token_ids or ()))


def with_bad_words(config, target, args):
    """`config` with --bad-words spelt in the target's tokens (known once it has loaded)."""
    from .sampling import bad_word_ids

    if not args.bad_words:
        return config
    return replace(config, sampling=replace(config.sampling, bad_word_ids=bad_word_ids(target.tokenizer,
                                                                                         args.bad_words)))


def load_method(args, config):
    """(target, proposer) for --target and --method, after the config and drafter folders are checked: a mistake
    is said before the target takes seconds to load."""
    from .loading import build_proposer, target_from_args

    config.validate()
    check_drafter_folders(args.drafter, [args.method])
    options = method_options(args, args.method)
    target = target_from_args(args, release_plain=True)
    proposer, note = build_proposer(args.method, target, options)
    if note:
        print(f"[dflash] {note}", file=sys.stderr)
    return target, proposer


def figures_line(method: str, stats) -> str:
    """One generation's acceptance and speed, as generate and chat print them after the text."""
    table = f"{stats.table_rounds} from the continuation table" if stats.table_rounds else ""
    lookup = (f" ({stats.lookup_rounds} by prompt lookup{', ' + table if table else ''})" if stats.lookup_rounds
              else f" ({table})" if table else "")
    predicted = stats.prediction_accepted + stats.prediction_rejected
    prediction = (f", {stats.prediction_accepted} of {predicted} predicted tokens verified accepted" if predicted
                  else "")
    return (f"[{method}] {stats.new_tokens} tokens, tau {stats.tau:.2f} over {stats.num_rounds} rounds{lookup}"
            f"{prediction}, {stats.tokens_per_s:.1f} tok/s, TTFT {1000 * stats.ttft_s:.0f} ms, "
            f"TPOT {stats.tpot_ms:.1f} ms")


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

        self.deltas = TextDeltas.of(target, config)

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
