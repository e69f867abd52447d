"""JSON output (response_format json_object): the grammar against Python's json module, the masks against feeding
every token byte by byte, and constrained speculative decoding against a plain constrained loop, greedy and seeded,
for every proposer; the distribution of a sampled position; the CLI and the server."""

import json
import random
import re

import pytest
import torch

from conftest import ARCHS, OracleProposer, OracleTree, RandomProposer
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.loading import build_proposer
from dflash.methods.base import Draft, MethodOptions, Proposer
from dflash.methods.dflash.proposer import DFlashProposer
from dflash.methods.ngram import NgramProposer
from dflash.sampling import SamplingConfig, pick_tokens
from dflash.grammar import (JSON_OBJECT, MAX_SPACES, PROSE, START_STATE, TEXT, THINK_OPEN, THINKING, THOUGHT,
                            compile_schema, complete)
from dflash.patterns import compile_pattern, format_pattern
from dflash.structural_tags import TAG_TEXT
from dflash.structured import JsonVocabulary, json_vocabulary, token_pieces
from dflash.testing import tiny_byte_tokenizer, tiny_target
from test_engine import make_drafter

VOCAB = 320
MAX_NEW = 40
PROMPT = "Write a JSON object about a cat."
DOCUMENTS = ['{"name": "Tom", "age": 3, "tags": ["grey", "fat"], "owner": null}',
             '{"a": [1, -2.5e+3, 0, true, false, {"b": {}}, []], "c\\u00e9": "x\\n\\"y\\""}',
             '{\n  "nested": {"deep": [[["\u00fcber", "\u4e2d\u6587", "\U0001f600"]]]},\n  "n": -0.125E-2\n}']


def strict_object(text: str) -> bool:
    """Whether Python's json module reads `text` as one object (NaN and Infinity refused, as JSON does)."""
    def refuse(constant):
        raise ValueError(constant)
    try:
        return isinstance(json.loads(text, parse_constant=refuse), dict)
    except ValueError:
        return False


def structure_bias(target, strong: bool = True) -> dict[int, float]:
    """A push towards quotes, colons and closing braces: a random model then closes its objects (strong: greedy
    closes them within a few tokens; mild: samples write keys and values of many kinds first)."""
    ids = target.tokenizer.convert_tokens_to_ids
    if strong:
        return {ids('"'): 5.0, ids("}"): 3.0, ids('"}'): 4.0, ids(":"): 3.0, ids('":'): 3.0, ids(","): 1.0}
    return {ids('"'): 3.0, ids("}"): 2.5, ids('"}'): 2.5, ids(":"): 2.0, ids('":'): 2.5, ids(",\u0120"): 2.0,
            ids("1"): 2.0, ids("true"): 2.0, ids("a"): 1.5}


# ---- the grammar ---------------------------------------------------------------------------------------------------
def test_the_grammar_accepts_exactly_the_objects_python_reads():
    rng = random.Random(0)
    alphabet = '{}[]":,0123456789-.eE+tfalsenru\\"ab \n\u00e9'
    completes = 0
    for _ in range(60000):
        text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14)))
        if text != text.rstrip():  # whitespace after the object is refused: it ends where the object does
            continue
        state = JSON_OBJECT.feed_bytes(START_STATE, text.encode())
        assert complete(state) == strict_object(text), text
        completes += complete(state)
    assert completes > 100
    for document in DOCUMENTS:
        data = document.encode()
        assert complete(JSON_OBJECT.feed_bytes(START_STATE, data))
        assert all(JSON_OBJECT.feed_bytes(START_STATE, data[:n]) is not None for n in range(len(data)))  # prefixes


@pytest.mark.parametrize("text", ['{"a": 01}', '{"a": 1,}', "[1]", ' {"a": 1}', '{"a" 1}', '{"a": tru}', '{"a": 1}}',
                                  '{"\\x": 1}', '{"a": "\x01"}', '{"a": .5}', '{"a": 1.}', '{"a": -}'])
def test_the_grammar_refuses_what_json_refuses(text):
    assert not complete(JSON_OBJECT.feed_bytes(START_STATE, text.encode()))


def test_strings_take_only_valid_utf8():
    prefix = b'{"a": "'
    for character in ("\u00e9", "\u4e2d", "\U0001f600"):
        assert JSON_OBJECT.feed_bytes(START_STATE, prefix + character.encode()) is not None
    for bad in (b"\xc0\xaf", b"\xed\xa0\x80", b"\xe0\x80\x80", b"\xf4\x90\x80\x80", b"\x80", b"\xff"):
        assert JSON_OBJECT.feed_bytes(START_STATE, prefix + bad) is None, bad
    assert JSON_OBJECT.feed_bytes(START_STATE, prefix + b"\xe4\xb8") is not None  # half a character: more may come


def test_whitespace_runs_are_capped():
    assert JSON_OBJECT.feed_bytes(START_STATE, b"{" + b" " * MAX_SPACES) is not None
    assert JSON_OBJECT.feed_bytes(START_STATE, b"{" + b" " * (MAX_SPACES + 1)) is None
    assert JSON_OBJECT.feed_bytes(START_STATE, b'{"a": " ' + b" " * 100) is not None  # inside a string spaces are text


# ---- JSON Schema ---------------------------------------------------------------------------------------------------
def pet_models():
    """Pydantic models whose schemas hold what the grammar enforces: $defs and $refs (one recursive), enums of
    strings and of numbers (12 beside 1 and 123), optional fields (anyOf with null), bounded arrays."""
    from enum import Enum
    from typing import Literal, Optional

    from pydantic import BaseModel, Field

    class Color(str, Enum):
        red = "red"
        green = "green"

    class Pet(BaseModel):
        name: str
        age: int
        color: Color
        weight: float
        vaccinated: bool
        nickname: Optional[str] = None
        tags: list[Literal["a", "bb", "ccc"]] = Field(default_factory=list, max_length=3)

    class Owner(BaseModel):
        pets: list[Pet] = Field(min_length=1)
        rating: Literal[1, 12, 123]
        friend: Optional["Owner"] = None

    return Owner


