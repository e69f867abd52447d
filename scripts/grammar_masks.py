"""What structured output costs to set up and per grammar state: the vocabulary read as bytes (once per tokenizer),
then each state's mask (once per grammar and state), timed on the states a document's prefixes pass through.

Usage: .venv/bin/python scripts/grammar_masks.py [NAME ...]   (registry targets; default: smollm2-135m gemma3-270m,
those fetched here). Prints, per target: the vocabulary's size, the seconds to read it, and the median and largest
milliseconds of a new state's mask under JSON mode, under docs/data/session56/items_schema.json, and under a schema
of bounded numbers and sized strings (BOUNDED, its document BOUNDED_DOCUMENT), one of formats and patterns
(FORMATTED, FORMATTED_DOCUMENT), tool calls in the hermes format under tool_choice auto (words, then calls in
<tool_call> tags: HERMES_REPLY), the same after a reasoning model's thinking (THINKING_REPLY), dflash's json
format under tool_choice auto after a thinking (JSON_THOUGHT), and whole outputs
held to a regular expression (SENTENCE, PHONE) or a list of choices (LABELS), and to EBNF grammars (ebnf.py): any
JSON written as rules (EBNF_JSON, xgrammar's own example, on DOCUMENT) and arithmetic with left recursion
(ARITHMETIC); a custom tool's call whose input is SQL in a Lark grammar (SQL_CALL), and free text with calls between
structural tags (TAGGED_TEXT).
"""

import json
import statistics
import sys
import time
from pathlib import Path

from transformers import AutoTokenizer

from dflash.ebnf import RulesGrammar
from dflash.grammar import JSON_OBJECT, compile_schema
from dflash.hub import converted_dir
from dflash.regex_grammar import PatternGrammar, choice_expression
from dflash.structural_tags import structural_tag_format
from dflash.structured import JsonVocabulary, output_grammar, token_pieces
from dflash.tools import tool_request

SCHEMA = Path(__file__).resolve().parent.parent / "docs" / "data" / "session56" / "items_schema.json"
DOCUMENT = ('{"title": "Breakfast", "items": [{"name": "Oats", "details": "with milk, \\u00e9t\\u00e9", "amount": '
            '1.5e2}, {"name": "Tea", "details": "green"}], "confidence": "high"}')

BOUNDED = {"type": "object", "properties": {
    "title": {"type": "string", "minLength": 3, "maxLength": 40}, "stars": {"type": "integer", "minimum": 1,
                                                                        "maximum": 5},
    "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000}, "year": {"type": "integer", "minimum": 1900,
                                                                                  "maximum": 2100}},
    "required": ["title", "stars", "price", "year"]}
FORMATTED = {"type": "object", "properties": {
    "id": {"type": "string", "format": "uuid"}, "day": {"type": "string", "format": "date"},
    "starts": {"type": "string", "format": "date-time"}, "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
    "tag": {"type": "string", "pattern": "x", "maxLength": 4}}, "required": ["id", "day", "starts", "code", "tag"]}
FORMATTED_DOCUMENT = ('{"id": "123e4567-e89b-12d3-a456-426614174000", "day": "2024-02-28", "starts": '
                      '"2024-01-05T10:20:30Z", "code": "AB-123", "tag": "abxy"}')
BOUNDED_DOCUMENT = '{"title": "A quiet place to read, \u00e9t\u00e9", "stars": 4, "price": 129.95, "year": 2024}'
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"]}}}, {"type": "function", "function": {"name": "get_time"}}]
CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
HERMES_REPLY = "Let me look that up <b>now</b>.\n" + CALLS
THINKING_REPLY = "<think>\nThe user wants the weather; <tool_call> comes next.\n</think>\n\n" + CALLS
JSON_THOUGHT = ('<think>\nThe weather, then the time.\n</think>\n\n[{"name": "get_weather", "arguments": {"city": '
                '"Paris", "days": 3}}, {"name": "get_time", "arguments": {}}]')
# a whole output held to a regular expression or a list of choices (regex_grammar.py)
SENTENCE, SENTENCE_TEXT = r"[A-Z][a-z]*( [a-z]+){2,12}\.", "The quick brown fox jumps over the lazy dog."
PHONE, PHONE_TEXT = r"\(\d{3}\) \d{3}-\d{4}", "(555) 123-4567"
LABELS, LABEL = ["positive", "negative", "neutral", "mixed feelings"], "mixed feelings"
# whole outputs held to EBNF grammars (ebnf.py)
EBNF_JSON = r"""root ::= basic_array | basic_object
basic_any ::= basic_number | basic_string | basic_boolean | basic_null | basic_array | basic_object
basic_number ::= ("0" | "-"? [1-9] [0-9]*) ("." [0-9]+)? ([eE] [+-]? [0-9]+)?
basic_string ::= "\"" basic_string_1 "\""
basic_string_1 ::= "" | [^"\\\x00-\x1F] basic_string_1 | "\\" escape basic_string_1
escape ::= ["\\/bfnrt] | "u" [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9] [A-Fa-f0-9]
basic_boolean ::= "true" | "false"
basic_null ::= "null"
basic_array ::= "[" ("" | ws basic_any (ws "," ws basic_any)*) ws "]"
basic_object ::= "{" ("" | ws basic_string ws ":" ws basic_any ( ws "," ws basic_string ws ":" ws basic_any)*) ws "}"
ws ::= [ \n\t]*"""
ARITHMETIC = ('root ::= expr (" "? "=" " "? expr)*\nexpr ::= expr " "? [-+*/] " "? term | term\n'
              'term ::= num | "(" expr ")"\nnum ::= [0-9]+')
