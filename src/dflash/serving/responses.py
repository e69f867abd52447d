"""OpenAI's Responses API (POST /v1/responses) over the same engine, templates, grammars and parsers as chat.

A request's `input` (text, or items: messages, earlier function and custom tool calls and their outputs, earlier
reasoning) becomes a chat conversation after its `instructions`; the reply comes back as output items (its
reasoning, its message's text, its function and custom tool calls), whole or as the API's semantic stream events,
with the message's log-probabilities where asked for. Responses are kept in memory (response_store.py) for
`previous_response_id`, GET, DELETE and input_items. A background response runs without its client: it is polled
with GET, read as a stream from any event on, and cancelled.

No `from __future__ import annotations`: FastAPI reads the annotations of the handlers built here.
"""

import asyncio
import copy
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

from ..errors import UserError
from ..jsonl import openai_role
from ..tools import CALL_TEXT, encode_chat, tool_request
from .response_store import BackgroundRun, ResponseStore, Stored, listed
from .schemas import Exchange, event_sse, schemas
from .streaming import PartsStream, TextDeltas, failure_kind, write_whole
from .worker import END_OF_STREAM, Job, cancel

if TYPE_CHECKING:
    from .app import Service

log = logging.getLogger("dflash.server")
TOOL_KINDS = ("function", "custom")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
TEXT_LOGPROBS = "message.output_text.logprobs"
# What `include` may name: the message's log-probabilities, and reasoning's encrypted content, which clients such as
# Codex ask for and which needs nothing here (reasoning items come back as plain text).
INCLUDABLE = (TEXT_LOGPROBS, "reasoning.encrypted_content")


# ---- the request ------------------------------------------------------------------------------------------------
def chat_form(body) -> None:
    """Fill in the chat fields that generation_config reads from the Responses API's own (in place)."""
    if body.n != 1:
        raise UserError("the Responses API makes one output; n is not supported")
    if body.truncation not in ("auto", "disabled"):
        raise UserError(f"truncation must be \"auto\" or \"disabled\", got {body.truncation!r}")
    unknown = [name for name in body.include or [] if name not in INCLUDABLE]
    if unknown:
        raise UserError(f"include may name {' and '.join(map(repr, INCLUDABLE))} here, got {unknown[0]!r}")
    # The log-probabilities of the message's tokens: asked for by include, top_logprobs (0-20) alternatives each.
    body.logprobs = TEXT_LOGPROBS in (body.include or []) or body.top_logprobs is not None
    body.max_tokens = body.max_output_tokens
    kind = text_format(body)
    if not isinstance(kind, dict) or kind.get("type") not in ("text", "json_object", "json_schema"):
        raise UserError("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                        "\"json_schema\", \"name\": ..., \"schema\": {...}}")
    if kind["type"] == "json_schema" and not isinstance(kind.get("schema"), dict):
        raise UserError("text.format json_schema needs its schema: {\"type\": \"json_schema\", \"name\": ..., "
                        "\"schema\": {...}}")
    types = schemas()
    body.response_format = None if kind["type"] == "text" else types.ResponseFormat(
        type=kind["type"], json_schema=types.JsonSchemaFormat(name=kind.get("name", "response"),
                                                              schema=kind["schema"], strict=kind.get("strict"))
        if kind["type"] == "json_schema" else None)


def text_format(body):
    """The request's `text.format` ({"type": "text"} where it sets none)."""
    return (body.text or {}).get("format", {"type": "text"})