# the bytes a random walk through a grammar picks from: printable ASCII, a newline, pieces of UTF-8 characters
WALK_BYTES = bytes(range(0x20, 0x7F)) + b"\n\xc3\xa9\xe4\xb8\xad"


def random_document(grammar, rng: random.Random, budget: int = 60) -> bytes:
    """A random walk through the grammar's allowed bytes until the document is whole; past `budget` bytes it closes
    what it can (quotes and brackets, then null, then the rest) so that it ends."""
    state, out = START_STATE, bytearray()
    while not complete(state):
        allowed = [b for b in WALK_BYTES if grammar.feed(state, b) is not None]
        assert allowed, f"a dead end after {bytes(out)!r}"  # every state the grammar lets through can be finished
        if len(out) > budget:
            for preferred in (b'"}]', b",:", b"n", b"tf", b"Z", b"0123456789"):  # Z: a time's offset ends it
                closing = [b for b in allowed if b in preferred]
                if closing:
                    allowed = closing
                    break
            else:
                allowed = [b for b in allowed if b not in b" \n"] or allowed
        byte = rng.choice(allowed)
        out.append(byte)
        state = grammar.feed(state, byte)
    return bytes(out)


def assert_walks_validate(model, seed: int, walks: int, budget: int = 60) -> list[bytes]:
    """Random walks through the grammar of a pydantic model's schema, each validated by the model (strict)."""
    grammar, rng = compile_schema(model.model_json_schema()), random.Random(seed)
    documents = [random_document(grammar, rng, budget) for _ in range(walks)]
    for document in documents:
        model.model_validate_json(document, strict=True)  # raises where the grammar let an invalid document through
    return documents


def assert_masks_are_fed(grammar, texts: list[bytes], tokenizer=None) -> int:
    """Every state along the texts' prefixes: its mask over a tiny byte-level vocabulary (`tokenizer`'s, else
    tiny_byte_tokenizer's) is each token fed, and no state is a dead end. Returns how many states."""
    vocabulary = JsonVocabulary(token_pieces(tokenizer or tiny_byte_tokenizer(VOCAB), VOCAB))
    states = {grammar.feed_bytes(grammar.initial, text[:n]) for text in texts for n in range(len(text))}
    assert None not in states
    for state in states:
        mask = vocabulary.allowed(grammar, state)
        fed = torch.tensor([fed_token(grammar, state, vocabulary.pieces[token]) is not None
                            for token in range(VOCAB)])
        assert torch.equal(mask, fed), state
        assert grammar.finished(state) or mask.any()
    return len(states)


def fed_token(grammar, state, piece: bytes | None):
    """The state after a token of bytes `piece` (None: a special token, text only in free text), or None."""
    if state[0] == TEXT:
        return state
    if piece is None:  # text in free text: a framed grammar's words, thinking, where the output may open either
        if state[0] == THINKING:
            return state[:1] + (0, 0, ())
        if state[0] == THOUGHT:
            state = grammar.start
        elif state[0] == THINK_OPEN:  # the tag's bytes so far are the grammar's, as the reply may not think after all
            state = grammar.feed_bytes(grammar.start, b"<think>"[:state[1]])
            if state is None or state[0] == TEXT:
                return state
        if state[0] == TAG_TEXT:  # structural tags' free text: a trigger begun is broken
            return (TAG_TEXT, b"")
        prose = grammar.frame is not None and grammar.frame.prose and state[0] in (START_STATE[0], PROSE)
        return (PROSE, 0, 0, ()) if prose else None
    return grammar.feed_bytes(state, piece)


def test_whatever_a_schema_grammar_lets_through_validates():
    owner = pet_models()
    for document in assert_walks_validate(owner, seed=0, walks=300):
        assert list(json.loads(document)) == [k for k in owner.model_fields if k in json.loads(document)]


