"""Custom tools (OpenAI's `{"type": "custom"}`: one text as input, free or held to a Lark grammar or a regex) and
`allowed_tools`: a JSON string held to a grammar (x-grammar) against a reference recogniser, the checks of the tools
and choices, the input read back (whole and as a stream shows it), the conversation the target sees, constrained
decoding against the plain constrained loop for every proposer, and the server's chat and Responses calls, whole
and streamed."""

import json
import random
import re

import pytest
import torch

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.grammar import compile_schema, complete, enforceable
from dflash.sampling import SamplingConfig
from dflash.structured import output_grammar
from dflash.tools import conversation, encode_chat, input_so_far, tool_request
from test_structured import assert_masks_are_fed, plain_constrained_loop, proposers
from test_tools import HI, PROMPT, QUESTION, SHORT_TOOLS, call_bias

SUM = 'start: NUM ("+" NUM)*\nNUM: /[0-9]+/'  # Lark
SUM_RE = r"[0-9]+(\+[0-9]+)*"  # the same language
ITEMS = 'start: ITEM ("," ITEM)*\nITEM: /[^,]+/'  # any character but commas: quotes, backslashes, newlines, emoji
ITEMS_RE = r"[^,]+(,[^,]+)*"


def lark(name: str, definition: str, description: str = "") -> dict:
    return {"type": "custom", "custom": {"name": name, "description": description, "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition": definition}}}}


CALC = lark("calc", SUM, "Adds numbers.")
DIGITS = {"type": "custom", "custom": {"name": "digits", "format": {
    "type": "grammar", "grammar": {"syntax": "regex", "definition": "^[0-9]{2,4}$"}}}}
NOTE = {"type": "custom", "custom": {"name": "note"}}  # free text
CUSTOM_TOOLS = [CALC, DIGITS, NOTE]
CLOCK = SHORT_TOOLS[1]  # a function without parameters
# the server's: most of its input forced (drafted free, so it streams in several pieces), quotes JSON escapes
QUERY = lark("sql", 'start: "SELECT \\"a\\" FROM t WHERE id = " /[0-9]/')
QUERY_RE = r'SELECT "a" FROM t WHERE id = [0-9]'


def input_schema(**string) -> dict:
    return {"type": "object", "properties": {"input": {"type": "string", **string}}, "required": ["input"]}


def accepts(grammar, text: str) -> bool:
    return complete(grammar.feed_bytes(grammar.initial, text.encode()))


# ---- a string held to a grammar ------------------------------------------------------------------------------------
@pytest.mark.parametrize("definition, reference, example", [(SUM, SUM_RE, "12+3"), (ITEMS, ITEMS_RE, 'a"b\n,c😀')])
def test_a_string_in_a_grammar_takes_what_the_grammar_matches_however_json_escapes_it(definition, reference, example):
    grammar = compile_schema(input_schema(**{"x-grammar": definition}))
    rng = random.Random(0)
    alphabet = ["1", "2", "0", "+", ",", "a", '"', "\\", "\n", "\t", "é", "😀", "/", " "]
    matched = 0
    for _ in range(400):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))
        expected = re.fullmatch(reference, text) is not None
        matched += expected
        for ascii_only in (True, False):  # \u escapes or the characters themselves
            document = json.dumps({"input": text}, ensure_ascii=ascii_only)
            # a held string takes characters past the first plane as UTF-8, not as surrogate pairs (grammar.py)
            paired = ascii_only and any(ord(c) > 0xFFFF for c in text)
            assert accepts(grammar, document) == (expected and not paired), document
    assert matched > 10
    assert_masks_are_fed(grammar, [json.dumps({"input": example}, ensure_ascii=False).encode(),
                                   json.dumps({"input": example.replace("😀", "")}).encode()])


def test_a_held_strings_plain_characters_go_through_a_table_that_feeding_agrees_with():
    from dflash.structured import JsonVocabulary, token_pieces
    from dflash.testing import tiny_byte_tokenizer

    grammar = compile_schema(input_schema(**{"x-grammar": ITEMS}))
    state = grammar.feed_bytes(grammar.initial, b'{"input": "a')
    table, row = grammar.held_table(state)
    assert table[row, ord(",")] != 0 and table[row, ord('"')] == 0 and table[row, ord("\\")] == 0  # spelt escaped
    bounded = compile_schema(input_schema(pattern="^a+$", maxLength=3))
    assert bounded.held_table(bounded.feed_bytes(bounded.initial, b'{"input": "a')) is None  # counted: walked
    vocabulary = JsonVocabulary(token_pieces(tiny_byte_tokenizer(320), 320))
    for text in (b'{"input": "a', b'{"input": "a,b', b'{"input": "'):
        held = grammar.feed_bytes(grammar.initial, text)
        fed = torch.tensor([grammar.feed_bytes(held, piece or b"\xff") is not None for piece in vocabulary.pieces])
        assert torch.equal(vocabulary.allowed(grammar, held), fed), text
    assert vocabulary.plain_split is not None  # the table was taken