ARITHMETIC_TEXT = "(12 * 3) + (4 - (5 / 6)) = 38"
# a custom tool's input in a Lark grammar (tools.py), and calls between structural tags (structural_tags.py)
SQL_TOOL = {"type": "custom", "custom": {"name": "run_sql", "format": {"type": "grammar", "grammar": {
    "syntax": "lark", "definition": 'start: "SELECT " NAME ("," " "? NAME)* " FROM " NAME (" WHERE " NAME " = " '
                                    'VALUE)? ";"\nNAME: /[a-z_]+/\nVALUE: /[0-9]+/ | /\'[^\']*\'/'}}}}
SQL_CALL = '[{"name": "run_sql", "arguments": {"input": "SELECT name, city FROM users WHERE city = \'Paris\';"}}]'
TAG = {"structures": [{"begin": f"<function={name}>", "schema": {"type": "object", "properties": {
    key: {"type": "string"}}, "required": [key]}, "end": "</function>"} for name, key in (("get_weather", "city"),
                                                                                       ("get_time", "zone"))],
       "triggers": ["<function="]}
TAGGED_TEXT = ('Let me check both. <function=get_weather>{"city": "Rome"}</function> and <function=get_time>'
               '{"zone": "Europe/Berlin"}</function> Done.')


def mask_times(vocabulary: JsonVocabulary, grammar, document: str = DOCUMENT) -> list[float]:
    """Milliseconds of each distinct state's first mask along `document`'s prefixes."""
    times, state = [], grammar.initial
    for byte in document.encode():
        if (grammar.key, state) not in vocabulary.masks:
            started = time.perf_counter()
            vocabulary.allowed(grammar, state)
            times.append(1000 * (time.perf_counter() - started))
        state = grammar.feed(state, byte)
    return times


def hermes_calls(thinking: str | None):
    """The grammar of a reply that may call WEATHER's functions in <tool_call> tags (tool_choice auto)."""
    return output_grammar(*tool_request(WEATHER, style="hermes").output_format(), thinking)


def json_calls(thinking: str | None):
    """The grammar of a reply that may call WEATHER's functions in dflash's json format (tool_choice auto)."""
    return output_grammar(*tool_request(WEATHER, style="json").output_format(), thinking)


def main() -> None:
    for name in sys.argv[1:] or ["smollm2-135m", "gemma3-270m"]:
        folder = converted_dir(name)
        if not folder.exists():
            print(f"{name}: not fetched here (dflash fetch {name})")
            continue
        tokenizer = AutoTokenizer.from_pretrained(folder)
        started = time.perf_counter()
        vocabulary = JsonVocabulary(token_pieces(tokenizer, len(tokenizer)))
        read = time.perf_counter() - started
        line = f"{name}: {vocabulary.size} tokens read as bytes in {read:.2f} s"
        for label, grammar, document in (("JSON mode", JSON_OBJECT, DOCUMENT),
                                         ("schema", compile_schema(json.loads(SCHEMA.read_text())), DOCUMENT),
                                         ("bounded", compile_schema(BOUNDED), BOUNDED_DOCUMENT),
                                         ("formats", compile_schema(FORMATTED), FORMATTED_DOCUMENT),
                                         ("hermes calls", hermes_calls(None), HERMES_REPLY),
                                         ("thinking, then calls", hermes_calls("optional"), THINKING_REPLY),
                                         ("thinking, then json calls (auto)", json_calls("optional"), JSON_THOUGHT),
                                         ("regex (sentence)", PatternGrammar(SENTENCE), SENTENCE_TEXT),
                                         ("regex (phone)", PatternGrammar(PHONE), PHONE_TEXT),
                                         ("choice", PatternGrammar(choice_expression(LABELS)), LABEL),
                                         ("EBNF (JSON as rules)", RulesGrammar(EBNF_JSON), DOCUMENT),
                                         ("EBNF (arithmetic)", RulesGrammar(ARITHMETIC), ARITHMETIC_TEXT),
                                         ("a custom tool's SQL (required)", output_grammar(
                                             *tool_request([SQL_TOOL], "required").output_format()), SQL_CALL),
                                         ("structural tags", output_grammar(*structural_tag_format(TAG)),
                                          TAGGED_TEXT)):
            times = mask_times(vocabulary, grammar, document)
            line += (f"; {label}: {len(times)} states, a new state's mask {statistics.median(times):.1f} ms median, "
                     f"{max(times):.1f} ms at most")
        print(line)


if __name__ == "__main__":
    main()