def test_a_schema_grammar_takes_valid_documents_in_the_schemas_order_and_refuses_the_rest():
    grammar = compile_schema(pet_models().model_json_schema())
    pet = '{"name": "Tom", "age": 3, "color": "red", "weight": 4.5, "vaccinated": true%s}'
    good = ['{"pets": [%s], "rating": 12}' % (pet % ""),
            '{"pets": [%s, %s], "rating": 123, "friend": null}' % (pet % ', "nickname": null', pet % ', "tags": []'),
            '{"pets": [%s], "rating": 1, "friend": {"pets": [%s], "rating": 12}}'
            % (pet % "", pet % ', "tags": ["bb"]')]
    bad = ['{"pets": [], "rating": 12}',  # minItems 1
           '{"pets": [%s], "rating": 2}' % (pet % ""),  # not in the enum
           '{"pets": [%s], "rating": 1.0}' % (pet % ""),
           '{"rating": 12, "pets": [%s]}' % (pet % ""),  # out of order
           '{"pets": [%s], "rating": 12, "extra": 1}' % (pet % ""),
           '{"pets": [%s]}' % (pet % ""),  # rating is required
           '{"pets": [%s], "rating": 12}' % (pet % ', "tags": ["a", "a", "a", "a"]'),  # maxItems 3
           '{"pets": [%s], "rating": 12}' % (pet % "").replace('"age": 3', '"age": 3.5'),
           '{"pets": [%s], "rating": 12}' % (pet % "").replace('"red"', '"blue"')]
    for document in good:
        assert complete(grammar.feed_bytes(START_STATE, document.encode())), document
    for document in bad:
        assert not complete(grammar.feed_bytes(START_STATE, document.encode())), document


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x(?=y)"}}}, "a lookaround"),
    ({"type": "object", "properties": {"a": {"type": "string", "format": "hostname"}}}, "format 'hostname' cannot"),
    ({"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}}, "multipleOf cannot be enforced"),
    ({"type": "string"}, "or an array at its root"),
    ({"anyOf": [{"type": "object"}, {"type": "integer"}]}, "or an array at its root"),
    ({"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"enum": ["x"]}]}}}, "start alike"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/B"}}}, "points at nothing"),
    ({"type": "object", "properties": {"a": {"$ref": "http://x/y"}}}, "only local $refs"),
    ({"type": "object", "properties": {"a": {"type": "date"}}}, "unknown type"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]}, "does not define: b"),
    ({"type": "object", "properties": {"a": {"type": "array", "minItems": 3, "maxItems": 2}}}, "minItems <= maxItems"),
])
def test_what_a_grammar_cannot_enforce_is_refused_in_one_line(schema, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        compile_schema(schema)


def bounded_review():
    """A pydantic model with the bounds pydantic's Field writes: ge/le, gt/lt (numbers, integers, negative ranges)
    and min_length/max_length."""
    from typing import Optional

    from pydantic import BaseModel, Field

    class Review(BaseModel):
        stars: int = Field(ge=1, le=5)
        score: float = Field(gt=0, lt=1)
        title: str = Field(min_length=2, max_length=5)
        year: int = Field(gt=1900, le=2026)
        delta: int = Field(ge=-12, le=-3)
        temperature: float = Field(ge=-40.5, le=60)
        code: Optional[str] = Field(default=None, max_length=3)
        count: int = Field(ge=100)

    return Review


def test_bounds_and_lengths_hold_whatever_the_grammar_lets_through():
    review = bounded_review()
    grammar = compile_schema(review.model_json_schema())
    assert_walks_validate(review, seed=1, walks=300, budget=80)
    whole = {"stars": 5, "score": 0.5, "title": '"ab"', "year": 2026, "delta": -3, "temperature": -40.5,
             "count": 100}

    def accepts(**changed) -> bool:
        fields = {**whole, **changed}
        text = "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items()) + "}"
        return complete(grammar.feed_bytes(START_STATE, text.encode()))

    assert accepts() and accepts(title='"ééééé"', year=1901, delta=-12, temperature=60,
                                 count=99999, score="0.999", stars=1)
    for changed in [{"stars": 6}, {"stars": 0}, {"score": 1}, {"score": 0}, {"score": "0.5e-1"}, {"title": '"a"'},
                    {"title": '"abcdef"'}, {"year": 1900},
                    {"year": 2027}, {"delta": -2}, {"delta": -13}, {"temperature": "-40.51"},
                    {"temperature": "60.01"}, {"count": 99}, {"stars": "5.0"}]:
        assert not accepts(**changed), changed
    assert accepts(title='"\\u00e9\\"\\n"')  # escapes count as one character each
    assert not accepts(title='"\\ud83d\\ude00"')  # so surrogate pairs (two escapes, one character) are refused


def pattern_matches(pattern, text: str) -> bool:
    states = pattern.start
    for character in text:
        states = pattern.step(states, ord(character))
        if not states:
            return False
    return pattern.accepts(states)


@pytest.mark.parametrize("source", ["^[a-z]+$", "abc", "^a(b|cd)*e?$", "^\\d{3}-\\d{2,4}$", "^(?:[A-Z][a-z]*\\s?)+$",
                                    "x+y", '^[^"\\\\]{0,3}$', "^.{2,}$", "^(ab|a)(c|bcd)$", "^[\\w.-]+$", "^\\u00e9+$",
                                    "^[\\D]{2}\\S*?$", "^a{2,}b{0,1}$"])
def test_a_pattern_matches_what_pythons_re_finds(source):
    """Search semantics unless anchored; ECMA's `$` (the very end) and ASCII classes, as Python's re reads them with
    re.ASCII and \\Z (negated escapes take ASCII characters only, which both readings agree on)."""
    pattern, rng = compile_pattern(source), random.Random(source)
    python = re.compile(source[:-1] + "\\Z" if source.endswith("$") else source, re.ASCII)
    alphabet = 'abcdexyzAB019-_. "\\\n' + ("" if re.search(r"\\[DSW]", source) else "\u00e9")
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7)))
        assert pattern_matches(pattern, text) == (python.search(text) is not None), text


def test_formats_hold_their_shapes():
    cases = {"date": (["2024-02-28", "1999-12-31", "2024-04-30", "2024-02-29"], ["2024-04-31", "2024-13-01",
                                                                                "24-01-01", "2023-02-29"]),
             "date-time": (["2024-01-05T10:20:30Z", "2024-01-05T10:20:30.5+02:00"],
                           ["2024-01-05T24:00:00Z", "2024-01-05 10:20:30Z", "2024-01-05T10:20:30"]),
             "time": (["23:59:59Z", "00:00:00.123-05:30"], ["12:00", "12:00:00+2"]),
             "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
             "email": (["a.b+c@mail.example.com"], ["a..b@example.com", ".a@example.com", "a@-x.com", "a@b.c"]),
             "ipv4": (["192.168.0.255", "8.8.8.8"], ["256.1.1.1", "1.2.3", "01.2.3.4"])}
    for name, (good, bad) in cases.items():
        pattern = format_pattern(name, "#")
        assert all(pattern_matches(pattern, text) for text in good), name
        assert not any(pattern_matches(pattern, text) for text in bad), name


def test_the_date_format_takes_exactly_the_dates_python_reads():
    import datetime

    pattern = format_pattern("date", "#")
    for year in (0, 1, 4, 100, 400, 1900, 1996, 2000, 2023, 2024, 2100, 2400, 9996, 9999):
        for month in range(14):
            for day in range(33):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = datetime.date.fromisoformat(text) is not None
                except ValueError:
                    valid = False
                assert pattern_matches(pattern, text) == valid, text


def formatted_event():
    """A pydantic model with fields whose schemas carry formats and patterns."""
    import datetime
    import uuid

    from pydantic import BaseModel, Field

    class Event(BaseModel):
        id: uuid.UUID
        day: datetime.date
        starts: datetime.datetime
        code: str = Field(pattern="^[A-Z]{2}-\\d{3}$")
        tag: str = Field(pattern="x", max_length=4)

    return Event


