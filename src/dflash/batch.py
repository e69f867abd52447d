"""`dflash batch IN.jsonl --output OUT.jsonl`: many prompts through one loaded target and method as one continuous
batch, each answer appended to the output as it finishes, with its row's id. An interrupted run loses nothing but
the answers under way, and the same command resumes it: rows whose id the output already holds are skipped. A file
in OpenAI's batch format goes through the server's handlers instead (openai_batch.py).

Rows come in any layout `dflash bench` reads; a chat (`messages`, `conversations`) is answered after its last user
turn, its earlier assistant turns included (jsonl.conversation_of). A row's own `response_format`, or `tools` and
`tool_choice` (OpenAI's; its answer then holds `tool_calls` where it called them, tools.py), and its
`chat_template_kwargs` (the command line's otherwise), hold its answer alone; its `prediction` (OpenAI's Predicted
Outputs, prediction.py) is drafted where its answer follows it. A row's own `max_tokens`, `temperature`, `top_p`,
`top_k`, `min_p`, `seed` and `stop` (OpenAI's names) take the command line's place for it. With --reasoning-parser
an answer holds its `reasoning` and `content` apart (reasoning.py). Greedy answers are the target's own, token for
token."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError
from .generate import config_from_args, load_method, template_options_from_args, with_bad_words
from .jsonl import conversation_of, iter_jsonl, layouts_hint
from .models.target import TemplateOptions
from .options import (add_method_arguments, add_reasoning_argument, add_sampling_arguments, add_target_arguments,
                      add_tool_format_argument, kill_stops_like_ctrl_c)
from .prediction import prediction_ids, prediction_text
from .reasoning import check_parser, split, thinking_of
from .tools import ToolRequest, encode_chat, for_target, reply_format, tool_request

if TYPE_CHECKING:
    from .engine import GenerationConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_target_arguments(p)
    add_method_arguments(p)
    add_sampling_arguments(p)
    add_tool_format_argument(p)
    add_reasoning_argument(p)
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON",
                   help="the chat template's own variables for every row without its own `chat_template_kwargs`")
    p.add_argument("input", nargs="?", default=None,
                   help="JSONL of prompts (the layouts `dflash bench` reads); each row's `id`, else its line; "
                   "a row's `response_format` (or vLLM's `structured_outputs`), or `tools` and `tool_choice` "
                   "(OpenAI's), `chat_template_kwargs`, and `max_tokens`, `temperature`, `top_p`, `top_k`, `min_p`, "
                   "`seed`, `stop` hold its answer alone. Or a file in OpenAI's batch format "
                   "(custom_id, method, url, body; as vLLM's run-batch reads it): each body answered as `dflash "
                   "serve` would, in OpenAI's batch output format")
    p.add_argument("-i", "--input-file", default=None, metavar="INPUT", help="the input, as vLLM's run-batch takes it")
    p.add_argument("-o", "--output", "--output-file", required=True,
                   help="JSONL the answers are appended to (and resumed from)")
    p.add_argument("--max-batch", type=int, default=8, help="prompts generated at once (default: 8)")
    p.add_argument("--no-chat", action="store_true", help="send each prompt raw, without the chat template")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class BatchRow:
    rid: str
    messages: list[dict]
    own_format: tuple | None  # its response_format as (response_format, json_schema); None: the command line's
    tools: ToolRequest | None
    template_kwargs: dict | None  # its chat_template_kwargs; None: the command line's
    prediction: str = ""  # its prediction's text (prediction.prediction_text)
    settings: dict = field(default_factory=dict)  # its own sampling settings (row_settings), by OpenAI's names


def read_requests(path: Path) -> list[BatchRow]:
    """Every row; UserError naming the line for a row without a prompt, a repeated id, a format that cannot be
    enforced, bad tools or template variables that are not an object."""
    if not path.is_file():
        raise UserError(f"input file not found: {path}")
    requests, seen = [], set()
    for line_no, row in iter_jsonl(path):
        messages = conversation_of(row)
        if messages is None:
            raise UserError(f"{path}:{line_no} needs {layouts_hint()}; a chat needs a user turn, and `turns` one turn")
        rid = str(row.get("id", line_no - 1))
        if rid in seen:
            raise UserError(f"{path}:{line_no} repeats the id {rid!r}: ids must be unique to resume a run")
        seen.add(rid)
        where = f"{path}:{line_no}"
        own, tools = row_format(row, where), row_tools(row, where)
        kwargs = row.get("chat_template_kwargs")
        try:
            reply_format(tools, *(own or (None, None)))
            TemplateOptions(kwargs or {}).check(messages)
            prediction = prediction_text(row.get("prediction"))
            settings = row_settings(row)
        except UserError as error:
            raise UserError(f"{where}: {error}") from None
        requests.append(BatchRow(rid, messages, own, tools, kwargs, prediction, settings))
    if not requests:
        raise UserError(f"{path} holds no prompts")
    return requests


def row_format(row: dict, where: str) -> tuple[str | None, dict | None] | None:
    """A row's own structured output, OpenAI's `response_format`: {"type": "json_object"}, {"type": "json_schema",
    "json_schema": {"schema": {...}}}, {"type": "text"} or {"type": "structural_tag", ...}, or vLLM's
    `structured_outputs` (or guided_regex, guided_choice, guided_json, guided_grammar; SGLang's `ebnf`), as
    (response_format, json_schema); None: the command line's. Checked (the schema or grammar compiled) before the
    target loads."""
    from .structural_tags import structural_tag_format
    from .structured import one_constraint, output_grammar, vllm_format

    given = row.get("response_format")
    if given is not None and (not isinstance(given, dict) or not isinstance(given.get("json_schema", {}), dict)):
        raise UserError(f"{where}: response_format must be an object such as {{\"type\": \"json_object\"}}")
    try:
        vllm = vllm_format(row.get("structured_outputs"), row.get("guided_regex"), row.get("guided_choice"),
                           row.get("guided_json"), row.get("guided_grammar"), row.get("ebnf"))
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    if given is None:
        return vllm
    kind = given.get("type")
    schema = given.get("json_schema", {}).get("schema") if kind == "json_schema" else None
    chosen = (None if kind == "text" else kind, schema)
    try:
        if kind == "structural_tag":
            chosen = structural_tag_format(given)
        output_grammar(*chosen)
        return one_constraint(chosen, vllm, "structured_outputs (or guided_*)")
    except UserError as error:
        raise UserError(f"{where}: {error}") from None


def row_tools(row: dict, where: str) -> ToolRequest | None:
    """A row's own `tools`, `tool_choice` and `parallel_tool_calls` (OpenAI's), checked before the target loads."""
    try:
        return tool_request(row.get("tools"), row.get("tool_choice"), row.get("parallel_tool_calls", True))
    except UserError as error:
        raise UserError(f"{where}: {error}") from None


ROW_SETTINGS = {"max_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int,
                "stop": list}


def row_settings(row: dict) -> dict:
    """A row's own sampling settings (ROW_SETTINGS, OpenAI's names; `stop` a string or a list of them), checked
    before the target loads."""
    settings = {key: row[key] for key in ROW_SETTINGS if row.get(key) is not None}
    if isinstance(settings.get("stop"), str):
        settings["stop"] = [settings["stop"]]
    for key, value in settings.items():
        kind = ROW_SETTINGS[key]
        if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind) or (
                key == "stop" and not all(isinstance(stop, str) for stop in value)):
            expected = {int: "an integer", float: "a number", list: "a string or a list of strings"}[kind]
            raise UserError(f"{key} must be {expected}, got {value!r}")
    from .engine import GenerationConfig

    with_settings(GenerationConfig(), settings).validate()
    return settings


def with_settings(config: "GenerationConfig", settings: dict) -> "GenerationConfig":
    """`config` with a row's own sampling settings in place of its own."""
    sampling = replace(config.sampling, **{key: settings[key] for key in ("temperature", "top_p", "top_k", "min_p",
                                                                         "seed") if key in settings})
    return replace(config, sampling=sampling, max_new_tokens=settings.get("max_tokens", config.max_new_tokens),
                   stop_strings=tuple(settings.get("stop", config.stop_strings)))


