"""Streaming text: the pieces of a growing generation that are safe to send."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Iterator

from ..detokenize import GrowingText, byte_tokens
from ..engine import stop_floor, stop_string_at
from ..errors import UserError
from ..reasoning import ThinkingDeltas
from ..tools import CALL_TEXT, call_delta, call_parts

if TYPE_CHECKING:
    from ..tools import ToolRequest
    from .schemas import Exchange


class TextDeltas:
    """Turns a growing list of generated tokens into text pieces that are safe to send.

    Held back until more tokens decide: a completed stop string (sent where `include_stop`) and everything after
    it, a tail that could still grow into a stop string, and a trailing partial UTF-8 character. A trailing stop
    token (EOS) is not text."""

    def __init__(self, decode: Callable[[list[int]], str], stop_strings: tuple[str, ...], stop_ids: set[int],
                 min_tokens: int = 0, byte_ids: frozenset[int] = frozenset(), include_stop: bool = False):
        self.decode, self.stop_strings, self.stop_ids = decode, tuple(s for s in stop_strings if s), stop_ids
        self.min_tokens = min_tokens  # no stop string ends the text before (engine.stop_floor)
        self.include_stop = include_stop  # the text keeps the stop string that ends it
        self.ids: list[int] = []
        self.text = GrowingText(decode, byte_ids)  # decodes only the end of a long generation (byte_tokens)
        self.floor: int | None = None  # where a stop string may end, once min_tokens are written
        self.sent = ""

    @classmethod
    def of(cls, target, config) -> "TextDeltas":
        """The deltas of a generation with `config` (engine.GenerationConfig) by `target`."""
        return cls(config.decoder(target), config.stop_strings, config.stop_ids(target.eos_token_ids),
                   config.sampling.min_tokens, byte_tokens(target.tokenizer), config.include_stop_strings)

    def push(self, new_ids: list[int]) -> str:
        self.ids += new_ids
        ids = self.ids[:-1] if self.ids and self.ids[-1] in self.stop_ids else self.ids
        text = self.text(ids)
        if self.stop_strings and self.floor is None:
            self.floor = stop_floor(self.decode, self.ids, self.min_tokens)
        cut = -1 if self.floor is None else stop_string_at(text, self.stop_strings, self.floor, self.include_stop)
        text = text[:cut] if cut >= 0 else text[: len(text) - self._unsettled_tail(text)]
        return self._advance(text)

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (which is already cut at stop strings)."""
        return self._advance(final_text)

    def _unsettled_tail(self, text: str) -> int:
        tail = len(text) - len(text.rstrip("\ufffd"))  # a character whose bytes are not all generated yet
        for stop in self.stop_strings:
            for k in range(min(len(stop) - 1, len(text)), tail, -1):
                if text.endswith(stop[:k]):
                    tail = k
                    break
        return tail

    def _advance(self, text: str) -> str:
        # Decoding more tokens can rewrite earlier text (a tokenizer's space clean-up); what was sent cannot be
        # taken back, so wait until the text extends what was sent again.
        if not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):], text
        return piece


class HeldCalls:
    """The text of a streamed chat reply that may hold tool calls (tools.py), held back from the piece where they
    may begin (the reply's first, opening with `[` or `{`, in the json format; one that holds `<tool_call>` or ends
    with its first bytes in the hermes format; the first where calls are required) until they do or do not. Words
    stream as they come."""

    def __init__(self, request: "ToolRequest"):
        self.request = request
        self.text = ""  # held, not sent
        self.calls, self.sent = False, False  # whether the calls have begun; whether any text went out

    @property
    def holding(self) -> bool:
        return self.calls or bool(self.text)

    def take(self, text: str) -> str | None:
        """What of a piece goes out now as words (with what was held before it), or None while held."""
        self.text += text
        if self.calls:
            return None
        opening = self.request.opening(self.text, at_start=not self.sent)
        self.calls = opening == "calls"
        if opening != "text":
            return None
        self.sent = True
        return self.release()

    def release(self) -> str:
        held, self.text = self.text, ""
        return held