def test_patterns_and_formats_hold_whatever_the_grammar_lets_through():
    event = formatted_event()
    grammar = compile_schema(event.model_json_schema())
    assert_walks_validate(event, seed=2, walks=200, budget=120)
    document = ('{"id": "123e4567-e89b-12d3-a456-426614174000", "day": "2024-02-28", "starts": "2024-01-05T10:20:30Z", '
                '"code": "AB-123", "tag": "%s"}')
    for tag in ("\\u00e9yx", '\\"\\\\\\nx', "\\u001fx"):  # escapes of what is not printable ASCII, and \" \\ \n
        assert complete(grammar.feed_bytes(START_STATE, (document % tag).encode())), tag
    # no x; too long for the x; a surrogate escape; printable ASCII escaped (held strings write it one way: as itself)
    for tag in ("abcd", "abcdx", "\\ud83dx", "\\u0078yz", "\\/x", "\\u0022x"):
        assert not complete(grammar.feed_bytes(START_STATE, (document % tag).encode())), tag
    assert_masks_are_fed(grammar, [(document % "\u00e9\\nx").encode()])


@pytest.mark.parametrize("schema, fragment", [
    ({"type": "string", "pattern": "a\\1"}, "the escape \\1"),
    ({"type": "string", "pattern": "a^b"}, "the anchor '^' inside"),
    ({"type": "string", "pattern": "(a"}, "an unclosed group"),
    ({"type": "string", "pattern": "a{3,2}"}, "the repetition {3,2}"),
    ({"type": "string", "pattern": "(abcdefghij){1000}"}, "too large to enforce"),
    ({"type": "string", "pattern": "x", "format": "date"}, "both a pattern and a format"),
    ({"type": "string", "pattern": "x", "minLength": 2}, "minLength beside a pattern"),
    ({"type": "string", "pattern": "(" * 3000 + "a" + ")" * 3000}, "nested too deeply"),
    ({"type": "integer", "minimum": 0.2, "maximum": 0.8}, "no integer lies between"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number lies between"),
    ({"type": "number", "minimum": "0"}, "minimum must be a number"),
    ({"type": "string", "minLength": 3, "maxLength": 2}, "minLength <= maxLength"),
])
def test_impossible_bounds_and_patterns_are_refused_in_one_line(schema, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)) as refused:
        compile_schema({"type": "object", "properties": {"x": schema}})
    assert "not JSON" not in str(refused.value)


def test_masks_in_bounded_numbers_and_sized_strings_are_every_token_fed_byte_by_byte():
    text = ('{"stars": 3, "score": 0.25, "title": "\u00e9a\\"b", "year": 1999, "delta": -7, "temperature": -40.25, '
            '"code": "xy", "count": 1234}').encode()
    assert assert_masks_are_fed(compile_schema(bounded_review().model_json_schema()), [text]) > 60


def test_free_form_objects_and_closed_empty_ones():
    counts = compile_schema({"type": "object", "additionalProperties": {"type": "integer"}})
    assert complete(counts.feed_bytes(START_STATE, b'{"x": 1, "y": -20}'))
    assert not complete(counts.feed_bytes(START_STATE, b'{"x": "1"}'))
    empty = compile_schema({"type": "object", "properties": {}, "additionalProperties": False})
    assert complete(empty.feed_bytes(START_STATE, b"{}"))
    assert empty.feed_bytes(START_STATE, b'{"') is None


# ---- the vocabulary ------------------------------------------------------------------------------------------------
def test_byte_level_pieces_are_the_tokens_bytes():
    tokenizer = tiny_byte_tokenizer(VOCAB)
    pieces = token_pieces(tokenizer, VOCAB)
    for document in DOCUMENTS:
        ids = tokenizer.encode(document, add_special_tokens=False)
        assert b"".join(pieces[i] for i in ids) == document.encode()
    assert all(pieces[i] is None for i in tokenizer.all_special_ids)
    assert pieces[len(tokenizer):] == [None] * (VOCAB - len(tokenizer))  # the model's ids past the tokenizer


def test_sentencepiece_pieces_read_their_spaces_and_byte_fallbacks():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<0x0A>": 1, "<0xC3>": 2, "<0xA9>": 3, "\u2581": 4, "{": 5, "\u2581\"": 6, "a": 7}
    core = Tokenizer(models.BPE(vocab, [], byte_fallback=True))
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>")
    assert token_pieces(tokenizer, 9) == [None, b"\n", b"\xc3", b"\xa9", b" ", b"{", b' "', b"a", None]


def test_a_tokenizer_without_known_bytes_is_refused_in_one_line():
    with pytest.raises(UserError, match="byte-level BPE or SentencePiece"):
        json_vocabulary(tiny_target("llama").tokenizer, 64)


def test_masks_are_every_token_fed_byte_by_byte():
    assert assert_masks_are_fed(JSON_OBJECT, [d.encode() for d in DOCUMENTS]) > 40


# ---- generation ----------------------------------------------------------------------------------------------------
def plain_constrained_loop(target, prompt_ids, sampling: SamplingConfig, max_new=MAX_NEW,
                           grammar=JSON_OBJECT) -> list[int]:
    """One transformers forward per token over the whole sequence; the allowed tokens found by feeding each token's
    bytes after the text so far; end-of-sequence only once the object is whole (or, for a grammar with free text
    otherwise, where the output is text); any token in free text."""
    pieces = token_pieces(target.tokenizer, target.vocab_size)
    eos = set(target.eos_token_ids)
    sequence, state = list(prompt_ids), grammar.initial
    for position in range(max_new):
        with torch.no_grad():
            logits = target.model(torch.tensor([sequence])).logits[0, -1:].float()
        for token, bias in sampling.logit_bias.items():
            logits[0, token] += bias
        allowed = [(t in eos and grammar.may_end(state)) or t not in eos and fed_token(grammar, state, pieces[t])
                   is not None for t in range(target.vocab_size)]
        logits[0, ~torch.tensor(allowed)] = float("-inf")
        token = int(pick_tokens(logits, sampling, len(sequence))[0])
        sequence.append(token)
        if token in eos:
            break
        state = fed_token(grammar, state, pieces[token])
    return sequence[len(prompt_ids):]