def chat_tools(tools: list | None, tool_choice) -> tuple[list | None, object]:
    """The Responses API's function and custom tools ({"type": "function", "name", "parameters", ...}, {"type":
    "custom", "name", "format", ...}) and tool_choice (a tool named, or allowed_tools) in chat's layout, where each
    tool's fields sit under its type; other kinds of tools (the hosted ones) are refused."""
    functions = []
    for tool in tools or []:
        if not isinstance(tool, dict) or tool.get("type") not in TOOL_KINDS:
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise UserError(f"only function and custom tools are supported here, got {kind!r}")
        functions.append(nested(tool))
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") == "allowed_tools":
            mode, listed = tool_choice.get("mode"), tool_choice.get("tools")
            if not isinstance(listed, list) or not all(isinstance(t, dict) for t in listed):
                raise UserError('tool_choice allowed_tools must be {"type": "allowed_tools", "mode": "auto" or '
                                '"required", "tools": [{"type": "function", "name": ...}, ...]}')
            return functions or None, {"type": "allowed_tools",
                                       "allowed_tools": {"mode": mode, "tools": [nested(t) for t in listed]}}
        if tool_choice.get("type") not in TOOL_KINDS or "name" not in tool_choice:
            raise UserError('tool_choice must be "auto", "none", "required", {"type": "function", "name": ...}, '
                            '{"type": "custom", "name": ...} or {"type": "allowed_tools", ...}')
        tool_choice = nested(tool_choice)
    return functions or None, tool_choice


def nested(tool: dict) -> dict:
    """A tool (or a tool named) as chat lays it out: its fields under its type."""
    return {"type": tool.get("type"), tool.get("type"): {k: v for k, v in tool.items() if k != "type"}}


def input_messages(given) -> list[dict]:
    """The request's `input` as chat messages: text is one user message; items are messages, earlier function
    calls (joined to the assistant turn before them), their outputs (tool turns) and earlier reasoning (the next
    assistant turn's `reasoning_content`)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages, reasoning = [], None
    for k, item in enumerate(given):
        if not isinstance(item, dict):
            raise UserError(f"input[{k}] must be an object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise UserError(f"input[{k}].role must be system, developer, user or assistant, got {role!r}")
            message = {"role": openai_role(role), "content": text_of(item.get("content"), f"input[{k}].content")}
            if role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind in ("function_call", "custom_tool_call"):
            tool = "function" if kind == "function_call" else "custom"
            text = CALL_TEXT[tool]
            call = {"id": item.get("call_id") or item.get("id"), "type": tool,
                    tool: {"name": item.get("name"), text: item.get(text, "{}" if tool == "function" else "")}}
            if not isinstance(call[tool]["name"], str) or not isinstance(call[tool][text], str):
                raise UserError(f"input[{k}]: a {kind} needs its name and its {text} as a string")
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": text_of(item.get("output"), f"input[{k}].output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = text_of(parts, f"input[{k}].content")
        else:
            raise UserError(f"input[{k}]: items of type {kind!r} are not supported here (messages, function_call, "
                            f"function_call_output, custom_tool_call, custom_tool_call_output and reasoning are)")
    return messages


def text_of(content, where: str, kinds: tuple[str, ...] = TEXT_PARTS, separator: str = "", name: str = "parts") -> str:
    """A message's text: a string, or its text parts (of `kinds`) joined by `separator` (images and files are
    refused). `name`: what the API calls its parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise UserError(f"{where} must be text or a list of text {name}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in kinds or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise UserError(f"{where}: only text {name} are supported here, got {kind!r}")
        texts.append(part["text"])
    return separator.join(texts)


# ---- the output -------------------------------------------------------------------------------------------------
class OutputItems:
    """A response's output items as the reply writes them: its reasoning, its message's text, its function calls.
    Each method returns the stream events it makes (a new kind of output closes the item before it); `items` is
    the output so far, as a whole response shows it."""

    def __init__(self):
        self.items: list[dict] = []
        self.open: dict | None = None

    def reasoning(self, text: str) -> list[dict]:
        return self._text("reasoning", text)

    def text(self, text: str, logprobs: list[dict] = ()) -> list[dict]:
        """The message's next words, with their tokens' log-probabilities (chat's layout) where asked for."""
        return self._text("message", text, list(logprobs))

    def call(self, call_id: str, name: str, kind: str = "function") -> list[dict]:
        """A call begins: a function's (its arguments to come) or a custom tool's (its input)."""
        if kind == "custom":
            item = {"type": "custom_tool_call", "id": f"ctc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
                    "input": ""}
        else:
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call_id, "name": name,
                    "arguments": "", "status": "in_progress"}
        return self.close() + self._add(item)

    def arguments(self, fragment: str) -> list[dict]:
        """More of the open call's arguments (a custom tool's input)."""
        item = self.open
        if item["type"] == "custom_tool_call":
            item["input"] += fragment
            return [{"type": "response.custom_tool_call_input.delta", **self._at(item), "delta": fragment}]
        item["arguments"] += fragment
        return [{"type": "response.function_call_arguments.delta", **self._at(item), "delta": fragment}]

    def close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        if item["type"] != "custom_tool_call":  # which has no status
            item["status"] = "completed"
        if item["type"] == "custom_tool_call":
            events = [{"type": "response.custom_tool_call_input.done", **self._at(item), "input": item["input"]}]
        elif item["type"] == "function_call":
            events = [{"type": "response.function_call_arguments.done", **self._at(item),
                       "name": item["name"], "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            kind = "response.output_text" if item["type"] == "message" else "response.reasoning_text"
            events = [{"type": f"{kind}.done", **self._at(item), "content_index": 0, "text": part["text"]},
                      {"type": "response.content_part.done", **self._at(item), "content_index": 0,
                       "part": copy.deepcopy(part)}]
        if item["type"] == "reasoning":
            del item["status"]  # a reasoning item has none once whole
        return events + [{"type": "response.output_item.done", "output_index": self.items.index(item),
                          "item": copy.deepcopy(item)}]

    def _text(self, kind: str, text: str, logprobs: list[dict] | None = None) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != kind:
            part = ({"type": "output_text", "text": "", "annotations": [], "logprobs": []} if kind == "message"
                    else {"type": "reasoning_text", "text": ""})
            item = ({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                     "role": "assistant", "content": []} if kind == "message"
                    else {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [],
                          "status": "in_progress"})
            events += self.close() + self._add(item)
            item["content"].append(part)
            events.append({"type": "response.content_part.added", **self._at(item), "content_index": 0,
                           "part": copy.deepcopy(part)})
        self.open["content"][0]["text"] += text
        kind = "response.output_text" if kind == "message" else "response.reasoning_text"
        delta = {}
        if kind == "response.output_text":
            self.open["content"][0]["logprobs"] += logprobs
            delta["logprobs"] = logprobs
        return events + [{"type": f"{kind}.delta", **self._at(self.open), "content_index": 0, "delta": text,
                          **delta}]

    def _add(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1,
                 "item": copy.deepcopy(item)}]

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}


