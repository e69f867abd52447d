"""Tool calling (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`): the functions a chat offers, described to
the target, and the calls read back from its reply. Three formats ("styles"), the target's chat template picks:

- "hermes", where the template writes calls in `<tool_call>` tags (Qwen2.5, Qwen3, Hermes and the many templates
  that copy them; vLLM's and SGLang's `hermes` parser): the template itself describes the tools and renders earlier
  calls and their results, and a reply writes each call as `<tool_call>\n{"name": ..., "arguments": {...}}\n
  </tool_call>`, after words of its own where the choice is "auto" (they come back as the message's content). The
  grammar (grammar.Frame) holds the tags and the calls between them, and nothing but further calls after them.
- "llama3_json", where the template asks for calls as `{"name": ..., "parameters": {...}}` (Meta's Llama 3.1, 3.2
  and 3.3; vLLM's `llama3_json` parser): the template describes the tools and renders earlier calls and results,
  and a reply that calls is one such object (under "auto", one that opens with `{`; words otherwise).
- "json", dflash's own for every other template (SmolLM2's has no tools): described below.

In the "json" format a reply that calls functions is an array and nothing else,
`[{"name": "get_weather", "arguments": {"city": "Paris"}}]` (a single call may also come as the object alone, as
models trained on other formats write it). The grammar (grammar.py) holds the reply to it, so a
call always parses and its arguments always follow the function's `parameters` schema (what structured output can
enforce; a schema with more is refused in one line naming the tool):
- "required": one call or more (one with `parallel_tool_calls: false`);
- a named function: exactly one call, of it (the bytes up to its arguments are forced, so they are drafted free);
- "auto" (the default): free text, unless the reply opens with `[` (or `{`, one call as an object), where it must
  be calls;
- "none": the tools are left out of the prompt and the reply is free text.
A conversation's earlier calls are shown to the target in the same format, and the tools' results as a user
turn (`NAME returned: ...`), which any chat template renders. `--tool-format json` (LLM's tool_format) picks this
format for a template that has tags too.

Custom tools (OpenAI's `{"type": "custom", "custom": {"name", "description", "format"}}`) take one text as their
input, free or held to a grammar (`format`: {"type": "grammar", "grammar": {"syntax": "lark" | "regex",
"definition": ...}}). In every format the target writes such a call as a function's with one string argument,
`{"name": ..., "arguments": {"input": "..."}}`, whose characters the grammar holds (grammar.py's `x-grammar` and
`pattern`); the call comes back as OpenAI's `{"type": "custom", "custom": {"name", "input"}}`. `tool_choice` may
also name a custom tool, or be `allowed_tools`: every tool stays in the prompt (it does not change from turn to
turn) while the grammar lets only the allowed ones be called.

Speculative decoding stays lossless under the grammar (structured.py): greedy calls are the ones constrained decoding
of the target alone writes.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, replace

from .errors import UserError
from .ebnf import compile_rules
from .grammar import GRAMMAR_KEY, compile_schema, enforceable
from .patterns import compile_pattern
from .regex_grammar import unanchored

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
CHOICES = ("none", "auto", "required")
CALL_OPENERS = ("[", "{")  # a reply that opens so is calls (an array of them, or one as an object)
STYLES = ("auto", "json", "hermes", "llama3_json")
TEMPLATE_STYLES = ("hermes", "llama3_json")  # the template describes the tools and shows earlier calls itself
# what in a template's text says that it writes calls in a style
STYLE_MARKS = {"hermes": "<tool_call>", "llama3_json": "dictionary of argument name"}
# the hermes format's bytes around each call, as Qwen's templates write an assistant turn's calls
HERMES = {"tag": "<tool_call>", "after_tag": "\n", "closer": "\n</tool_call>", "separator": "\n"}
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # OpenAI: parameters omitted
INPUT = "input"  # a custom tool's one argument, as the target writes its calls
KINDS = ("function", "custom")
CALL_TEXT = {"function": "arguments", "custom": "input"}  # the field of a call (of each kind) that holds its text
SYNTAXES = ("lark", "regex")  # a custom tool's grammar


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # as given: what the template shows the target (a custom tool's: its one text, described)
    enforced: dict  # what the calls' grammar holds the arguments to (grammar.enforceable, unless strict)
    kind: str = "function"  # or "custom": its input is one text (the module's docstring)


@dataclass(frozen=True)
class ToolRequest:
    """The tools a request offers and how the reply may use them: `choice` is "auto", "required" or a function's
    name ("none" never makes one: tool_request returns None)."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True
    style: str = "json"  # how calls are written: "json", "hermes" or "llama3_json" (the module's docstring)
    allowed: tuple[str, ...] | None = None  # tool_choice allowed_tools: the only tools a reply may call

    @property
    def several(self) -> bool:
        """Whether a reply may hold more than one call (Llama's format writes one)."""
        return self.parallel and self.choice in ("auto", "required") and self.style != "llama3_json"

    @property
    def arguments_key(self) -> str:
        return "parameters" if self.style == "llama3_json" else "arguments"

    def output_format(self) -> tuple[str, dict]:
        """(response_format, json_schema) for GenerationConfig: the reply's grammar."""
        offered = self.offered()
        key = self.arguments_key
        calls = [{"type": "object", "properties": {"name": {"const": t.name}, key: t.enforced},
                  "required": ["name", key], "additionalProperties": False} for t in offered]
        call = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if self.style == "hermes":
            frame = {**HERMES, "prose": self.choice == "auto", "repeat": self.several}
            return "json_schema_framed", {"schema": call, "frame": frame}
        if self.style == "llama3_json":
            return ("json_schema_or_text" if self.choice == "auto" else "json_schema"), call
        array = {"type": "array", "items": call, "minItems": 1}
        if not self.several:
            array["maxItems"] = 1
        # one call may also come as a bare object, as models trained on other formats write it
        return ("json_schema_or_text" if self.choice == "auto" else "json_schema"), {"anyOf": [array, call]}

    def offered(self) -> list[Tool]:
        """The tools a reply may call."""
        return [t for t in self.tools if (self.allowed is None or t.name in self.allowed)
                and (self.choice in ("auto", "required") or t.name == self.choice)]

    def kind_of(self, name: str) -> str:
        return next((t.kind for t in self.tools if t.name == name), "function")

    def instructions(self) -> str:
        """What the system message tells the target about its tools."""
        lines = ["You can call functions. Each is listed with the JSON Schema of its arguments:"]
        for tool in self.tools:
            about = f" {tool.description.strip()}" if tool.description.strip() else ""
            lines.append(f"- {tool.name}:{about} Arguments: {json.dumps(tool.parameters, ensure_ascii=False)}")
        first = self.offered()[0].name
        if self.allowed is not None:
            lines.append(f"Only these may be called now: {', '.join(self.allowed)}.")
        example = f'[{{"name": "{first}", "arguments": {{...}}}}]'
        if self.choice == "auto":
            lines.append(f"To call functions, reply with only a JSON array of the calls, such as {example}; "
                         "otherwise answer in words.")
        elif self.choice == "required":
            count = "one or more calls" if self.parallel else "one call"
            lines.append(f"Reply with only a JSON array of {count}, such as {example}.")
        else:
            lines.append(f"Call {self.choice}: reply with only a JSON array of one call, {example}.")
        return "\n".join(lines)

    def calls(self, text: str) -> list[dict] | None:
        """The reply's calls in OpenAI's layout (each with an id; a function's arguments the JSON text it wrote, a
        custom tool's input the text), or None where the reply is not calls (free text, or cut short by max_tokens
        or a stop string)."""
        written, whole = self.written(text)
        if not whole or not written:
            return None
        calls = [self.delta(c.name, c.arguments) for c in written]
        return None if None in calls else calls

    def delta(self, name: str, arguments: str) -> dict | None:
        """A whole call in OpenAI's layout: a function's with its arguments' JSON text, a custom tool's with its
        input; None where `name` is no tool's, or the arguments are not the tool's."""
        tool = next((t for t in self.tools if t.name == name), None)
        try:
            value = json.loads(arguments)
        except ValueError:
            return None
        if tool is None or not isinstance(value, dict):
            return None
        if tool.kind == "function":
            return call_delta(name, arguments)
        return call_delta(name, value[INPUT], "custom") if isinstance(value.get(INPUT), str) else None

    def shown(self, call: "WrittenCall") -> str:
        """What of a call being written a stream shows: a function's arguments as written, a custom tool's input
        as far as it is settled."""
        return call.arguments if self.kind_of(call.name) == "function" else input_so_far(call.arguments)

    def written(self, text: str) -> "tuple[list[WrittenCall], bool]":
        """The calls a reply writes, as far as its text goes (the last one's arguments perhaps cut short), and
        whether they are all whole and nothing else follows them. A call counts from its name and `"arguments":` on."""
        head = call_head(self.arguments_key)
        if self.style == "hermes":
            at = text.find(HERMES["tag"])
            return _scan_calls(text, at, head, HERMES["tag"], HERMES["closer"].strip()) if at >= 0 else ([], False)
        at = _skipped(text, 0)
        if text.startswith("[", at) and self.style == "json":
            return _scan_calls(text, at + 1, head, "", ",", last="]")
        return _scan_calls(text, at, head, "", "", single=True) if text.startswith("{", at) else ([], False)

    def content(self, text: str) -> str | None:
        """The words a reply of calls writes before them (hermes), or None where it writes none."""
        if self.style != "hermes":
            return None
        words = text[: max(text.find(HERMES["tag"]), 0)].rstrip()
        return words if words.strip() else None

    def opening(self, text: str, at_start: bool) -> str:
        """Whether a reply's text not yet sent (`at_start`: nothing sent before it) opens calls: "calls" where it
        does, "maybe" where more text must decide (a tag's first bytes at its end), "text" where it is words."""
        if self.choice != "auto":
            return "calls"
        if self.style != "hermes":
            openers = CALL_OPENERS if self.style == "json" else ("{",)
            return "maybe" if at_start and not text else "calls" if at_start and text.startswith(openers) \
                else "text"
        tag = HERMES["tag"]
        if tag in text:
            return "calls"
        return "maybe" if any(text.endswith(tag[:k]) for k in range(1, len(tag))) else "text"