def assert_held_like_the_plain_loop(target, prompt_ids, grammar, response_format: str, json_schema: dict,
                                    max_new: int = 24):
    """Greedy and seeded: every proposer's output under the format is the plain constrained loop's under `grammar`.
    Returns the greedy and the seeded result."""
    results = []
    for sampling in (SamplingConfig(), SamplingConfig(temperature=0.9, seed=4)):
        expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=max_new, grammar=grammar)
        config = GenerationConfig(max_new, sampling=sampling, response_format=response_format, json_schema=json_schema)
        for name, proposer in proposers(target, expected, len(prompt_ids)).items():
            result = SpeculativeDecoder(target, proposer).generate(prompt_ids, config)
            assert result.tokens == expected, (name, json_schema, sampling)
        results.append(result)
    return results


def proposers(target, reference, prompt_len):
    return {
        "ar": Proposer(), "ngram": NgramProposer(max_draft=7), "random": RandomProposer(target.vocab_size, 15),
        "oracle": OracleProposer(reference, prompt_len, 15), "dflash": DFlashProposer(make_drafter(target, 8), target),
        "tree": OracleTree(reference, prompt_len, 12, target.vocab_size),
        "eagle3": build_proposer("eagle3", target, MethodOptions(block_size=8))[0],
        "dflash+ngram": build_proposer("dflash+ngram", target, MethodOptions(block_size=8))[0],
    }


def json_config(sampling: SamplingConfig, max_new=MAX_NEW) -> GenerationConfig:
    return GenerationConfig(max_new, sampling=sampling, response_format="json_object")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("biased", [False, True])
def test_constrained_greedy_equals_a_plain_constrained_loop_for_every_proposer(byte_targets, arch, biased):
    target = byte_targets[arch]
    prompt_ids = target.encode_prompt(PROMPT)
    sampling = SamplingConfig(logit_bias=structure_bias(target) if biased else {})
    expected = plain_constrained_loop(target, prompt_ids, sampling)
    free = SpeculativeDecoder(target).generate(prompt_ids, GenerationConfig(MAX_NEW, sampling=sampling))
    assert free.tokens != expected, "the grammar should change this output"
    for name, proposer in proposers(target, expected, len(prompt_ids)).items():
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, json_config(sampling))
        assert result.tokens == expected, name
        state = JSON_OBJECT.feed_bytes(START_STATE, result.text.encode())
        assert state is not None, name  # always a prefix of an object
        if biased:  # pushed to close: the object is whole and ends the generation
            assert result.finish_reason == "stop" and strict_object(result.text), (name, result.text)


@pytest.mark.parametrize("arch", ARCHS)
def test_seeded_constrained_samples_are_the_plain_loops_for_every_proposer(byte_targets, arch):
    target = byte_targets[arch]
    prompt_ids = target.encode_prompt(PROMPT)
    for seed in (1, 2):
        sampling = SamplingConfig(temperature=0.8, top_p=0.95, seed=seed, logit_bias=structure_bias(target, False))
        expected = plain_constrained_loop(target, prompt_ids, sampling)
        for name, proposer in proposers(target, expected, len(prompt_ids)).items():
            result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, json_config(sampling))
            assert result.tokens == expected, (name, seed)


def test_a_sampled_position_has_the_masked_distribution(byte_targets):
    """At T=1 the first token is drawn from the target's distribution over the tokens that open an object only."""
    target = byte_targets["llama"]
    prompt_ids = target.encode_prompt(PROMPT)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt_ids])).logits[0, -1].float()
    vocabulary = json_vocabulary(target.tokenizer, target.vocab_size)
    opening = vocabulary.allowed(JSON_OBJECT, START_STATE)
    assert opening.sum() == 2  # "{" and '{"'
    expected = torch.zeros_like(logits)
    expected[opening] = logits[opening].softmax(-1)
    decoder = SpeculativeDecoder(target, NgramProposer(max_draft=4))
    draws = 1500
    counts = torch.zeros_like(logits)
    for seed in range(draws):
        result = decoder.generate(prompt_ids, json_config(SamplingConfig(temperature=1.0, seed=seed), max_new=1))
        counts[result.tokens[0]] += 1
    assert counts[~opening].sum() == 0
    observed = counts / draws
    token = int(opening.nonzero()[0])
    p = float(expected[token])
    assert abs(float(observed[token]) - p) < 4 * (p * (1 - p) / draws) ** 0.5 + 1e-3


SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"},
    "kind": {"enum": ["cat", "dog", 12]}, "tags": {"type": "array", "items": {"type": "number"}, "maxItems": 2}},
    "required": ["name", "age", "ok", "kind"]}


def fits_schema(document: dict) -> bool:
    """SCHEMA's rules, checked by hand."""
    names = [k for k in SCHEMA["properties"] if k in document]
    return (list(document) == names and all(k in document for k in SCHEMA["required"])
            and isinstance(document["name"], str) and type(document["age"]) is int
            and isinstance(document["ok"], bool) and document["kind"] in ("cat", "dog", 12)
            and all(type(t) in (int, float) for t in document.get("tags", [])) and len(document.get("tags", [])) <= 2)