def test_a_grammar_beside_other_string_keywords_is_refused_and_a_loose_schema_drops_a_bad_one():
    for extra, fragment in [({"pattern": "a"}, "both a pattern and a x-grammar"),
                            ({"maxLength": 3}, "maxLength beside an x-grammar"),
                            ({"minLength": 1}, "minLength beside a x-grammar"),
                            ({}, "can never finish")]:
        grammar = SUM if extra else "start: start"
        with pytest.raises(UserError, match=re.escape(fragment)):
            compile_schema(input_schema(**{"x-grammar": grammar}, **extra))
    assert enforceable(input_schema(**{"x-grammar": SUM})) == input_schema(**{"x-grammar": SUM})
    assert enforceable(input_schema(**{"x-grammar": "start: start"})) == input_schema()


# ---- the tools and the choices -------------------------------------------------------------------------------------
def test_custom_tools_take_text_lark_or_a_regex_in_either_apis_layout():
    request = tool_request(CUSTOM_TOOLS + SHORT_TOOLS[:1])
    assert [(t.name, t.kind) for t in request.tools] == [("calc", "custom"), ("digits", "custom"),
                                                         ("note", "custom"), ("weather", "function")]
    calc, digits, note, _ = request.tools
    assert calc.enforced["properties"]["input"] == {"type": "string", "x-grammar": SUM}
    assert "Lark grammar" in calc.parameters["properties"]["input"]["description"]
    assert digits.enforced["properties"]["input"] == {"type": "string", "pattern": "^(?:[0-9]{2,4})$"}
    assert note.enforced["properties"]["input"] == {"type": "string"}
    responses_layout = {"type": "custom", "custom": {"name": "calc", "format": {
        "type": "grammar", "syntax": "lark", "definition": SUM}}}
    assert tool_request([responses_layout]).tools[0].enforced == calc.enforced
    assert "calc: Adds numbers." in request.instructions()


@pytest.mark.parametrize("tools, choice, fragment", [
    ([lark("x", "start: start")], None, "tools[0].custom.format (x): the grammar's rule(s) start can never finish"),
    ([{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "(("}}}}], None, "tools[0].custom.format (x): pattern '(('"),
    ([{"type": "custom", "custom": {"name": "x", "format": {"type": "grammar", "grammar": {
        "syntax": "ebnf", "definition": "root ::= \"a\""}}}}], None, '"syntax": "lark" or "regex"'),
    ([{"type": "custom", "custom": {"name": "a b"}}], None, "custom.name must be 1-64 letters"),
    ([{"type": "custom", "name": "x"}], None, "the kinds of tools a server runs"),
    ([NOTE, {"type": "function", "function": {"name": "note"}}], None, "name a tool twice: note"),
    ([NOTE] + SHORT_TOOLS, {"type": "function", "function": {"name": "note"}},
     "must name one of the function tools (weather, clock), got 'note'"),
    ([NOTE] + SHORT_TOOLS, {"type": "custom", "custom": {"name": "clock"}},
     "must name one of the custom tools (note), got 'clock'"),
    ([NOTE], {"type": "allowed_tools", "allowed_tools": {"mode": "none", "tools": []}}, "allowed_tools must be"),
    ([NOTE], {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": ["note"]}}, "list tools as objects"),
    ([NOTE], {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "custom", "custom": {"name": "nope"}}]}}, "must name one of the custom tools (note)"),
])
def test_bad_custom_tools_and_choices_are_refused_in_one_line(tools, choice, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        tool_request(tools, choice)


def test_allowed_tools_keep_every_tool_in_the_prompt_and_let_the_reply_call_only_them():
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "custom", "custom": {"name": "digits"}}, {"type": "function", "function": {"name": "clock"}}]}}
    request = tool_request(CUSTOM_TOOLS + SHORT_TOOLS, allowed)
    assert request.choice == "required" and request.allowed == ("digits", "clock")
    assert [t.name for t in request.offered()] == ["digits", "clock"]
    assert all(f"- {name}:" in request.instructions() for name in ("calc", "digits", "note", "weather", "clock"))
    fmt, schema = request.output_format()
    grammar = compile_schema(schema, text_otherwise=fmt == "json_schema_or_text")
    assert fmt == "json_schema"
    assert accepts(grammar, '[{"name": "digits", "arguments": {"input": "123"}}, {"name": "clock", "arguments": {}}]')
    for refused in ('[{"name": "calc", "arguments": {"input": "1"}}]', '[{"name": "digits", "arguments": {"input": '
                    '"1"}}]', '[{"name": "weather", "arguments": {"city": "x"}}]', "Hello"):
        assert not accepts(grammar, refused), refused
    auto = tool_request(CUSTOM_TOOLS, {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "custom", "custom": {"name": "note"}}]}})
    fmt, schema = auto.output_format()
    words = compile_schema(schema, text_otherwise=True)
    assert fmt == "json_schema_or_text" and words.feed_bytes(words.initial, b"Hello") is not None


