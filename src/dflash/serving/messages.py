"""Anthropic's Messages API (POST /v1/messages, POST /v1/messages/count_tokens) over the same engine, templates,
grammars and parsers as chat, for clients written against Anthropic's SDK (and agents pointed at a local server
through ANTHROPIC_BASE_URL), as vLLM and SGLang serve it.

A request's `system` and `messages` (text, tool_use and tool_result blocks, earlier thinking) become a chat
conversation; its client tools (`input_schema`) and `tool_choice` (auto, any, tool, none) become chat's functions.
The reply comes back as content blocks (its thinking, its text, its tool_use calls with their input as an object),
whole or as the API's stream events (message_start, content_block_start / _delta / _stop, message_delta,
message_stop), with `stop_reason` end_turn, max_tokens, stop_sequence or tool_use. `output_config.format` holds the
reply to a JSON schema, as `response_format` does chat's. Sampling takes chat's fields (temperature 1 where none is
sent, as Anthropic's API had it; its current SDK sends them as extra_body).

No `from __future__ import annotations`: FastAPI reads the annotations of the handlers built here.
"""

import asyncio
import json
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from ..errors import UserError
from ..tools import encode_chat, tool_request
from .responses import text_of
from .schemas import Exchange, event_sse, schemas
from .streaming import PartsStream, TextDeltas, failure_kind, write_whole
from .worker import END_OF_STREAM, Job, cancel

if TYPE_CHECKING:
    from .app import Service

TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # Anthropic's tool_choice types -> chat's
BLOCK_JOIN = "\n\n"  # between a message's text blocks (a client's reminders, then the user's words)


# ---- the request ------------------------------------------------------------------------------------------------
def chat_form(body) -> None:
    """Fill in the chat fields that generation_config reads from the Messages API's own (in place)."""
    body.stop = list(body.stop_sequences or [])
    if body.n != 1:
        raise UserError("the Messages API makes one reply; n is not supported")
    kind = (body.output_config or {}).get("format")
    if kind is not None:
        if not isinstance(kind, dict) or kind.get("type") != "json_schema" or not isinstance(kind.get("schema"), dict):
            raise UserError('output_config.format must be {"type": "json_schema", "schema": {...}}')
        types = schemas()
        body.response_format = types.ResponseFormat(type="json_schema", json_schema=types.JsonSchemaFormat(
            name="output", schema=kind["schema"], strict=True))  # Anthropic's structured outputs are guaranteed


def conversation(body) -> list[dict]:
    """The request's `system` and `messages` as chat messages."""
    system = blocks_text(body.system, "system") if body.system is not None else ""
    messages = [{"role": "system", "content": system}] if system else []
    for k, message in enumerate(body.messages):
        messages += chat_turns(message, f"messages[{k}]")
    return messages


def chat_turns(message, where: str) -> list[dict]:
    """One message as chat turns: an assistant's text, thinking and tool_use calls one turn; a user's tool_result
    blocks a tool turn each, then its words."""
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        role = message.get("role") if isinstance(message, dict) else type(message).__name__
        raise UserError(f"{where}.role must be user or assistant, got {role!r}")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise UserError(f"{where}.content must be text or a list of content blocks")
    texts, calls, results, thinking = [], [], [], None
    for j, block in enumerate(content):
        kind, at = block.get("type") if isinstance(block, dict) else None, f"{where}.content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise UserError(f"{at}: a tool_use block needs its name and its input as an object")
            calls.append({"id": block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}", "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        elif kind == "tool_result" and role == "user":
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                            "content": blocks_text(block.get("content", ""), f"{at}.content")})
        elif kind == "thinking" and role == "assistant":
            thinking = block.get("thinking", "")
        elif kind != "redacted_thinking":  # thinking only its own model reads: nothing to show this one
            raise UserError(f"{at}: {kind!r} blocks are not supported in a {role} message here (text, tool_use "
                            f"and thinking in an assistant's, text and tool_result in a user's)")
    if role == "user":
        return results + ([{"role": "user", "content": BLOCK_JOIN.join(texts)}] if texts or not results else [])
    turn = {"role": "assistant", "content": BLOCK_JOIN.join(texts) if texts or not calls else None}
    if calls:
        turn["tool_calls"] = calls
    if thinking is not None:
        turn["reasoning_content"] = thinking
    return [turn]