@pytest.mark.parametrize("arch", ARCHS)
def test_schema_constrained_decoding_is_the_plain_loops_for_every_proposer(byte_targets, arch):
    target = byte_targets[arch]
    prompt_ids = target.encode_prompt(PROMPT)
    grammar = compile_schema(SCHEMA)
    ids = target.tokenizer.convert_tokens_to_ids  # commas and brackets end integers and arrays, less whitespace
    closing = {**structure_bias(target), ids(","): 4.0, ids("]"): 3.0,
               **{ids(space): -5.0 for space in ("\u010a", "\u0109", "\u0120")}}
    for sampling in (SamplingConfig(logit_bias=closing),
                     SamplingConfig(temperature=0.8, seed=5, logit_bias=structure_bias(target, False))):
        expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=80, grammar=grammar)
        config = GenerationConfig(80, sampling=sampling, response_format="json_schema", json_schema=SCHEMA)
        for name, proposer in proposers(target, expected, len(prompt_ids)).items():
            result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
            assert result.tokens == expected, name
        if sampling.greedy:
            assert result.finish_reason == "stop" and fits_schema(json.loads(result.text)), result.text


class RefusedDrafts(Proposer):
    """Drafts the grammar never allows (the mask token), then a valid continuation's first token (the oracle's)."""

    name = "refused"

    def __init__(self, reference: list[int], prompt_len: int, refused: int):
        self.reference, self.prompt_len, self.refused, self.max_draft = reference, prompt_len, refused, 7

    def propose(self, sequence, limit=None, keep_going=None):
        done = len(sequence) - self.prompt_len
        right = self.reference[done: done + 3]
        return Draft(right + [self.refused] + right, [0.9] * (2 * len(right) + 1))


def test_drafts_the_grammar_refuses_are_never_verified(byte_targets):
    target = byte_targets["llama"]
    prompt_ids = target.encode_prompt(PROMPT)
    sampling = SamplingConfig(logit_bias=structure_bias(target, False))
    expected = plain_constrained_loop(target, prompt_ids, sampling)
    refused = target.tokenizer.mask_token_id
    proposer = RefusedDrafts(expected, len(prompt_ids), refused)
    result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, json_config(sampling))
    assert result.tokens == expected
    assert max(result.stats.draft_lengths) == 3  # each round's drafts cut before the refused token
    assert sum(result.stats.accept_lengths) == len(expected) - 1  # all but the first token, from the prompt pass


class RefusedWithRunnersUp(Proposer):
    """Seven drafts along a valid continuation (the oracle's) but the fourth, which the grammar refuses; where the
    engine asks for runners-up, that position's are another refused token, then the right one."""

    name = "runners-up"

    def __init__(self, reference: list[int], prompt_len: int, refused: int, other_refused: int):
        self.reference, self.prompt_len, self.max_draft = reference, prompt_len, 7
        self.refused, self.other_refused = refused, other_refused

    def propose(self, sequence, limit=None, keep_going=None):
        done = len(sequence) - self.prompt_len
        right = self.reference[done: done + 7]
        if len(right) < 5:
            return Draft(right, [0.9] * len(right))
        tokens = right[:3] + [self.refused] + right[4:]
        alternatives = None
        if self.alternatives:
            alternatives = [[] for _ in tokens]
            alternatives[3] = [(self.other_refused, 0.2), (right[3], 0.1), (right[0], 0.05)]
        return Draft(tokens, [0.5] * len(tokens), alternatives=alternatives)


def test_a_runner_up_the_grammar_allows_takes_a_refused_drafts_place(byte_targets, monkeypatch):
    import dflash.engine as engine

    target = byte_targets["qwen3"]
    prompt_ids = target.encode_prompt(PROMPT)
    sampling = SamplingConfig(logit_bias=structure_bias(target, False))
    expected = plain_constrained_loop(target, prompt_ids, sampling)
    refused, other = target.tokenizer.mask_token_id, target.tokenizer.pad_token_id
    proposer = RefusedWithRunnersUp(expected, len(prompt_ids), refused, other)
    steered = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, json_config(sampling))
    assert steered.tokens == expected
    assert max(steered.stats.draft_lengths) == 7  # the right runner-up in the refused draft's place
    assert sum(steered.stats.accept_lengths) == len(expected) - 1  # and every draft accepted
    monkeypatch.setattr(engine, "GRAMMAR_RUNNERS_UP", 0)  # none asked for: cut before the refused draft
    cut = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, json_config(sampling))
    assert cut.tokens == expected and max(cut.stats.draft_lengths) == 3
    assert steered.stats.num_rounds < cut.stats.num_rounds


def test_a_runner_ups_confidence_is_renormalised_over_what_the_refused_leave():
    from dflash.engine import runner_up_confidence

    others = [(5, 0.2), (6, 0.1)]
    assert runner_up_confidence(0.6, others, 0) == 0.6
    assert runner_up_confidence(0.6, others, 1) == pytest.approx(0.2 / 0.4)
    assert runner_up_confidence(0.6, others, 2) == pytest.approx(0.1 / 0.2)


def test_the_drafters_runners_up_are_its_next_candidates_best_first(tiny_targets):
    target = tiny_targets["llama"]
    proposer = DFlashProposer(make_drafter(target, 8), target)
    hidden = torch.randn(2, 5, target.hidden_size)
    drafts, confidence, none = proposer.read_drafts(hidden)
    same, same_confidence, alternatives = proposer.read_drafts(hidden, runners_up=3)
    assert none is None and torch.equal(drafts, same) and torch.equal(confidence, same_confidence)
    probabilities = proposer.base_logits(hidden).softmax(-1).view(2, 5, -1)
    assert len(alternatives) == 2 and all(len(row) == 5 and all(len(c) == 3 for c in row) for row in alternatives)
    for r in range(2):
        for j in range(5):
            order = probabilities[r, j].argsort(descending=True)[:4].tolist()
            assert [drafts[r, j].item()] + [t for t, _ in alternatives[r][j]] == order
            assert [p for _, p in alternatives[r][j]] == pytest.approx(probabilities[r, j, order[1:]].tolist())


LONG_KEYS = {"type": "object", "properties": {"a_rather_long_property_name": {"type": "integer"},
                                              "another_long_property_name": {"enum": ["yes", "no"]}},
             "required": ["a_rather_long_property_name", "another_long_property_name"]}