@dataclass
class WrittenCall:
    name: str
    arguments: str  # the JSON text written so far
    whole: bool  # its arguments are closed


INPUT_HEAD = re.compile(r'\{\s*"' + INPUT + r'"\s*:\s*"')


def input_so_far(arguments: str) -> str:
    """The text of a custom call's input in its arguments' JSON text so far (`{"input": "...`), up to its last
    whole character: an escape or a surrogate pair cut short waits for the rest."""
    opening = INPUT_HEAD.match(arguments)
    if opening is None:
        return ""
    at, end = opening.end(), len(arguments)
    settled = at
    while at < end and arguments[at] != '"':
        at += 1 if arguments[at] != "\\" else 6 if arguments.startswith("\\u", at) else 2
        if at <= end:
            settled = at
    text = json.loads('"' + arguments[opening.end():settled] + '"')
    return text[:-1] if text and "\ud800" <= text[-1] <= "\udbff" else text


@functools.cache
def call_head(key: str) -> re.Pattern:
    """A call object's opening, up to its arguments (`key`: "arguments", or Llama's "parameters")."""
    return re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"' + key + r'"\s*:\s*')


def call_delta(name: str, text: str, kind: str = "function") -> dict:
    """A call in OpenAI's layout, with an id of its own: a function's `text` its arguments (JSON), a custom tool's
    its input."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": kind,
            kind: {"name": name, CALL_TEXT[kind]: text}}


def call_parts(call: dict) -> tuple[str, str | None, str]:
    """(kind, name, text) of a call or of a stream's delta of one in OpenAI's layout (call_delta): the name where
    it has one, the text its arguments or input."""
    kind = "custom" if "custom" in call else "function"
    fields = call[kind]
    return kind, fields.get("name"), fields.get(CALL_TEXT[kind]) or ""


def _scan_calls(text: str, at: int, head: re.Pattern, opener: str, separator: str, last: str = "",
                single: bool = False) -> tuple[list[WrittenCall], bool]:
    """The calls written from `at` on: each `opener` (a tag, or nothing), a call object `{"name": ..., "arguments":
    {...}}`, then `separator` before the next (a closing tag, or a comma) or `last` (the array's end); whitespace
    between them. (calls, whether they are whole and nothing else follows)."""
    calls: list[WrittenCall] = []
    while True:
        at = _skipped(text, at)
        if opener:
            if not text.startswith(opener, at):
                return calls, False
            at = _skipped(text, at + len(opener))
        opening = head.match(text, at)
        if opening is None:
            return calls, False
        start = opening.end()
        end = _value_end(text, start) if text.startswith("{", start) else None
        calls.append(WrittenCall(opening.group(1), text[start:end], end is not None))
        if end is None:
            return calls, False
        at = _skipped(text, end)
        if not text.startswith("}", at):
            return calls, False
        at = _skipped(text, at + 1)
        if single or last and text.startswith(last, at):
            return calls, _skipped(text, at + len(last)) == len(text)
        if not text.startswith(separator, at):
            return calls, False
        at += len(separator)
        if opener and _skipped(text, at) == len(text):  # the closing tag of the last call
            return calls, True


def _skipped(text: str, at: int) -> int:
    """`at` moved past whitespace."""
    while at < len(text) and text[at] in " \t\n\r":
        at += 1
    return at


def _value_end(text: str, start: int) -> int | None:
    """Where the JSON object or array at `start` ends (the index after it), None where the text ends first."""
    depth, at, in_string = 0, start, False
    while at < len(text):
        char = text[at]
        if in_string:
            if char == "\\":
                at += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return at + 1
        at += 1
    return None


def reply_format(request: ToolRequest | None, response_format: str | None,
                 json_schema: dict | None) -> tuple[str | None, dict | None]:
    """(response_format, json_schema) of a reply: the calls' grammar where it may call tools, else the format given;
    UserError where both are given."""
    if request is None:
        return response_format, json_schema
    if response_format not in (None, "text") or json_schema is not None:
        raise UserError("a reply either may call tools or follows a response format: give one of them "
                        "(or tool_choice \"none\")")
    return request.output_format()


def tool_style(tokenizer, requested: str = "auto") -> str:
    """The call format for a target's tokenizer: the one its chat template writes calls in ("hermes": `<tool_call>`
    tags; "llama3_json": Llama's objects), else "json"; `requested` (one of STYLES) picks one, a template's own only
    where the template writes it."""
    if requested not in STYLES:
        raise UserError(f"the tool format must be one of {', '.join(STYLES)}, got {requested!r}")
    template = getattr(tokenizer, "chat_template", None) or ""
    text = "\n".join(template.values()) if isinstance(template, dict) else template
    written = [style for style in TEMPLATE_STYLES if STYLE_MARKS[style] in text]
    if requested in TEMPLATE_STYLES and requested not in written:
        raise UserError(f"tool format {requested} needs a chat template that writes calls so, and this target's "
                        f"does not (it lacks {STYLE_MARKS[requested]!r}; use json)")
    return requested if requested != "auto" else written[0] if written else "json"


def for_target(request: ToolRequest | None, tokenizer, requested: str = "auto") -> ToolRequest | None:
    """`request` (checked before the target loaded) in the call format of the target's tokenizer (tool_style)."""
    style = tool_style(tokenizer, requested)
    return None if request is None else replace(request, style=style)


def tool_request(tools: list | None, tool_choice=None, parallel_tool_calls: bool = True,
                 style: str = "json") -> ToolRequest | None:
    """Check OpenAI's `tools` and `tool_choice` (UserError naming what is wrong); None where the reply is free
    text (no tools, or tool_choice "none"). `style`: how the target writes calls (tool_style)."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise UserError("tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise UserError("tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    parsed = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [t.name for t in parsed]
    if len(set(names)) < len(names):
        raise UserError(f"tools name a tool twice: {', '.join(sorted({n for n in names if names.count(n) > 1}))}")
    kinds = {t.name: t.kind for t in parsed}
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "allowed_tools":
        choice, allowed = _allowed(tool_choice, kinds)
    else:
        choice, allowed = _choice(tool_choice, kinds), None
    return None if choice == "none" else ToolRequest(parsed, choice, bool(parallel_tool_calls), style, allowed)


def _tool(tool, where: str) -> Tool:
    kind = tool.get("type") if isinstance(tool, dict) else None
    if kind not in KINDS or not isinstance(tool.get(kind), dict):
        raise UserError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}} or "
                        "{\"type\": \"custom\", \"custom\": {\"name\": ...}} (the kinds of tools a server runs)")
    if kind == "custom":
        return _custom_tool(tool["custom"], where)
    function = tool["function"]
    name, description = function.get("name"), function.get("description") or ""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UserError(f"{where}.function.name must be 1-64 letters, digits, _ or -, got {name!r}")
    if not isinstance(description, str):
        raise UserError(f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    parameters = NO_PARAMETERS if parameters is None else parameters
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise UserError(f"{where}.function.parameters ({name}) must describe an object")
    if function.get("strict") is not True:  # held as far as a grammar can (formats it does not know dropped, ...)
        return Tool(name, description, parameters, enforceable(parameters))
    try:  # strict: enforced whole, or refused
        grammar = compile_schema(parameters)
    except UserError as error:
        raise UserError(f"{where}.function.parameters ({name}, strict): {error}") from None
    if grammar.nodes[grammar.root].kind not in ("object", "tagged"):
        raise UserError(f"{where}.function.parameters ({name}) must describe an object")
    return Tool(name, description, parameters, parameters)


def _custom_tool(custom: dict, where: str) -> Tool:
    """A custom tool: its input one text, free or in a grammar (`format`), as the target's call writes it (a string
    argument, INPUT) and as the template shows it."""
    name, description = custom.get("name"), custom.get("description") or ""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise UserError(f"{where}.custom.name must be 1-64 letters, digits, _ or -, got {name!r}")
    if not isinstance(description, str):
        raise UserError(f"{where}.custom.description must be a string")
    try:
        text, about = _input_format(custom.get("format"))
    except UserError as error:
        raise UserError(f"{where}.custom.format ({name}): {error}") from None
    parameters = {"type": "object", "properties": {INPUT: {"type": "string", "description": about}},
                  "required": [INPUT], "additionalProperties": False}
    return Tool(name, description, parameters, {**parameters, "properties": {INPUT: text}}, "custom")


def _input_format(given) -> tuple[dict, str]:
    """(the schema of a custom tool's input, its description for the target) for its `format`: none or
    {"type": "text"} (free text), or {"type": "grammar", "grammar": {"syntax", "definition"}} (chat's layout; the
    Responses API's puts syntax and definition beside the type); UserError where the grammar cannot be held."""
    if given is None or given == {"type": "text"}:
        return {"type": "string"}, "Any text."
    grammar = given.get("grammar", given) if isinstance(given, dict) and given.get("type") == "grammar" else None
    syntax = grammar.get("syntax") if isinstance(grammar, dict) else None
    definition = grammar.get("definition") if isinstance(grammar, dict) else None
    if syntax not in SYNTAXES or not isinstance(definition, str) or not definition.strip():
        raise UserError('it must be {"type": "text"} or {"type": "grammar", "grammar": {"syntax": "lark" or "regex", '
                        '"definition": "..."}}')
    if syntax == "regex":
        compile_pattern(definition)  # its errors name it as it was given
        pattern = f"^(?:{unanchored(definition)})$"
        return {"type": "string", "pattern": pattern}, f"Text that matches the regular expression {definition}"
    compile_rules(definition)
    return {"type": "string", GRAMMAR_KEY: definition}, f"Text in this Lark grammar:\n{definition}"


def _choice(tool_choice, kinds: dict[str, str]) -> str:
    if tool_choice is None:
        return "auto"
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise UserError(f"tool_choice must be one of {', '.join(CHOICES)}, {{\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, {{\"type\": \"custom\", \"custom\": {{\"name\": "
                            f"...}}}} or allowed_tools, got {tool_choice!r}")
        return tool_choice
    kind = tool_choice.get("type", "function") if isinstance(tool_choice, dict) else None
    named = tool_choice.get(kind) if kind in KINDS else None
    name = named.get("name") if isinstance(named, dict) else None
    if kinds.get(name) != kind:
        given = repr(name) if isinstance(name, str) else repr(tool_choice)
        offered = [n for n, k in kinds.items() if k == kind] if kind in KINDS else list(kinds)
        raise UserError(f"tool_choice must name one of the {kind or 'function'} tools ({', '.join(offered)}), "
                        f"got {given}")
    return name


def _allowed(tool_choice: dict, kinds: dict[str, str]) -> tuple[str, tuple[str, ...]]:
    """(choice, allowed) of tool_choice {"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required",
    "tools": [{"type": "function", "function": {"name": ...}}, ...]}}."""
    allowed = tool_choice.get("allowed_tools")
    mode = allowed.get("mode") if isinstance(allowed, dict) else None
    listed = allowed.get("tools") if isinstance(allowed, dict) else None
    if mode not in ("auto", "required") or not isinstance(listed, list) or not listed:
        raise UserError('tool_choice allowed_tools must be {"mode": "auto" or "required", "tools": [{"type": '
                        '"function", "function": {"name": ...}}, ...]}')
    if not all(isinstance(tool, dict) for tool in listed):
        raise UserError("tool_choice allowed_tools.tools must list tools as objects: {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}")
    names = tuple(dict.fromkeys(_choice(tool, kinds) for tool in listed))
    return mode, names


# ---- the conversation as the chat template sees it -----------------------------------------------------------------
def encode_chat(target, messages: list[dict], request: ToolRequest | None, options=None) -> list[int]:
    """The prompt's token ids for OpenAI-style `messages`: a hermes template gets the tools and the calls itself;
    `options` (models.target.TemplateOptions): the template's own arguments."""
    turns = conversation(messages, request)
    tools = None
    if request is not None and request.style in TEMPLATE_STYLES:
        tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                   "parameters": t.parameters}} for t in request.tools]
    return target.encode_messages(turns, tools=tools, options=options)