def test_calls_come_back_as_custom_calls_and_a_stream_shows_settled_input():
    request = tool_request(CUSTOM_TOOLS + SHORT_TOOLS)
    text = '[{"name": "calc", "arguments": {"input": "1+2"}}, {"name": "clock", "arguments": {}}]'
    calc, clock = request.calls(text)
    assert calc["type"] == "custom" and calc["custom"] == {"name": "calc", "input": "1+2"}
    assert clock["type"] == "function" and clock["function"] == {"name": "clock", "arguments": "{}"}
    assert request.calls('[{"name": "calc", "arguments": {"text": "1"}}]') is None  # not the tool's input
    whole = '{"input": "a\\"b\\\\c\\n\\u00e9\\ud83d\\ude00"}'
    assert input_so_far(whole) == json.loads(whole)["input"]
    shown = [input_so_far(whole[:n]) for n in range(len(whole) + 1)]
    assert all(json.loads(whole)["input"].startswith(s) for s in shown)  # never a character that is not settled
    assert len(set(shown)) == 1 + 8  # nothing, then each of its 8 characters once its escape is whole
    assert input_so_far('{"input": "a\\u00') == "a" and input_so_far('{"input": "a\\ud83d') == "a"
    assert input_so_far('{"input": "ab\\') == "ab" and input_so_far('{"inp') == ""


def test_earlier_custom_calls_show_as_the_reply_format_writes_them():
    request = tool_request(CUSTOM_TOOLS)
    history = QUESTION + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "custom", "custom": {"name": "calc", "input": "1+2"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    turns = conversation(history, request)
    assert turns[2] == {"role": "assistant", "content": '[{"name": "calc", "arguments": {"input": "1+2"}}]'}
    assert turns[3] == {"role": "user", "content": "calc returned: 3"}


# ---- generation ----------------------------------------------------------------------------------------------------
def every_proposer_writes_the_plain_loops_calls(target, prompt_ids, request, max_new: int):
    """Greedy calls (pushed to finish) under the request's grammar: every proposer's tokens the plain constrained
    loop's; the last result."""
    fmt, schema = request.output_format()
    sampling = SamplingConfig(logit_bias=call_bias(target, None))
    expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=max_new,
                                      grammar=output_grammar(fmt, schema))
    config = GenerationConfig(max_new, sampling=sampling, response_format=fmt, json_schema=schema)
    for name, proposer in proposers(target, expected, len(prompt_ids)).items():
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
        assert result.tokens == expected, name
    assert result.finish_reason == "stop", result.text
    return result


@pytest.mark.parametrize("choice", [{"type": "custom", "custom": {"name": "calc"}}, "required"])
def test_custom_calls_are_the_plain_loops_for_every_proposer(byte_targets, choice):
    target = byte_targets["llama"]
    request = tool_request([CALC, DIGITS], choice)
    result = every_proposer_writes_the_plain_loops_calls(target, target.encode_prompt(PROMPT), request, 60)
    calls = request.calls(result.text)
    assert calls and all(c["type"] == "custom" for c in calls)
    for call in calls:
        reference = SUM_RE if call["custom"]["name"] == "calc" else "[0-9]{2,4}"
        assert re.fullmatch(reference, call["custom"]["input"]), call