def test_forced_bytes_are_drafted_as_the_longest_tokens_inside_them():
    vocabulary = JsonVocabulary(token_pieces(tiny_byte_tokenizer(VOCAB), VOCAB))
    grammar = compile_schema({"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
    forced = vocabulary.forced(grammar, grammar.feed_bytes(START_STATE, b'{ "'))
    assert b"".join(vocabulary.pieces[t] for t in forced) == b'name"' and len(forced) == 2  # "name, then "
    assert vocabulary.forced(grammar, START_STATE) == [vocabulary.by_bytes[b"{"]]  # nothing may come before it
    assert vocabulary.forced(JSON_OBJECT, JSON_OBJECT.feed_bytes(START_STATE, b"{")) == []  # a space, a quote or }


def test_forced_drafts_are_verified_where_they_pay_and_change_nothing(byte_targets, monkeypatch):
    from test_control import FakeClock

    target = byte_targets["gemma3"]
    prompt_ids = target.encode_prompt(PROMPT)
    sampling = SamplingConfig(logit_bias=structure_bias(target))
    expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=60, grammar=compile_schema(LONG_KEYS))
    config = GenerationConfig(60, sampling=sampling, response_format="json_schema", json_schema=LONG_KEYS)
    proposer = RandomProposer(target.vocab_size, 7)
    clock = FakeClock()
    with monkeypatch.context() as patched:
        clock.install(patched, target, proposer)
        decoder = SpeculativeDecoder(target, proposer, timer=clock)
        results = [decoder.generate(prompt_ids, config) for _ in range(2)]  # the second knows the costs
    assert all(result.tokens == expected for result in results)
    assert results[1].stats.lookup_rounds >= 2  # the two keys' names: the proposer has no lookup of its own
    assert results[1].stats.num_rounds < len(expected) - 8


def test_a_batch_mixes_json_and_text_rows(byte_targets):
    """Rows with and without the grammar in one continuous batch each give what they give alone."""
    target = byte_targets["qwen3"]
    prompts = [target.encode_prompt(p) for p in (PROMPT, "Say hi.", "A JSON list of dogs, please.")]
    sampling = SamplingConfig(logit_bias=structure_bias(target))
    configs = [json_config(sampling), GenerationConfig(MAX_NEW, sampling=sampling),
               json_config(SamplingConfig(temperature=0.9, seed=3))]
    alone = [SpeculativeDecoder(target, NgramProposer(max_draft=7)).generate(p, c).tokens
             for p, c in zip(prompts, configs)]
    engine = Engine(target, NgramProposer(max_draft=7), max_batch=3)
    sequences = [engine.submit(p, c) for p, c in zip(prompts, configs)]
    engine.run()
    assert [seq.result.tokens for seq in sequences] == alone


def test_bad_settings_are_refused(byte_targets):
    target = byte_targets["llama"]
    decoder = SpeculativeDecoder(target)
    ids = target.encode_prompt(PROMPT)
    with pytest.raises(UserError, match="response_format must be one of"):
        decoder.generate(ids, GenerationConfig(8, response_format="yaml"))
    with pytest.raises(UserError, match="ignore_eos"):
        decoder.generate(ids, GenerationConfig(8, response_format="json_object", ignore_eos=True))


# ---- the CLI and the server ----------------------------------------------------------------------------------------
def test_the_server_answers_in_json_mode_and_by_schema(byte_targets):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.serving import BackgroundServer, create_app

    target = byte_targets["llama"]
    sampling = SamplingConfig(logit_bias=structure_bias(target))
    messages = [{"role": "user", "content": PROMPT}]
    reference = SpeculativeDecoder(target, NgramProposer(max_draft=7)).generate(
        target.encode_messages(messages), json_config(sampling, max_new=32))
    schema_reference = SpeculativeDecoder(target, NgramProposer(max_draft=7)).generate(
        target.encode_messages(messages), GenerationConfig(32, sampling=sampling, response_format="json_schema",
                                                           json_schema=SCHEMA))
    assert schema_reference.text != reference.text
    bias = {str(k): v for k, v in sampling.logit_bias.items()}
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny-json")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(**kwargs):
            return client.chat.completions.create(model="tiny-json", messages=messages, max_tokens=32, temperature=0,
                                                  logit_bias=bias, **kwargs)
        answer = ask(response_format={"type": "json_object"})
        assert answer.choices[0].message.content == reference.text and strict_object(reference.text)
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           ask(response_format={"type": "json_object"}, stream=True) if chunk.choices)
        assert streamed == reference.text
        assert ask(response_format={"type": "text"}).choices[0].message.content != reference.text
        structured = ask(response_format={"type": "json_schema",
                                          "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
        assert structured.choices[0].message.content == schema_reference.text
        loose = {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3},
                                                  "site": {"type": "string", "format": "uri", "maxLength": 2083}}}
        with pytest.raises(openai.BadRequestError, match="multipleOf cannot be enforced"):
            ask(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": loose, "strict": True}})
        # not strict (OpenAI's default, which enforces nothing): held as far as the grammar can, not refused
        held = ask(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": loose}})
        document = json.loads(held.choices[0].message.content)
        assert isinstance(document, dict) and set(document) <= {"a", "site"}
        assert all(isinstance(document[k], t) for k, t in (("a", int), ("site", str)) if k in document)
        with pytest.raises(openai.BadRequestError, match="must describe an object"):
            ask(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string"}}})
        with pytest.raises(openai.BadRequestError, match="needs its json_schema"):
            ask(response_format={"type": "json_schema"})


def test_the_server_says_when_the_tokenizer_cannot_do_json(tiny_targets):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.serving import BackgroundServer, create_app

    with BackgroundServer(create_app(tiny_targets["qwen3"], Proposer(), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError, match="byte-level BPE or SentencePiece"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], max_tokens=4,
                                           response_format={"type": "json_object"})
        answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                                max_tokens=4)
        assert answer.choices[0].message.content  # still serving


def test_generate_and_llm_take_the_response_format(capsys):
    from dflash.cli import main
    from dflash.llm import LLM

    target = tiny_target("qwen2", vocab_size=VOCAB, logit_scale=4.0, tokenizer="bytes")  # the CLI's tiny-qwen2-bytes
    expected = plain_constrained_loop(target, target.encode_prompt(PROMPT), SamplingConfig(), max_new=24)
    assert main(["generate", "--target", "tiny-qwen2-bytes", "--method", "ngram", "--max-new-tokens", "24",
                 "--response-format", "json_object", "--json", PROMPT]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == expected
    llm = LLM("tiny-qwen2-bytes", "ngram", device="cpu")
    assert llm.generate(PROMPT, max_new_tokens=24, response_format="json_object").tokens == expected
    with pytest.raises(UserError, match="response_format must be one of"):
        llm.generate(PROMPT, response_format="json")
    assert main(["generate", "--target", "tiny-qwen2", "--response-format", "json_object", "w1"]) == 2
    assert "byte-level BPE or SentencePiece" in capsys.readouterr().err


def test_generate_and_llm_take_a_json_schema(capsys, tmp_path):
    from dflash.cli import main
    from dflash.llm import LLM

    target = tiny_target("qwen2", vocab_size=VOCAB, logit_scale=4.0, tokenizer="bytes")
    expected = plain_constrained_loop(target, target.encode_prompt(PROMPT), SamplingConfig(), max_new=24,
                                      grammar=compile_schema(SCHEMA))
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    for given in (json.dumps(SCHEMA), str(tmp_path / "schema.json")):
        assert main(["generate", "--target", "tiny-qwen2-bytes", "--max-new-tokens", "24", "--json-schema", given,
                     "--json", PROMPT]) == 0
        assert json.loads(capsys.readouterr().out)["tokens"] == expected
    assert LLM("tiny-qwen2-bytes", "ngram", device="cpu").generate(PROMPT, 24, json_schema=SCHEMA).tokens == expected
    assert main(["generate", "--target", "tiny-qwen2-bytes", "--json-schema", "{not json", PROMPT]) == 2
    assert "--json-schema takes a JSON Schema file" in capsys.readouterr().err


def test_bench_constrains_every_method_alike(tmp_path, capsys, monkeypatch):
    from dflash.cli import main

    generations = []  # (prompt ids, config, tokens) of every generation the bench runs
    plain_generate = SpeculativeDecoder.generate

    def recorded(self, prompt_ids, config=None, on_tokens=None):
        result = plain_generate(self, prompt_ids, config, on_tokens)
        generations.append((list(prompt_ids), config, result.tokens))
        return result
    monkeypatch.setattr(SpeculativeDecoder, "generate", recorded)

    data = tmp_path / "set.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPT, "A JSON list of dogs, please.")))
    out = tmp_path / "out"
    argv = ["bench", "--target", "tiny-llama-bytes", "--device", "cpu", "--dataset", str(data), "--max-new-tokens",
            "24", "--out", str(out), "--no-progress", "--methods", "ar,ngram,dflash",
            "--json-schema", json.dumps(SCHEMA)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["greedy_mismatches"] == 0 and results["response_format"] == "json_schema"
    assert results["json_schema"] == SCHEMA and "--json-schema" in results["command"]
    target = tiny_target("llama", vocab_size=VOCAB, logit_scale=4.0, tokenizer="bytes")
    prompt_ids = target.encode_prompt(PROMPT)
    expected = plain_constrained_loop(target, prompt_ids, SamplingConfig(), max_new=24, grammar=compile_schema(SCHEMA))
    runs = [tokens for ids, config, tokens in generations if ids == prompt_ids and config.max_new_tokens == 24]
    assert len(runs) >= 3 and all(tokens == expected for tokens in runs)  # each method's timed runs
    assert all(config.json_schema == SCHEMA for _, config, _ in generations)  # warm-ups too
    for bad, fragment in ((["--methods", "ar,hf"], "hf cannot constrain"), (["--ignore-eos"], "--ignore-eos cannot")):
        assert main(argv[:-4] + ["--methods", "ar", "--json-schema", json.dumps(SCHEMA)] + bad) == 2
        assert fragment in capsys.readouterr().err


def test_batch_rows_carry_their_own_response_format(tmp_path, capsys):
    from dflash.cli import main

    target = tiny_target("qwen2", vocab_size=VOCAB, logit_scale=4.0, tokenizer="bytes")  # the CLI's tiny-qwen2-bytes
    rows = [{"id": "free", "prompt": PROMPT},
            {"id": "object", "prompt": PROMPT, "response_format": {"type": "json_object"}},
            {"id": "schema", "prompt": PROMPT, "response_format": {"type": "json_schema",
                                                                    "json_schema": {"name": "s", "schema": SCHEMA}}}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["batch", str(source), "--output", str(tmp_path / "out.jsonl"), "--target", "tiny-qwen2-bytes",
            "--max-new-tokens", "24", "--max-batch", "3", "--no-progress"]
    assert main(argv) == 0
    texts = {row["id"]: row["text"] for row in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    ids = target.encode_messages([{"role": "user", "content": PROMPT}])
    for rid, grammar in (("object", JSON_OBJECT), ("schema", compile_schema(SCHEMA))):
        expected = plain_constrained_loop(target, ids, SamplingConfig(), max_new=24, grammar=grammar)
        assert texts[rid] == target.tokenizer.decode(expected, skip_special_tokens=True), rid
    assert texts["free"] == SpeculativeDecoder(target).generate(ids, GenerationConfig(24)).text
    source.write_text(json.dumps({"prompt": PROMPT, "response_format": {"type": "json_schema", "json_schema": {
        "schema": {"type": "object", "properties": {"a": {"type": "string", "format": "hostname"}}}}}}) + "\n")
    assert main(argv[:3] + [str(tmp_path / "other.jsonl")] + argv[4:]) == 2
    assert "in.jsonl:1: #/properties/a: format 'hostname' cannot be enforced" in capsys.readouterr().err