def row_config(config, own: tuple | None, tools: ToolRequest | None, settings: dict | None = None):
    """The command line's config with a row's own output format (or its tools' calls) and sampling settings."""
    response_format, json_schema = reply_format(tools, *(own or (config.response_format, config.json_schema)))
    return with_settings(replace(config, response_format=response_format, json_schema=json_schema), settings or {})


def answered_ids(output: Path, key: str = "id") -> set[str]:
    """The ids (each line's `key`) the output already holds; a last line cut short by a kill is cut off the file (its
    row is answered again), so that what is appended starts on a line of its own"""
    if not output.exists():
        return set()
    text = output.read_bytes()
    if text and not text.endswith(b"\n"):
        with output.open("r+b") as f:
            f.truncate(text.rfind(b"\n") + 1)
    done = set()
    for line in output.read_text(encoding="utf-8").splitlines():
        try:
            done.add(str(json.loads(line)[key]))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return done


def still_to_answer(requests: list, output: Path, id_of, key: str = "id") -> list:
    """The requests whose id (`id_of(request)`) the output does not hold yet, in order; a resumed run says how many
    are done."""
    done = answered_ids(output, key)
    todo = [request for request in requests if id_of(request) not in done]
    if len(todo) < len(requests):
        print(f"[dflash] {len(requests) - len(todo)} of {len(requests)} answers already in {output}; "
              f"{len(todo)} to go", file=sys.stderr)
    return todo