def replayed_output(exchange: Exchange, result, deltas: TextDeltas) -> OutputItems:
    """The output items of a whole reply with its message's log-probabilities: the reply streamed again token by
    token, as a stream that asks for them is (Job.token_by_token), so each token's log-probability goes with the
    item its text went to, whole or streamed alike."""
    reply = ResponseStream(exchange)

    def shown(entries: list) -> list:
        return [entry for entry in entries if entry.token not in deltas.stop_ids]

    held = []  # the log-probabilities of tokens whose text is held back, as Job._new_logprobs keeps them
    for entry in result.logprobs:
        held.append(entry)
        if piece := deltas.push([entry.token]):
            for _ in reply.piece(piece, shown(held)):
                pass
            held = []
    tail = deltas.finish(result.text)
    if tail or shown(held):
        for _ in reply.piece(tail, shown(held)):
            pass
    for _ in reply.finish(result):
        pass
    reply.parts.close()
    return reply.parts


class ResponseStream(PartsStream):
    """A streamed reply's output items (OutputItems). Log-probabilities go with the message's words; those of
    thinking and of calls are not shown (the API has no place for them)."""

    def __init__(self, exchange: Exchange):
        super().__init__(exchange, OutputItems())

    def piece(self, text: str, logprobs: list | None) -> Iterator[list[dict]]:
        yield from super().piece(text, logprobs)
        if self.thinking is not None and self.thinking.phase in ("starting", "thinking", "after"):
            self.logprobs = None  # tokens of the thinking or of the whitespace around it, which no item shows

    def _words(self, text: str | None, logprobs: list | None) -> list[dict]:
        writing = self.parts.open is not None and self.parts.open["type"] == "message"
        if not text and not (logprobs and writing):  # a token's log-probability without text: its message's
            return []
        return self.parts.text(text, self.exchange.logprobs(logprobs, 0)["content"] if logprobs else ())