def conversation(messages: list[dict], request: ToolRequest | None) -> list[dict]:
    """`messages` (OpenAI's: an assistant turn may hold `tool_calls`, a `tool` turn a call's result) as the chat
    template takes them. For a hermes template the turns as they are, each call's arguments decoded. Else plain
    role/content turns: earlier calls in the reply format, results as one user turn, and the tools' description
    in the system message (a system message of its own where the conversation has none)."""
    names: dict[str, str] = {}  # call id -> function name, to say whose result a tool turn holds
    if request is not None and request.style in TEMPLATE_STYLES:
        return [_template_turn(message, f"messages[{i}]", names) for i, message in enumerate(messages)]
    turns: list[dict] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if role == "tool":
            name = names.get(message.get("tool_call_id"), "a function")
            result = f"{name} returned: {content}"
            if turns and turns[-1].get("tool_results"):
                turns[-1]["content"] += "\n" + result
            else:
                turns.append({"role": "user", "content": result, "tool_results": True})
            continue
        calls = message.get("tool_calls") or []
        if calls:
            written = [_written_call(call, f"messages[{i}].tool_calls[{k}]", names) for k, call in enumerate(calls)]
            content = (content + "\n" if content else "") + json.dumps(written, ensure_ascii=False)
        turns.append({"role": role, "content": content, **_thought(message)})
    turns = [{k: v for k, v in t.items() if k != "tool_results"} for t in turns]
    if request is not None:
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{request.instructions()}"}
        else:
            turns.insert(0, {"role": "system", "content": request.instructions()})
    return turns