# ---- the server ----------------------------------------------------------------------------------------------------
def test_the_server_writes_custom_calls_in_chat_and_responses_whole_and_streamed(byte_targets):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.methods.ngram import NgramProposer
    from dflash.serving import BackgroundServer, create_app
    from test_responses import deltas, streamed

    target = byte_targets["llama"]
    bias = {str(k): v for k, v in call_bias(target, None).items()}
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        ask = dict(model="tiny", messages=HI, max_tokens=120, temperature=0, logit_bias=bias,
                   tools=[QUERY], tool_choice={"type": "custom", "custom": {"name": "sql"}})
        answer = client.chat.completions.create(**ask).choices[0]
        assert answer.finish_reason == "tool_calls"
        (call,) = answer.message.tool_calls
        assert call.type == "custom" and call.custom.name == "sql" and re.fullmatch(QUERY_RE, call.custom.input)
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask) if c.choices]
        pieces = [d.model_extra["custom"] for c in chunks for d in c.delta.tool_calls or []]
        assert pieces[0] == {"name": "sql", "input": ""} and chunks[-1].finish_reason == "tool_calls"
        assert "".join(p["input"] for p in pieces) == call.custom.input and len(pieces) > 2
        # the Responses API: a custom_tool_call item, its input streamed as its own events
        flat = {"type": "custom", **QUERY["custom"]}
        flat["format"] = {"type": "grammar", **QUERY["custom"]["format"]["grammar"]}
        asked = dict(input="Hi?", tools=[flat], tool_choice={"type": "custom", "name": "sql"},
                     max_output_tokens=120, temperature=0, extra_body={"logit_bias": bias})
        response = client.responses.create(model="tiny", **asked)
        (item,) = response.output
        assert item.type == "custom_tool_call" and (item.name, item.input) == ("sql", call.custom.input)
        events, final = streamed(client, **asked)
        assert [(i.type, i.input) for i in final.output] == [("custom_tool_call", item.input)]
        assert deltas(events, "response.custom_tool_call_input.delta") == item.input
        assert len([e for e in events if e.type == "response.custom_tool_call_input.delta"]) > 2
        assert [e.input for e in events if e.type == "response.custom_tool_call_input.done"] == [item.input]
        # the call and its output sent back: the conversation chat sees with a custom call and a tool turn
        items = [{"role": "user", "content": "Hi?"},
                 {"type": "custom_tool_call", "call_id": "c1", "name": "sql", "input": "SELECT 1"},
                 {"type": "custom_tool_call_output", "call_id": "c1", "output": "3"}]
        history = HI + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "custom", "custom": {"name": "sql", "input": "SELECT 1"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"}]
        after = client.responses.create(model="tiny", input=items, tools=[flat], max_output_tokens=8, temperature=0)
        expected = client.chat.completions.create(model="tiny", messages=history, tools=[QUERY], max_tokens=8,
                                                  temperature=0)
        assert after.usage.input_tokens == expected.usage.prompt_tokens
        assert after.output_text == (expected.choices[0].message.content or "")
        later = client.responses.create(model="tiny", input="And?", previous_response_id=response.id, tools=[flat],
                                        max_output_tokens=4, temperature=0)
        assert later.status in ("completed", "incomplete")
        allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "clock"}]}
        note_and_clock = [{"type": "custom", "name": "note"}, {"type": "function", "name": "clock"}]
        only_clock = client.responses.create(model="tiny", input="Hi?", tools=note_and_clock, tool_choice=allowed,
                                             max_output_tokens=60, temperature=0, parallel_tool_calls=False,
                                             extra_body={"logit_bias": bias})
        assert [(i.type, i.name) for i in only_clock.output] == [("function_call", "clock")]
        with pytest.raises(openai.BadRequestError, match="must name one of the custom tools"):
            client.chat.completions.create(**{**ask, "tool_choice": {"type": "custom", "custom": {"name": "clock"}}})


def test_the_hermes_template_shows_a_custom_tool_as_a_function_of_one_text(hermes_targets):
    target = hermes_targets["llama"]
    request = tool_request([QUERY], "required", parallel_tool_calls=False, style="hermes")
    prompt_ids = encode_chat(target, HI, request)
    assert "tools: sql" in target.decode(prompt_ids)  # the tiny template names the tools it is given
    result = every_proposer_writes_the_plain_loops_calls(target, prompt_ids, request, 100)
    calls = request.calls(result.text)
    assert calls and calls[0]["custom"]["name"] == "sql", result.text
    assert re.fullmatch(QUERY_RE, calls[0]["custom"]["input"])


def test_generate_and_llm_call_custom_tools(capsys, monkeypatch, tmp_path):
    import dflash.generate as generate
    from dflash.cli import main
    from dflash.testing import tiny_target
    from test_tools import push_calls, pushed_llm

    target = tiny_target("qwen2", vocab_size=320, logit_scale=4.0, tokenizer="bytes")  # the CLI's tiny-qwen2-bytes
    push_calls(monkeypatch, generate, target)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([NOTE, CLOCK]))
    argv = ["generate", "--target", "tiny-qwen2-bytes", "--method", "ngram", "--max-new-tokens", "60", "--json",
            "--tools", str(tools), "--tool-choice", "note", "Hi?"]
    assert main(argv) == 0
    (call,) = json.loads(capsys.readouterr().out)["tool_calls"]
    assert call["type"] == "custom" and call["custom"]["name"] == "note" and isinstance(call["custom"]["input"], str)
    result = pushed_llm(monkeypatch).chat(HI, tools=[QUERY], tool_choice={"type": "custom", "custom": {"name": "sql"}},
                      max_new_tokens=100)
    (call,) = result.tool_calls
    assert call["type"] == "custom" and re.fullmatch(QUERY_RE, call["custom"]["input"])