def blocks_text(content, where: str) -> str:
    """Text, or text blocks joined (images and documents are refused)."""
    return text_of(content, where, ("text",), BLOCK_JOIN, "blocks")


def chat_tools(tools: list | None, tool_choice: dict | None) -> tuple[list | None, object, bool]:
    """Anthropic's client tools ({"name", "description", "input_schema"}) and tool_choice as chat's functions,
    tool_choice and parallel_tool_calls; server tools (web search, code execution, ...) are refused."""
    functions = []
    for k, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or "name" not in tool:
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise UserError(f"tools[{k}]: only client tools ({{\"name\", \"description\", \"input_schema\"}}) are "
                            f"supported here, got {kind!r}")
        function = {"name": tool["name"]}
        for key, chat_key in (("description", "description"), ("input_schema", "parameters")):
            if tool.get(key) is not None:
                function[chat_key] = tool[key]
        functions.append({"type": "function", "function": function})
    if tool_choice is None:
        return functions or None, None, True
    kind = tool_choice.get("type") if isinstance(tool_choice, dict) else None
    if kind == "tool" and isinstance(tool_choice.get("name"), str):
        choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    elif kind in TOOL_CHOICES:
        choice = TOOL_CHOICES[kind]
    else:
        raise UserError('tool_choice must be {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                        '{"type": "tool", "name": ...}')
    return functions or None, choice, not tool_choice.get("disable_parallel_tool_use", False)


def template_options(body, turns: list[dict]):
    """The template's options, with `thinking` (enabled / disabled) as Qwen3's enable_thinking where the request
    does not set that itself; a conversation that ends with the assistant's words (a prefill, e.g. "{") goes on
    with them, as Anthropic's API does, rather than opening a new turn."""
    options = body.template_options()
    kind = (body.thinking or {}).get("type")
    if kind in ("enabled", "disabled") and "enable_thinking" not in options.kwargs:
        options = replace(options, kwargs={**options.kwargs, "enable_thinking": kind == "enabled"})
    last = turns[-1] if turns else {}
    if last.get("role") == "assistant" and last.get("content") and not last.get("tool_calls"):
        options = replace(options, add_generation_prompt=False, continue_final_message=True)
    return options


# ---- the reply --------------------------------------------------------------------------------------------------
class ContentBlocks:
    """A reply's content blocks as it writes them: its thinking, its text, its tool_use calls. Each method returns
    the stream events it makes (a new kind of block closes the one before it); `blocks` is the content so far."""

    def __init__(self):
        self.blocks: list[dict] = []
        self.open: dict | None = None
        self.written = ""  # the open tool_use's input, as JSON text so far

    def reasoning(self, text: str) -> list[dict]:
        return self._text("thinking", text)

    def text(self, text: str) -> list[dict]:
        return self._text("text", text)

    def call(self, call_id: str, name: str, kind: str = "function") -> list[dict]:
        tool_id = f"toolu_{call_id.removeprefix('call_')}"  # chat's id, spelled as Anthropic's are
        return self.close() + self._add({"type": "tool_use", "id": tool_id, "name": name, "input": {}})

    def arguments(self, fragment: str) -> list[dict]:
        self.written += fragment
        return [self._delta({"type": "input_json_delta", "partial_json": fragment})]

    def close(self) -> list[dict]:
        block, self.open = self.open, None
        if block is None:
            return []
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.written or "{}")
            except json.JSONDecodeError:  # cut short by max_tokens: its pieces went out, its input is not whole
                block["input"] = {}
            self.written = ""
        return [{"type": "content_block_stop", "index": self.blocks.index(block)}]

    def _text(self, kind: str, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self.close() + self._add({"type": kind, kind: "", **({"signature": ""} if kind == "thinking"
                                                                          else {})})
        self.open[kind] += text
        return events + [self._delta({"type": f"{kind}_delta", kind: text})]

    def _add(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self.open = block
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.blocks.index(self.open), "delta": delta}


def stop_reason(result, blocks: list[dict]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): max_tokens where the reply was cut, tool_use where it called tools, the stop
    sequence that ended it (the engine's stop_reason, where it is a string), else end_turn."""
    if result.finish_reason == "length":
        return "max_tokens", None
    if any(block["type"] == "tool_use" for block in blocks):
        return "tool_use", None
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def usage(exchange: Exchange, result) -> dict:
    """Anthropic's usage: the prompt's tokens read from the prefix cache apart from the others."""
    cached = result.stats.cached_prompt_tokens
    return {"input_tokens": exchange.prompt_tokens - cached, "output_tokens": result.stats.new_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


# ---- the service ------------------------------------------------------------------------------------------------
class Messages:
    """POST /v1/messages and /v1/messages/count_tokens for `service`, with the tool format `call_style`."""

    def __init__(self, service: "Service", call_style: str):
        self.service, self.call_style = service, call_style

    def prompt(self, body) -> tuple[list[int], object]:
        """The request's prompt ids (its conversation through the template) and its tool request."""
        self.service.check_model(body.model)
        functions, choice, parallel = chat_tools(body.tools, body.tool_choice)
        tools = tool_request(functions, choice, parallel, self.call_style)
        turns = conversation(body)
        return encode_chat(self.service.target, turns, tools, template_options(body, turns)), tools

    def count_tokens(self, body) -> dict:
        return {"input_tokens": len(self.prompt(body)[0])}

    async def create(self, request, body):
        service = self.service
        chat_form(body)
        prompt_ids, tools = self.prompt(body)
        (config,), exchange = service.prepared(body, prompt_ids, True, tools)
        exchange.id = f"msg_{uuid.uuid4().hex[:24]}"
        if body.stream:
            return self.stream(request, prompt_ids, config, exchange)
        job = Job(prompt_ids, config)
        results = await service.results(request, [job])
        if not isinstance(results, list):
            return results
        blocks = write_whole(exchange, results[0].text, ContentBlocks()).blocks
        reason, sequence = stop_reason(results[0], blocks)
        return {**self.envelope(exchange, blocks), "stop_reason": reason, "stop_sequence": sequence,
                "usage": usage(exchange, results[0]), "dflash": exchange.extension(job.queue_s, results)}

    @staticmethod
    def envelope(exchange: Exchange, blocks: list[dict]) -> dict:
        return {"id": exchange.id, "type": "message", "role": "assistant", "model": exchange.model,
                "content": blocks}

    def stream(self, request, prompt_ids, config, exchange: Exchange):
        from fastapi.responses import StreamingResponse

        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        target = self.service.target
        deltas = TextDeltas.of(target, config)
        job = Job(prompt_ids, config, deltas, emit=lambda item: loop.call_soon_threadsafe(pieces.put_nowait, item))
        self.service.worker.submit([job])  # queued now, so a busy server answers 503 before the stream starts
        events = self.stream_events(request, job, pieces, config, exchange)
        return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def stream_events(self, request, job: Job, pieces, config, exchange: Exchange):
        from .app import next_piece

        try:
            opening = {**self.envelope(exchange, []), "stop_reason": None, "stop_sequence": None,
                       "usage": {"input_tokens": exchange.prompt_tokens, "output_tokens": 0}}
            yield event_sse({"type": "message_start", "message": opening})
            reply = PartsStream(exchange, ContentBlocks())
            while True:
                piece = await next_piece(pieces, request)
                if piece is None:
                    return  # the client went away; `finally` cancels the job
                if piece is END_OF_STREAM:
                    break
                for events in reply.piece(piece.text, None):
                    yield "".join(map(event_sse, events))
            try:
                result = await job.future
            except Exception as exc:  # the status line is long gone: the API's error event
                kind = failure_kind(exc, "streamed message", "api_error")
                yield event_sse({"type": "error", "error": {"type": kind, "message": str(exc)}})
                return
            for events in [*reply.finish(result), reply.parts.close()]:
                yield "".join(map(event_sse, events))
            reason, sequence = stop_reason(result, reply.parts.blocks)
            spent = usage(exchange, result)
            yield event_sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                             "usage": {"output_tokens": spent["output_tokens"]}})
            yield event_sse({"type": "message_stop"})
        finally:
            cancel([job], self.service.metrics)