def encode(target, messages: list[dict], chat: bool, tools: ToolRequest | None = None,
           options: TemplateOptions | None = None) -> list[int]:
    if chat:
        return encode_chat(target, messages, tools, options)
    if tools is not None:
        raise UserError("--no-chat sends one prompt as it is: a row with tools needs the chat template")
    if len(messages) > 1:
        raise UserError("--no-chat sends one prompt as it is: a chat or a system message needs the chat template")
    return target.encode_prompt(messages[0]["content"], chat=False)


def run(args) -> int:
    from tqdm import tqdm

    from .engine import Engine
    from .loading import settle_heap

    from . import openai_batch

    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if (args.input is None) == (args.input_file is None):
        raise UserError("give the input file once: as the first argument, or as -i/--input-file (vLLM's run-batch)")
    args.input = args.input or args.input_file
    if openai_batch.is_openai_batch(Path(args.input)):
        return openai_batch.run(args)
    requests, output = read_requests(Path(args.input)), Path(args.output)
    kwargs = template_options_from_args(args).kwargs
    parser = check_parser(args.reasoning_parser)
    todo = still_to_answer(requests, output, lambda request: request.rid)
    if not todo:
        return 0
    config = config_from_args(args)
    target, proposer = load_method(args, config)
    config = with_bad_words(config, target, args)
    engine = Engine(target, proposer, max_batch=args.max_batch, adaptive=not args.whole_blocks)
    settle_heap()
    tools_of = {row.rid: for_target(row.tools, target.tokenizer, args.tool_format) for row in todo}
    ids = {row.rid: encode(target, row.messages, not args.no_chat, tools_of[row.rid],
                           TemplateOptions(row.template_kwargs or kwargs or {})) for row in todo}
    configs = {row.rid: replace(row_config(config, row.own_format, tools_of[row.rid], row.settings),
                                thinking=thinking_of(target, ids[row.rid], parser),
                                prediction=prediction_ids(target.tokenizer, row.prediction)) for row in todo}
    for rid, prompt in ids.items():
        try:
            engine.budget(prompt)
        except UserError as exc:
            raise UserError(f"row {rid!r}: {exc}") from None
    output.parent.mkdir(parents=True, exist_ok=True)
    written, tokens, start = 0, 0, time.perf_counter()
    with kill_stops_like_ctrl_c(), output.open("a", encoding="utf-8") as out, \
            tqdm(total=len(todo), unit="prompt", disable=args.no_progress, file=sys.stderr) as bar:
        owner = {id(engine.submit(prompt, configs[rid])): rid for rid, prompt in ids.items()}
        try:
            with target.weights_held():
                while engine.busy:
                    for seq in engine.step():
                        result = seq.result
                        rid = owner[id(seq)]
                        out.write(json.dumps(answer_row(rid, result, tools_of[rid], configs[rid].thinking,
                                                        parser is not None)) + "\n")
                        out.flush()  # on disk as it finishes: a kill loses only the answers under way
                        written, tokens = written + 1, tokens + len(result.tokens)
                        bar.update(1)
                        bar.set_postfix_str(f"{tokens / (time.perf_counter() - start):.1f} tok/s")
        except KeyboardInterrupt:
            print(f"dflash batch: interrupted; {written} answers written to {output}, {len(todo) - written} to go: "
                  "run the same command to continue", file=sys.stderr)
            return 130
    seconds = time.perf_counter() - start
    print(f"[{args.method}] {written} answers, {tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} "
          f"tok/s, up to {args.max_batch} at once); written to {output}", file=sys.stderr)
    return 0


def answer_row(rid: str, result, tools: ToolRequest | None = None, thinking: str | None = None,
               reasoning: bool = False) -> dict:
    """A row's answer; one that called its tools has their calls (OpenAI's layout) and finish_reason tool_calls;
    with `reasoning` (the parser on), its thinking and its answer apart."""
    stats = result.stats
    thought, answer = split(result.text, thinking)
    calls = tools.calls(answer) if tools is not None else None
    row = {"id": rid, "text": result.text, "finish_reason": "tool_calls" if calls else result.finish_reason,
           "prompt_tokens": stats.prompt_tokens, "new_tokens": stats.new_tokens,
           "tau": stats.tau if stats.num_rounds else None}
    if reasoning:
        row.update(reasoning=thought, content=answer)
    return {**row, "tool_calls": calls} if calls else row
