"""Structural tags, as vLLM and SGLang take them (`response_format: {"type": "structural_tag", "structures":
[{"begin": ..., "schema": {...}, "end": ...}], "triggers": [...]}`, after xgrammar): free text in which a trigger, once
written, must go on into one of the structures whose `begin` starts with it: the rest of that `begin`, a JSON
document of its `schema`, then its `end`, after which the text is free again. A model that writes calls inside its
own words (`<function=get_weather>{"city": "Paris"}</function>`) is held so while it talks between them.

xgrammar's newer layout (`{"type": "structural_tag", "format": {...}}`) is taken where its format is
`triggered_tags` of `tag`s with string begins and ends and `json_schema` contents (the shape tool calls take),
with its flags: `at_least_one` (the output opens with a structure, no free text first), `stop_after_first` (the
output ends after the first structure) and `excludes` (strings free text may not hold). Its other formats are
refused in one line.

A state is a tuple whose first item is its mode:
- (TAG_TEXT, tail): free text; `tail` the longest end of it that begins some trigger;
- (TAG_BEGIN, written): a trigger written; `written` the begin so far (a prefix of one structure's begin or more);
- (TAG_DOCUMENT, k, inner): in structure k's document, `inner` the state of its grammar (grammar.JsonGrammar);
- (TAG_END, k, matched): structure k's document whole, `matched` bytes of its end written;
- (TAG_FINISHED,): the first structure ended where stop_after_first asks that nothing follow it.
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

TAG_TEXT, TAG_BEGIN, TAG_DOCUMENT, TAG_END, TAG_FINISHED = 200, 201, 202, 203, 204  # apart from grammar.py's modes
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

    def __init__(self, structures: tuple[Structure, ...], triggers: tuple[bytes, ...], text: str,
                 thinking: str | None = None, excludes: tuple[bytes, ...] = (), at_least_one: bool = False,
                 stop_after_first: bool = False):
        self.structures, self.triggers, self.text, self.thinking = structures, triggers, text, thinking
        self.excludes, self.stop_after_first = excludes, stop_after_first
        self.key = f"structural_tag:{thinking}:{text}"  # masks are kept by key and state (structured.py)
        watched = triggers + excludes
        self.prefixes = {word[:n] for word in watched for n in range(len(word))}  # a tail may be these
        self.begins = {s.begin[:n] for s in structures for n in range(1, len(s.begin) + 1)}
        self.text_start = (TAG_TEXT, b"")
        self.start = (TAG_BEGIN, b"") if at_least_one else self.text_start
        self.words_after_thought = not at_least_one  # free text takes the whitespace after a thought itself
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
            return (TAG_END, state[1], 0) if structure.end else self._after_structure()  # an end may be empty
        if mode == TAG_END:
            end = self.structures[state[1]].end
            if end[state[2]] != byte:
                return None
            return self._after_structure() if state[2] + 1 == len(end) else (TAG_END, state[1], state[2] + 1)
        if mode == TAG_FINISHED:
            return None
        return self.feed_thought(*state[:3], byte)

    def _after_structure(self) -> tuple:
        return (TAG_FINISHED,) if self.stop_after_first else self.text_start

    def _text(self, tail: bytes) -> tuple | None:
        """Free text whose end is `tail`: the longest trigger it ends with, once all its bytes are written (its
        begin then goes on; an exclude refused), else the longest end of `tail` that begins a trigger or an
        exclude."""
        for cut in range(len(tail)):
            if tail[cut:] in self.excludes:
                return None
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
        if state[0] in (TAG_TEXT, TAG_FINISHED):
            return True
        return state[0] not in (TAG_BEGIN, TAG_DOCUMENT, TAG_END) and self.thought_may_end(state)

    def finished(self, state: tuple) -> bool:
        return state[0] == TAG_FINISHED  # else free text may follow

    def after_special(self, state: tuple) -> tuple | None:
        """A special token (no bytes of its own) is text in free text, where it breaks a trigger begun."""
        if state[0] == TAG_TEXT:
            return self.text_start
        if state[0] >= TAG_TEXT:
            return None
        return self.thought_after_special(state)

    def free_text_tag(self, state: tuple) -> bytes | tuple[bytes, ...] | None:
        """The tags that end free text where `state` is in it (the triggers and the excludes), or a thought's
        `</think>`."""
        if state[0] == TAG_TEXT:
            return self.triggers + self.excludes
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
    [...]}, or xgrammar's {"format": {"type": "triggered_tags", ...}}, or its JSON text), checked here: what cannot
    be held is refused before anything is generated."""
    if isinstance(given, str):
        try:
            given = json.loads(given)
        except ValueError:
            given = None
    if not isinstance(given, dict):
        raise UserError('a structural tag must be {"structures": [{"begin": ..., "schema": {...}, "end": ...}], '
                        '"triggers": [...]} or {"format": {"type": "triggered_tags", ...}}')
    if "format" in given:
        given = _from_format(given["format"])
    else:
        given = {"structures": given.get("structures"), "triggers": given.get("triggers")}
    tag_grammar(given)
    return "structural_tag", given


def _from_format(form) -> dict:
    """xgrammar's newer layout, where it is triggered tags of JSON documents, as the legacy one and its flags."""
    if not isinstance(form, dict) or form.get("type") != "triggered_tags":
        kind = form.get("type") if isinstance(form, dict) else type(form).__name__
        raise UserError(f"a structural tag's format {kind!r} is not supported here (triggered_tags of tags whose "
                        "contents are json_schema is, and the structures/triggers layout)")
    tags = form.get("tags")
    if not isinstance(tags, list):
        raise UserError("a structural tag's format.tags must be a list of tags")
    return {"structures": [_from_tag(tag, f"format.tags[{k}]") for k, tag in enumerate(tags)],
            "triggers": form.get("triggers"), "excludes": form.get("excludes", []),
            "at_least_one": form.get("at_least_one", False), "stop_after_first": form.get("stop_after_first", False)}


def _from_tag(tag, where: str) -> dict:
    content = tag.get("content") if isinstance(tag, dict) else None
    if not isinstance(tag, dict) or tag.get("type", "tag") != "tag" or not isinstance(content, dict) \
            or content.get("type") != "json_schema" or content.get("style", "json") != "json" \
            or content.get("any_order", False):
        raise UserError(f'{where} must be {{"type": "tag", "begin": ..., "content": {{"type": "json_schema", '
                        '"json_schema": {...}}, "end": ...} (other contents, styles and any_order are not supported '
                        "here)")
    return {"begin": tag.get("begin"), "schema": content.get("json_schema"), "end": tag.get("end")}


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
    excludes = given.get("excludes", [])
    if not isinstance(excludes, list) or not all(isinstance(e, str) and e for e in excludes):
        raise UserError("a structural tag's excludes must be a list of non-empty strings")
    flags = {flag: given.get(flag, False) for flag in ("at_least_one", "stop_after_first")}
    if not all(isinstance(value, bool) for value in flags.values()):
        raise UserError("a structural tag's at_least_one and stop_after_first must be true or false")
    return TagGrammar(built, tuple(t.encode() for t in triggers), text, thinking,
                      tuple(e.encode() for e in excludes), **flags)


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