class ChatChoiceStream:
    """The chunks of one streamed chat choice: its thinking as `reasoning` deltas apart from its answer (with the
    reasoning parser), and its tool calls as OpenAI streams them, each call's id and name once its name is written,
    then its arguments' text as it grows (HeldCalls holds the text until calls begin). Each piece's
    log-probabilities go out once, with the first chunk after them."""

    def __init__(self, exchange: "Exchange", index: int):
        self.exchange, self.index = exchange, index
        self.thinking = ThinkingDeltas(exchange.thinking) if exchange.reasoning else None
        self.held = HeldCalls(exchange.tools) if exchange.tools is not None else None
        self.logprobs: list | None = None  # of text not sent yet
        self.streamed: list[int] = []  # per call begun: how much of its arguments went out

    def piece(self, text: str, logprobs: list | None) -> Iterator[str]:
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs
        thought, answer = self.thinking.push(text) if self.thinking is not None else ("", text)
        yield from self._send(thought, answer)

    def finish(self, result) -> Iterator[str]:
        """The held chunks once the choice is whole; its finish reason is `self.finish_reason` after."""
        yield from self._send(*(self.thinking.finish() if self.thinking is not None else ("", "")))
        self.finish_reason = result.finish_reason
        if self.held is not None and self.held.holding:
            if self.exchange.tools.calls(self.exchange.thought_and_answer(result.text)[1]) is not None:
                self.finish_reason = "tool_calls"
            elif not self.streamed:  # cut short before a call showed: what was held goes out as words
                yield self._chunk(self.held.release())
        if self.logprobs:  # of tokens whose text never showed (a character cut short, a call's last bytes)
            yield self._chunk("")

    def _send(self, thought: str, answer: str) -> Iterator[str]:
        if thought:
            yield self._chunk(None, delta=self.exchange.thought(thought))
        if not answer:
            return
        if self.held is None:
            yield self._chunk(answer)
        elif (words := self.held.take(answer)) is not None:
            yield self._chunk(words)
        elif self.held.calls:
            yield from self._call_deltas()

    def _call_deltas(self) -> Iterator[str]:
        """The calls' news in the held text: a call's id and name once its arguments begin (after the words before
        the first call, in the hermes format), then each new stretch of its arguments (of a custom tool's input:
        {"custom": {"input": ...}} in place of {"function": {"arguments": ...}})."""
        tools, text = self.exchange.tools, self.held.text
        for k, call in enumerate(tools.written(text)[0]):
            kind = tools.kind_of(call.name)
            if k == len(self.streamed):
                if k == 0 and (words := tools.content(text)) is not None:
                    yield self._chunk(words)
                yield self._chunk(None, delta={"tool_calls": [{"index": k, **call_delta(call.name, "", kind)}]})
                self.streamed.append(0)
            shown = tools.shown(call)
            if len(shown) > self.streamed[k]:
                fragment = shown[self.streamed[k]:]
                self.streamed[k] = len(shown)
                yield self._chunk(None, delta={"tool_calls": [{"index": k, kind: {CALL_TEXT[kind]: fragment}}]})

    def _chunk(self, text: str | None, delta: dict | None = None) -> str:
        taken, self.logprobs = self.logprobs, None
        return self.exchange.chunk(text, index=self.index, logprobs=taken, delta=delta)


class PartsStream(ChatChoiceStream):
    """A streamed reply written into `parts` (the Responses API's output items, the Messages API's content blocks:
    each has reasoning, text, call, arguments and close, which return the events they make): the chat stream's
    deltas (its thinking, its words, each call's id and name, then its arguments' pieces) as those events, a list
    of them where the chat stream's is a chunk."""

    def __init__(self, exchange: "Exchange", parts):
        super().__init__(exchange, 0)
        self.parts = parts

    def _chunk(self, text: str | None, delta: dict | None = None) -> list[dict]:
        taken, self.logprobs = self.logprobs, None
        if delta is None:
            return self._words(text, taken)
        if "reasoning" in delta:
            return self.parts.reasoning(delta["reasoning"])
        (call,) = delta["tool_calls"]
        kind, name, text = call_parts(call)
        if "id" in call:
            return self.parts.call(call["id"], name, kind)
        return self.parts.arguments(text)

    def _words(self, text: str | None, logprobs: list | None) -> list[dict]:
        """The events of the reply's words (log-probabilities are not shown unless a subclass shows them)."""
        return self.parts.text(text) if text else []


def write_whole(exchange: "Exchange", text: str, parts):
    """A whole reply written into `parts` (PartsStream's): its thinking, its words, its calls; `parts` returned."""
    thought, answer = exchange.thought_and_answer(text)
    calls = exchange.tools.calls(answer) if exchange.tools is not None else None
    if thought:
        parts.reasoning(thought)
    words = answer if calls is None else exchange.tools.content(answer)
    if words:
        parts.text(words)
    for call in calls or []:
        kind, name, text = call_parts(call)
        parts.call(call["id"], name, kind)
        parts.arguments(text)
    parts.close()
    return parts


def failure_kind(exc: BaseException, what: str, server_kind: str = "server_error") -> str:
    """The error type a stream reports once its status line is long gone: the request's fault (a UserError), or the
    server's, which is logged with its traceback."""
    if isinstance(exc, UserError):
        return "invalid_request_error"
    logging.getLogger("dflash.server").exception(f"{what} failed")
    return server_kind
