"""Structural tags, as vLLM and SGLang take them (`response_format: {"type": "structural_tag", "structures":
[{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}`, after xgrammar): free text in which a trigger, once
written, must go on into one of the structures whose `begin` starts with it: the rest of that `begin`, a JSON
document of its `schema`, then its `end`, after which the text is free again. A model that writes calls inside its
own words (`<function=get_weather>{"city": "Paris"}</function>`) is held so while it talks between them.

A state is a tuple whose first item is its mode:
- (TAG_TEXT, tail): free text; `tail` the longest end of it that begins some trigger;
- (TAG_BEGIN, written): a trigger written; `written` the begin so far (a prefix of one structure's begin or more);
- (TAG_DOCUMENT, k, inner): in structure k's document, `inner` the state of its grammar (grammar.JsonGrammar);
- (TAG_END, k, matched): structure k's document whole, `matched` bytes of its end written.
No begin may be a prefix of another (which structure a document belongs to must be known where it starts). A
document is its schema's as structured output holds one (grammar.py; an object or an array, strict). The output may
end in free text only. Masks (structured.py): free text allows every token but those holding a trigger's last
byte, which are walked; a document's are its own grammar's, but for the tokens that hold a closing bracket before
their last byte (they may close the document and go on into its end), which are walked.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from .errors import UserError
from .grammar import THINK_TAGS, THINKING, ByteGrammar, JsonGrammar, complete, compile_schema

TAG_TEXT, TAG_BEGIN, TAG_DOCUMENT, TAG_END = 200, 201, 202, 203  # apart from grammar.py's modes
CLOSERS = b"}]"  # a document's last byte (its root is an object or an array)
MAX_STRUCTURES = 64


@dataclass(frozen=True)
class Structure:
    begin: bytes
    grammar: JsonGrammar
    end: bytes


class TagGrammar(ByteGrammar):
    """The automaton of free text with structures (the module's docstring); JsonGrammar's interface, so
    structured.py masks it and the engine drafts its forced bytes (a begin's rest, a key's name, an end) free."""

    text_otherwise, frame = False, None
    words_after_thought = True  # free text takes whitespace itself

    def __init__(self, structures: tuple[Structure, ...], triggers: tuple[bytes, ...], text: str,
                 thinking: str | None = None):
        self.structures, self.triggers, self.text, self.thinking = structures, triggers, text, thinking
        self.key = f"structural_tag:{thinking}:{text}"  # masks are kept by key and state (structured.py)
        self.prefixes = {trigger[:n] for trigger in triggers for n in range(len(trigger))}  # a tail may be these
        self.begins = {s.begin[:n] for s in structures for n in range(1, len(s.begin) + 1)}
        self.start = (TAG_TEXT, b"")
        self.initial = self.first_state()

    def thinking_first(self, thinking: str | None) -> "TagGrammar":
        """This grammar after a reasoning model's thinking (ByteGrammar; None: itself)."""
        return self if thinking is None else _tags(self.text, thinking)

    def feed(self, state: tuple, byte: int) -> tuple | None:
        mode = state[0]
        if mode == TAG_TEXT:
            return self._text(state[1] + bytes([byte]))
        if mode == TAG_BEGIN:
            return self._begun(state[1] + bytes([byte]))
        if mode == TAG_DOCUMENT:
            structure = self.structures[state[1]]
            inner = structure.grammar.feed(state[2], byte)
            if inner is None:
                return None
            if not complete(inner):
                return (TAG_DOCUMENT, state[1], inner)
            return (TAG_END, state[1], 0) if structure.end else self.start  # an end may be empty
        if mode == TAG_END:
            end = self.structures[state[1]].end
            if end[state[2]] != byte:
                return None
            return self.start if state[2] + 1 == len(end) else (TAG_END, state[1], state[2] + 1)
        return self.feed_thought(*state[:3], byte)

    def _text(self, tail: bytes) -> tuple | None:
        """Free text whose end is `tail`: the longest trigger it ends with, once all its bytes are written (its
        begin then goes on), else the longest end of `tail` that begins a trigger."""
        for cut in range(len(tail)):
            if tail[cut:] in self.triggers:
                return self._begun(tail[cut:])
        while tail not in self.prefixes:
            tail = tail[1:]
        return (TAG_TEXT, tail)

    def _begun(self, written: bytes) -> tuple | None:
        if written not in self.begins:
            return None
        for k, structure in enumerate(self.structures):
            if structure.begin == written:
                return (TAG_DOCUMENT, k, structure.grammar.initial)
        return (TAG_BEGIN, written)

    def may_end(self, state: tuple) -> bool:
        if state[0] == TAG_TEXT:
            return True
        return state[0] not in (TAG_BEGIN, TAG_DOCUMENT, TAG_END) and self.thought_may_end(state)

    def finished(self, state: tuple) -> bool:
        return False  # free text may always follow

    def after_special(self, state: tuple) -> tuple | None:
        """A special token (no bytes of its own) is text in free text, where it breaks a trigger begun."""
        if state[0] == TAG_TEXT:
            return self.start
        if state[0] in (TAG_BEGIN, TAG_DOCUMENT, TAG_END):
            return None
        return self.thought_after_special(state)

    def free_text_tag(self, state: tuple) -> bytes | tuple[bytes, ...] | None:
        """The tags that end free text where `state` is in it: the triggers, or a thought's `</think>`."""
        if state[0] == TAG_TEXT:
            return self.triggers
        return THINK_TAGS[1] if state[0] == THINKING else None

    def delegate(self, state: tuple) -> tuple[tuple | None, bytes] | None:
        return self.thought_delegate(state) if state[0] < TAG_TEXT else None

    def nested(self, state: tuple) -> tuple[JsonGrammar, tuple, bytes] | None:
        """Where `state` is inside a document: (its grammar, its state there, the bytes that may close it); a token
        without those bytes before its last one is allowed here as it is there."""
        if state[0] != TAG_DOCUMENT:
            return None
        return self.structures[state[1]].grammar, state[2], CLOSERS


def structural_tag_format(given) -> tuple[str, dict]:
    """(response_format, json_schema) of GenerationConfig for a structural tag ({"structures": [...], "triggers":
    [...]}, or its JSON text), checked here: what cannot be held is refused before anything is generated."""
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError:
            given = None
    if not isinstance(given, dict) or "format" in given and "structures" not in given:
        raise UserError('a structural tag must be {"structures": [{"begin": ..., "schema": {...}, "end": ...}], '
                        '"triggers": [...]} (xgrammar\'s newer "format" layout is not supported)')
    given = {"structures": given.get("structures"), "triggers": given.get("triggers")}
    tag_grammar(given)
    return "structural_tag", given


def tag_grammar(given: dict, thinking: str | None = None) -> TagGrammar:
    """The grammar of a structural tag (structural_tag_format's json_schema), one each while it is in use."""
    try:
        text = json.dumps(given, sort_keys=True)
    except (TypeError, ValueError):
        raise UserError("a structural tag must be JSON") from None
    return _tags(text, thinking)


@functools.lru_cache(maxsize=32)
def _tags(text: str, thinking: str | None) -> TagGrammar:
    given = json.loads(text)
    triggers, structures = given.get("triggers"), given.get("structures")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise UserError("a structural tag's triggers must be a non-empty list of non-empty strings")
    if not isinstance(structures, list) or not structures or len(structures) > MAX_STRUCTURES:
        raise UserError(f"a structural tag's structures must be a list of 1 to {MAX_STRUCTURES} "
                        '{"begin": ..., "schema": {...}, "end": ...}')
    built = tuple(_structure(s, f"structures[{k}]", triggers) for k, s in enumerate(structures))
    for trigger in triggers:
        if not any(s.begin.startswith(trigger.encode()) for s in built):
            raise UserError(f"a structural tag's trigger {trigger!r} begins none of its structures")
    for one in built:
        for other in built:
            if one is not other and other.begin.startswith(one.begin):
                raise UserError(f"a structural tag's begins must not start one another: {one.begin.decode()!r} "
                                f"and {other.begin.decode()!r}")
    return TagGrammar(built, tuple(t.encode() for t in triggers), text, thinking)


def _structure(given, where: str, triggers: list[str]) -> Structure:
    if not isinstance(given, dict) or not isinstance(given.get("begin"), str) or not isinstance(given.get("end"), str):
        raise UserError(f"{where} must be {{\"begin\": ..., \"schema\": {{...}}, \"end\": ...}} with strings for "
                        "begin and end")
    if not any(given["begin"].startswith(trigger) for trigger in triggers):
        raise UserError(f"{where}.begin {given['begin']!r} starts with none of the triggers")
    try:
        grammar = compile_schema(given.get("schema", {"type": "object"}))
    except UserError as error:
        raise UserError(f"{where}.schema: {error}") from None
    return Structure(given["begin"].encode(), grammar, given["end"].encode())