# ---- the service ------------------------------------------------------------------------------------------------
def reply_messages(items: list[dict]) -> list[dict]:
    """A response's output as the chat messages a later turn's conversation holds (a message without text left
    out)."""
    return input_messages([item for item in items if item["type"] != "message" or item["content"][0]["text"]])


def truncated(turns: list[dict], prompt_of, fits) -> list[int]:
    """truncation "auto": the prompt of the conversation with its oldest exchanges dropped (each from a user message
    up to the next, so that calls keep their results) until `fits` holds; the last exchange alone where none does
    (the engine then says it does not fit). The instructions and the input's leading system messages stay."""
    head = next((k for k, turn in enumerate(turns) if turn["role"] != "system"), len(turns))  # input's own system
    rest = turns[head:]
    for start in [0] + [k for k, turn in enumerate(rest) if turn["role"] == "user" and k > 0]:
        prompt_ids = prompt_of(turns[:head] + rest[start:])
        if fits(prompt_ids):
            return prompt_ids
    return prompt_ids


def input_items(given) -> list[dict]:
    """A request's `input` as the API lists it back (input_items): items, each with an id, messages with their text
    as parts."""
    items = []
    for item in [{"role": "user", "content": given}] if isinstance(given, str) else given:
        item = {"type": "message", **item}
        if item["type"] == "message":
            if isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
            item.setdefault("status", "completed")
        prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs",
                  "custom_tool_call": "ctc", "custom_tool_call_output": "ctco"}
        item.setdefault("id", f"{prefix.get(item['type'], 'item')}_{uuid.uuid4().hex}")
        items.append(item)
    return items