def _template_turn(message: dict, where: str, names: dict[str, str]) -> dict:
    """A turn for a template that renders calls and results itself (hermes): calls as {"type": "function",
    "function": {"name", "arguments": {...}}} (templates write the arguments with tojson), a result with its
    function's name beside its call id."""
    turn = {"role": message.get("role"), "content": message.get("content") or "", **_thought(message)}
    calls = message.get("tool_calls") or []
    if calls:
        turn["tool_calls"] = [{"type": "function", "function": _written_call(call, f"{where}.tool_calls[{k}]", names)}
                              for k, call in enumerate(calls)]
    if turn["role"] == "tool":
        turn["tool_call_id"] = message.get("tool_call_id")
        turn["name"] = names.get(message.get("tool_call_id"), "")
    return turn


def _thought(message: dict) -> dict:
    """An earlier assistant turn's thinking, for a template that shows it (Qwen3's reads `reasoning_content`)."""
    thought = message.get("reasoning_content") or message.get("reasoning")
    return {"reasoning_content": thought} if isinstance(thought, str) and thought else {}


def _written_call(call, where: str, names: dict[str, str]) -> dict:
    """An earlier call as the target writes one (a custom tool's input as its one argument); its id remembered for
    the result that answers it."""
    custom = call.get("custom") if isinstance(call, dict) and call.get("type") == "custom" else None
    if isinstance(custom, dict) and isinstance(custom.get("name"), str) and isinstance(custom.get("input"), str):
        names[call.get("id")] = custom["name"]
        return {"name": custom["name"], "arguments": {INPUT: custom["input"]}}
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise UserError(f"{where} must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                        "\"arguments\": \"{...}\"}}}} or {\"id\": ..., \"type\": \"custom\", \"custom\": "
                        "{\"name\": ..., \"input\": \"...\"}}")
    arguments = function.get("arguments") or "{}"
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        raise UserError(f"{where}.function.arguments is not JSON: {arguments!r}") from None
    names[call.get("id")] = function["name"]
    return {"name": function["name"], "arguments": arguments}