class Responses:
    """POST /v1/responses for `service`, with the tool format `call_style`; GET, DELETE, cancel and input_items of
    the responses it keeps."""

    def __init__(self, service: "Service", call_style: str):
        self.service, self.call_style, self.store = service, call_style, ResponseStore()

    async def create(self, request, body):
        service, target = self.service, self.service.target
        service.check_model(body.model)
        chat_form(body)
        if body.background and not body.store:
            raise UserError("a background response must be stored (store: true): it is read back later")
        functions, choice = chat_tools(body.tools, body.tool_choice)
        tools = tool_request(functions, choice, body.parallel_tool_calls, self.call_style)
        earlier = self.conversation_of(body.previous_response_id) if body.previous_response_id else []
        turns = earlier + input_messages(body.input)
        if not turns:
            raise UserError("input is empty")
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []

        def prompt_of(kept: list[dict]) -> list[int]:
            return encode_chat(target, system + kept, tools, body.template_options())

        if body.truncation == "auto":
            prompt_ids = truncated(turns, prompt_of, self.leaves_room(body))
        else:
            prompt_ids = prompt_of(turns)
        (config,), exchange = service.prepared(body, prompt_ids, True, tools)
        asked = Asked(body, exchange, self.shell(body, exchange), turns, input_items(body.input))
        if body.background or body.stream:
            return self.streamed(request, asked, prompt_ids, config)
        job = Job(prompt_ids, config)
        results = await service.results(request, [job])
        if not isinstance(results, list):
            return results
        if config.logprobs is None:
            output = write_whole(exchange, results[0].text, OutputItems())
        else:
            output = replayed_output(exchange, results[0], self.text_deltas(config))
        return self.finished(asked, output.items, job, results[0])

    def leaves_room(self, body):
        """Whether a prompt leaves the engine room for the reply's max_output_tokens (the server's default where it
        sets none)."""
        wanted = body.max_output_tokens or self.service.default_max_tokens

        def fits(prompt_ids: list[int]) -> bool:
            try:
                return self.service.worker.engine.budget(prompt_ids) >= wanted
            except UserError:
                return False

        return fits

    def conversation_of(self, response_id: str) -> list[dict]:
        stored = self.store.get(response_id)
        if stored.conversation is None:
            raise UserError(f"response {response_id!r} is {stored.response['status']}: a conversation goes on "
                            "from a response once it has completed")
        return stored.conversation

    def shell(self, body, exchange: Exchange) -> dict:
        """The response object before its output: what the request asked for, status queued (background) or
        in_progress."""
        return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
                "status": "queued" if body.background else "in_progress", "background": body.background,
                "error": None, "incomplete_details": None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": exchange.model, "output": [], "parallel_tool_calls": body.parallel_tool_calls,
                "previous_response_id": body.previous_response_id,
                "reasoning": body.reasoning or {"effort": None, "summary": None},
                "store": body.store, "temperature": body.temperature, "text": {"format": text_format(body)},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
                "top_logprobs": body.top_logprobs,
                "truncation": body.truncation, "usage": None, "user": body.user, "metadata": body.metadata or {}}

    def finished(self, asked: "Asked", items: list[dict], job: Job, result, run: BackgroundRun | None = None) -> dict:
        """The whole response object (kept for later turns where `store`)."""
        usage = asked.exchange.usage([result])
        thought = "".join(item["content"][0]["text"] for item in items if item["type"] == "reasoning")
        reasoning_tokens = len(self.service.target.tokenizer.encode(thought, add_special_tokens=False))
        cut = result.finish_reason == "length"
        response = {**asked.response, "status": "incomplete" if cut else "completed", "output": items,
                    "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                    "usage": {"input_tokens": usage["prompt_tokens"],
                              "input_tokens_details": usage["prompt_tokens_details"],
                              "output_tokens": usage["completion_tokens"],
                              "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                              "total_tokens": usage["total_tokens"]},
                    "dflash": asked.exchange.extension(job.queue_s, [result])}
        if asked.body.store:
            self.store.put(Stored(response, asked.turns + reply_messages(items), asked.input_items, run))
        return response

    def text_deltas(self, config) -> TextDeltas:
        target = self.service.target
        return TextDeltas.of(target, config)

    # ---- streamed and background responses
    def streamed(self, request, asked: "Asked", prompt_ids, config):
        """A streamed response, or a background one (streamed or not): its job queued now, so that a busy server
        answers 503 before anything starts."""
        from fastapi.responses import StreamingResponse

        from .app import next_piece

        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        job = Job(prompt_ids, config, self.text_deltas(config), token_by_token=config.logprobs is not None,
                  emit=lambda item: loop.call_soon_threadsafe(pieces.put_nowait, item))
        self.service.worker.submit([job])
        headers = {"Cache-Control": "no-cache"}
        if not asked.body.background:
            numbered = EventNumbers()
            events = (numbered.sse(event) async for event in self.events(
                asked, job, lambda: next_piece(pieces, request)))
            return StreamingResponse(self.cancelled_after(events, job), media_type="text/event-stream",
                                     headers=headers)
        run = BackgroundRun(job)
        self.store.put(Stored(asked.response, None, asked.input_items, run))
        run.task = asyncio.create_task(self.run(run, asked, self.events(asked, job, pieces.get, run)))
        if asked.body.stream:
            return StreamingResponse(run.follow(-1), media_type="text/event-stream", headers=headers)
        return copy.deepcopy(asked.response)

    async def cancelled_after(self, events, job: Job):
        """A stream's events; its job cancelled once the stream ends (the client went away, or it is done)."""
        try:
            async for event in events:
                yield event
        finally:
            cancel([job], self.service.metrics)

    async def run(self, run: BackgroundRun, asked: "Asked", events) -> None:
        """A background response's events into its run, whoever reads them (the job goes on without a client)."""
        try:
            async for event in events:
                if run.cancelled:
                    break
                run.add(event)
        except Exception as exc:  # noqa: BLE001 - the response says it failed; the server goes on
            log.exception("background response failed")
            failed = {**asked.response, "status": "failed", "error": {"code": "server_error", "message": str(exc)}}
            self.store.put(Stored(failed, None, asked.input_items, run))
            cancel([run.job], self.service.metrics)
        finally:
            await events.aclose()
            run.end()

    async def events(self, asked: "Asked", job: Job, next_piece, run: BackgroundRun | None = None):
        """A streamed reply's events, unnumbered: created, in_progress, each piece's output events, the end. A
        background run's response is kept at each step (in_progress, then whole, failed or cancelled)."""
        response = asked.response
        yield {"type": "response.created", "response": copy.deepcopy(response)}
        reply, begun = ResponseStream(asked.exchange), False
        while True:
            piece = await next_piece()
            if piece is None:
                return  # the client went away
            if not begun:
                begun = True
                response["status"] = "in_progress"
                yield {"type": "response.in_progress", "response": copy.deepcopy(response)}
            if piece is END_OF_STREAM:
                break
            for events in reply.piece(piece.text, piece.logprobs):
                for event in events:
                    yield event
        try:
            result = await job.future
        except Exception as exc:  # the status line is long gone: the API's error event
            kind = failure_kind(exc, "streamed response")
            if run is not None:
                failed = {**response, "status": "failed", "error": {"code": kind, "message": str(exc)}}
                self.store.put(Stored(failed, None, asked.input_items, run))
            yield {"type": "error", "code": kind, "message": str(exc), "param": None}
            return
        if run is not None and run.cancelled:
            return
        for events in [*reply.finish(result), reply.parts.close()]:
            for event in events:
                yield event
        final = self.finished(asked, reply.parts.items, job, result, run)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield {"type": kind, "response": final}

    def retrieve(self, response_id: str, stream: bool = False, starting_after: int = -1):
        """GET /v1/responses/{id}: the response as it stands; with stream, a background one's events after
        `starting_after`, then each as it comes."""
        stored = self.store.get(response_id)
        if not stream:
            return stored.response
        if stored.run is None:
            raise UserError(f"response {response_id!r} was not created with background: true; only background "
                            "responses can be streamed again")
        from fastapi.responses import StreamingResponse

        return StreamingResponse(stored.run.follow(starting_after), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def cancel(self, response_id: str) -> dict:
        """POST /v1/responses/{id}/cancel: a background response stopped where it is (its output so far, status
        cancelled); one that has ended is returned as it is."""
        stored = self.store.get(response_id)
        run = stored.run
        if run is None:
            raise UserError(f"response {response_id!r} was not created with background: true; only background "
                            "responses can be cancelled")
        if not run.done and not run.cancelled:
            run.cancelled = True
            cancel([run.job], self.service.metrics)
            response = {**stored.response, "status": "cancelled"}
            self.store.put(Stored(response, None, stored.input_items, run))
            run.end()
            return response
        return stored.response

    def input_items(self, response_id: str, order: str = "desc", limit: int = 20, after: str | None = None) -> dict:
        """GET /v1/responses/{id}/input_items: the request's input items, a page at a time."""
        return listed(self.store.get(response_id).input_items, order, limit, after)


@dataclass
class Asked:
    """What a request asked for, as its response is made: the request, its exchange, the response object before
    its output, its conversation and its input items."""

    body: object
    exchange: Exchange
    response: dict
    turns: list[dict]
    input_items: list[dict]


class EventNumbers:
    """A stream's events as server-sent events, each numbered in order."""

    def __init__(self):
        self.next = 0

    def sse(self, *events: dict) -> str:
        lines = []
        for event in events:
            lines.append(event_sse({**event, "sequence_number": self.next}))
            self.next += 1
        return "".join(lines)
