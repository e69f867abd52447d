"""Tool calling: tagged unions and free-text-or-document grammars, the checks of OpenAI's tools and tool_choice, the
conversation the chat template sees, constrained decoding of calls against a plain constrained loop for every
proposer, and the server's tool_calls (whole and streamed)."""

import json
import random
import re

import pytest

from conftest import ARCHS
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.grammar import DONE, START_STATE, TEXT, compile_schema, complete
from dflash.methods.base import Proposer
from dflash.methods.ngram import NgramProposer
from dflash.sampling import SamplingConfig
from dflash.loading import load_target_cached
from dflash.structured import output_grammar
from dflash.tools import conversation, encode_chat, tool_request, tool_style
from test_structured import assert_masks_are_fed, plain_constrained_loop, proposers, random_document

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: {} only
TOOLS = [WEATHER, CLOCK]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# the server's: a short conversation and short tools, which leave room for a reply in a tiny target's context of 512
SHORT_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "clock"}}]
HI = [{"role": "user", "content": "Hi?"}]
PROMPT = "Call a tool."  # the engine's tests: a prompt that leaves room in a tiny target's context of 512


def discriminated_home():
    """A pydantic model with a discriminated union (its tag the first field of each alternative) in a list, and a
    plain union of the same models."""
    from typing import Annotated, Literal, Union

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog", "puppy"]
        good: bool

    class Home(BaseModel):
        pets: list[Annotated[Union[Cat, Dog], Field(discriminator="kind")]]
        best: Union[Cat, Dog]

    return Home


# ---- the grammar ---------------------------------------------------------------------------------------------------
def test_objects_told_apart_by_their_first_property_are_one_tagged_union():
    home = discriminated_home()
    grammar = compile_schema(home.model_json_schema())
    good = ['{"pets": [{"kind": "cat", "lives": 9}, {"kind": "puppy", "good": true}], "best": {"kind": "dog", '
            '"good": false}}', '{"pets": [], "best": {"kind": "cat", "lives": 1}}']
    bad = ['{"pets": [{"kind": "cat", "good": true}], "best": {"kind": "cat", "lives": 1}}',  # the dog's field
           '{"pets": [], "best": {"lives": 1}}',  # the tag is required and comes first
           '{"pets": [], "best": {"kind": "cow", "lives": 1}}', '{"pets": [], "best": {}}']
    for document in good:
        assert complete(grammar.feed_bytes(START_STATE, document.encode())), document
        home.model_validate_json(document, strict=True)
    for document in bad:
        assert not complete(grammar.feed_bytes(START_STATE, document.encode())), document
    rng = random.Random(3)
    for _ in range(200):  # whatever it lets through validates
        home.model_validate_json(random_document(grammar, rng), strict=True)


@pytest.mark.parametrize("options", [
    [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "object", "properties": {"b": {}}}],
    [{"type": "object", "properties": {"k": {"const": 1}}, "required": ["k"]},
     {"type": "object", "properties": {"k": {"const": 1}, "b": {}}, "required": ["k"]}],  # the same tag twice
    [{"type": "object", "properties": {"k": {"const": 1}}},  # an optional tag may be left out
     {"type": "object", "properties": {"k": {"const": 2}}, "required": ["k"]}],
])
def test_objects_that_nothing_tells_apart_are_still_refused(options):
    with pytest.raises(UserError, match="start alike"):
        compile_schema({"type": "object", "properties": {"x": {"anyOf": options}}})


def test_a_grammar_with_free_text_otherwise_takes_text_or_a_whole_document():
    _, schema = tool_request(TOOLS).output_format()
    grammar = compile_schema(schema, text_otherwise=True)
    assert grammar.may_end(START_STATE)  # an empty reply
    for text in ["Hello [not a call", " [1]", "Sure! {"]:
        state = grammar.feed_bytes(START_STATE, text.encode())
        assert state[0] == TEXT and grammar.may_end(state), text
    for call in ['[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
                 '{"name": "get_time", "arguments": {}}']:
        data = call.encode()
        assert all(not grammar.may_end(grammar.feed_bytes(START_STATE, data[:n])) for n in range(1, len(data)))
        assert grammar.feed_bytes(START_STATE, data)[0] == DONE
    for wrong in ['[{"name": "get_time", "arguments": {"city": "x"}}]', '[]', '[{"name": "other"', '{"city": 1}',
                  '[{"name": "get_weather", "arguments": {"days": 2}}]']:  # city is required
        assert not complete(grammar.feed_bytes(START_STATE, wrong.encode())), wrong


def test_masks_of_calls_and_of_free_text_first_are_every_token_fed():
    """The first mask under `auto` (every token but the broken openings of a call, found apart) and those along
    calls, against feeding each token's bytes."""
    _, schema = tool_request(TOOLS).output_format()
    calls = [b'[{"name": "get_time", "arguments": {}}]', b'{"name": "get_weather", "arguments": {"city": "P"}}']
    assert assert_masks_are_fed(compile_schema(schema, text_otherwise=True), calls) > 40
    assert assert_masks_are_fed(compile_schema(schema), calls) > 40
    strings = compile_schema({"type": "array", "items": {"type": "string"}}, text_otherwise=True)
    assert assert_masks_are_fed(strings, [b'["a", "b"]']) > 5  # `[{` opens no array of strings: refused first


# ---- tools and tool_choice -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tools, choice, fragment", [
    ([{"type": "retrieval"}], None, "the kinds of tools a server runs"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "letters, digits"),
    ([CLOCK, CLOCK], None, "name a tool twice: get_time"),
    ([{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object", "properties": {
        "e": {"type": "string", "format": "hostname"}}}}}], None,
     "tools[0].function.parameters (f, strict): #/properties/e: format 'hostname'"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "must describe an object"),
    (TOOLS, "sometimes", "tool_choice must be one of none, auto, required"),
    (TOOLS, {"type": "function", "function": {"name": "get_date"}},
     "must name one of the function tools (get_weather, get_time)"),
    (None, "required", "tool_choice needs tools"),
])
def test_bad_tools_and_choices_are_refused_in_one_line(tools, choice, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        tool_request(tools, choice)


def test_loose_tools_hold_what_a_grammar_can_and_drop_the_rest():
    """A tool that is not strict (as agents' and MCP servers' schemas are, with formats, $schema, uniqueItems, ...)
    is not refused: the calls' grammar drops what it cannot enforce, opens up what it cannot tell apart, and holds
    the rest (types, enums, required keys); its schema goes to the template as given. Strict, it is refused."""
    parameters = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "properties": {
        "url": {"type": "string", "format": "uri"}, "mode": {"type": "string", "enum": ["a", "b"]},
        "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "either": {"anyOf": [{"type": "string"}, {"type": "string", "pattern": "^x"}]},
        "code": {"type": "string", "pattern": "^(?!x)"}}, "required": ["url", "undefined"],
        "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "fetch", "parameters": parameters}}]
    request = tool_request(tools, "required", False, "json")
    assert request.tools[0].parameters == parameters  # what the template shows
    grammar = output_grammar(*request.output_format())

    def call(arguments: dict) -> bool:
        return complete(grammar.feed_bytes(grammar.initial, json.dumps(
            [{"name": "fetch", "arguments": arguments}]).encode()))

    assert call({"url": "not a uri at all", "mode": "a", "tags": ["x", "x"], "either": [1], "code": "xyz"})
    assert not call({"url": "u", "mode": "c"})  # the enum holds
    assert not call({"mode": "a"})  # url is still required
    assert not call({"url": 3})  # and a string
    assert not call({"url": "u", "other": 1})  # no other keys
    with pytest.raises(UserError, match=re.escape("(fetch, strict): #: required names properties it does not")):
        tool_request([{"type": "function", "function": {"name": "fetch", "strict": True, "parameters": parameters}}])


def test_the_reply_grammar_follows_the_choice():
    assert tool_request(None) is None and tool_request(TOOLS, "none") is None
    calls = '[{"name": "get_weather", "arguments": {"city": "P"}}, {"name": "get_time", "arguments": {}}]'
    one_clock = '[{"name": "get_time", "arguments": {}}]'
    expectations = {  # choice, parallel -> (the two calls, one call of get_time, words)
        ("required", True): (True, True, False), ("required", False): (False, True, False),
        ("auto", True): (True, True, True), ("get_time", True): (False, True, False),
    }
    for (choice, parallel), allowed in expectations.items():
        named = {"type": "function", "function": {"name": choice}} if choice == "get_time" else choice
        request = tool_request(TOOLS, named, parallel)
        fmt, schema = request.output_format()
        grammar = compile_schema(schema, text_otherwise=fmt == "json_schema_or_text")
        for text, ok in zip((calls, one_clock, "It is sunny."), allowed):
            state = grammar.feed_bytes(START_STATE, text.encode())
            assert (state is not None and grammar.may_end(state)) == ok, (choice, parallel, text)
        assert request.calls("It is sunny.") is None and request.calls(calls[:-5]) is None
        read = request.calls(calls)
        assert [c["function"]["name"] for c in read] == ["get_weather", "get_time"]
        assert json.loads(read[0]["function"]["arguments"]) == {"city": "P"} and read[0]["id"] != read[1]["id"]
    instructions = tool_request(TOOLS).instructions()
    assert "get_weather: The weather in a city." in instructions and '"required": ["city"]' in instructions


def test_the_conversation_shows_calls_and_results_in_the_reply_format():
    request = tool_request(TOOLS)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    clock = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    messages = [{"role": "system", "content": "Be brief."}, *QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [call, clock]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
                {"role": "tool", "tool_call_id": "call_2", "content": "noon"}]
    turns = conversation(messages, request)
    assert turns[0] == {"role": "system", "content": "Be brief.\n\n" + request.instructions()}
    assert turns[1:] == [QUESTION[0], {"role": "assistant", "content": '[{"name": "get_weather", "arguments": '
                                       '{"city": "Paris"}}, {"name": "get_time", "arguments": {}}]'},
                         {"role": "user", "content": "get_weather returned: 18C\nget_time returned: noon"}]
    assert conversation(QUESTION, request)[0] == {"role": "system", "content": request.instructions()}
    assert conversation(QUESTION, None) == QUESTION
    with pytest.raises(UserError, match="arguments is not JSON"):
        conversation([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}], None)


# ---- generation ----------------------------------------------------------------------------------------------------
def call_bias(target, opening: str | None) -> dict[int, float]:
    """Pushes a random model to finish its calls quickly (quotes, commas, closing brackets, no whitespace);
    `opening`: a push towards a reply that opens so."""
    ids = target.tokenizer.convert_tokens_to_ids
    bias = {ids('"'): 5.0, ids("}"): 3.0, ids('"}'): 4.0, ids("]"): 4.0, ids(","): 3.0, ids(":"): 3.0,
            **{ids(space): -5.0 for space in ("\u010a", "\u0109", "\u010d", "\u0120")}}
    if opening is not None:
        bias[ids(opening)] = 8.0
    return bias


@pytest.mark.parametrize("arch", ARCHS)
def test_calls_under_every_choice_are_the_plain_loops_for_every_proposer(byte_targets, arch):
    target = byte_targets[arch]
    prompt_ids = target.encode_prompt(PROMPT)
    cases = [("auto", "["), ("auto", None), ("required", None), ({"type": "function", "function": {
        "name": "get_weather"}}, "{")]
    for choice, opening in cases:
        request = tool_request(TOOLS, choice)
        fmt, schema = request.output_format()
        grammar = compile_schema(schema, text_otherwise=fmt == "json_schema_or_text")
        sampling = SamplingConfig(logit_bias=call_bias(target, opening))
        expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=60, grammar=grammar)
        config = GenerationConfig(60, sampling=sampling, response_format=fmt, json_schema=schema)
        for name, proposer in proposers(target, expected, len(prompt_ids)).items():
            result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
            assert result.tokens == expected, (choice, opening, name)
        is_call = result.text.startswith(("[", "{"))
        assert is_call == (opening is not None or choice != "auto"), (choice, result.text)
        if result.finish_reason == "stop":  # a whole call reads as one; words do not
            assert (request.calls(result.text) is not None) == is_call, (choice, result.text)


def test_auto_may_end_at_once_and_required_may_not(byte_targets):
    target = byte_targets["llama"]
    eos = target.eos_token_ids[0]
    prompt_ids = target.encode_prompt(PROMPT)
    sampling = SamplingConfig(logit_bias={eos: 30.0})  # the end, wherever it is allowed
    for choice in ("auto", "required"):
        fmt, schema = tool_request(TOOLS, choice).output_format()
        config = GenerationConfig(8, sampling=sampling, response_format=fmt, json_schema=schema)
        for proposer in (Proposer(), NgramProposer(max_draft=4)):
            result = SpeculativeDecoder(target, proposer).generate(prompt_ids, config)
            if choice == "auto":  # an empty reply is free text
                assert result.tokens == [eos] and result.text == "" and result.finish_reason == "stop"
            else:
                assert result.text[:1] in ("[", "{") and eos not in result.tokens


@pytest.mark.parametrize("arch", ARCHS[:1])
def test_seeded_samples_under_auto_are_the_plain_loops(byte_targets, arch):
    target = byte_targets[arch]
    prompt_ids = target.encode_prompt(PROMPT)
    fmt, schema = tool_request(TOOLS).output_format()
    grammar = compile_schema(schema, text_otherwise=True)
    for seed in range(3):
        sampling = SamplingConfig(temperature=0.9, seed=seed, logit_bias=call_bias(target, "["))
        expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=40, grammar=grammar)
        config = GenerationConfig(40, sampling=sampling, response_format=fmt, json_schema=schema)
        for name, proposer in proposers(target, expected, len(prompt_ids)).items():
            result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
            assert result.tokens == expected, (seed, name)


# ---- the server and LLM --------------------------------------------------------------------------------------------
def test_the_server_answers_with_tool_calls_whole_and_streamed(byte_targets):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.serving import BackgroundServer, create_app

    target = byte_targets["llama"]
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(opening=None, max_tokens=60, **kwargs):
            bias = {str(k): v for k, v in call_bias(target, opening).items()}
            return client.chat.completions.create(model="tiny", messages=HI, max_tokens=max_tokens, temperature=0,
                                                  logit_bias=bias, tools=SHORT_TOOLS, **kwargs)

        def streamed(**kwargs):
            chunks = [c.choices[0] for c in ask(stream=True, **kwargs) if c.choices]
            return "".join(c.delta.content or "" for c in chunks), streamed_calls(chunks), chunks[-1].finish_reason

        pieces = 0

        for kwargs in ({"opening": "[", "parallel_tool_calls": False},
                       {"tool_choice": "required", "parallel_tool_calls": False}, {"tool_choice": {"type": "function", "function": {"name": "clock"}}}):
            answer = ask(**kwargs).choices[0]
            assert answer.finish_reason == "tool_calls" and answer.message.content is None, kwargs
            calls = answer.message.tool_calls
            assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
            for call in calls:
                arguments = json.loads(call.function.arguments)
                assert call.function.name != "clock" or arguments == {}
                assert call.function.name != "weather" or isinstance(arguments["city"], str)
            text, chunk_calls, finish = streamed(**kwargs)
            assert text == "" and finish == "tool_calls"
            assert [call[:2] + call[3:] for call in chunk_calls] == \
                [(k, c.function.name, c.function.arguments) for k, c in enumerate(calls)]
            pieces = max(pieces, max(call[2] for call in chunk_calls))
        assert pieces > 2  # a call's arguments streamed as they were written, not at the end
        two = ask(tool_choice="required", parallel_tool_calls=False, n=2).choices  # each choice its own calls
        assert [len(c.message.tool_calls) for c in two] == [1, 1]
        assert two[0].message.tool_calls[0].function == two[1].message.tool_calls[0].function  # greedy: alike
        assert two[0].message.tool_calls[0].id != two[1].message.tool_calls[0].id
        chunks = [c.choices[0] for c in ask(tool_choice="required", parallel_tool_calls=False, n=2, stream=True)
                  if c.choices]
        assert sorted({c.index for c in chunks if c.delta.tool_calls}) == [0, 1]
        assert [c.finish_reason for c in chunks if c.finish_reason] == ["tool_calls"] * 2
        words = ask()  # auto, nothing pushing a call: a reply in words
        assert words.choices[0].message.tool_calls is None and words.choices[0].message.content
        assert streamed() == (words.choices[0].message.content, [], words.choices[0].finish_reason)
        cut = ask(tool_choice="required", max_tokens=3).choices[0]  # cut short: the text so far, no calls
        assert cut.finish_reason == "length" and cut.message.tool_calls is None and cut.message.content
        assert streamed(tool_choice="required", max_tokens=3) == (cut.message.content, [], "length")
        none = ask(tool_choice="none").choices[0].message.content
        plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=60, temperature=0,
                                               logit_bias={str(k): v for k, v in call_bias(target, None).items()})
        assert none == plain.choices[0].message.content  # no tools in the prompt, no grammar
        history = HI + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
        assert client.chat.completions.create(model="tiny", messages=history, max_tokens=4, tools=SHORT_TOOLS).choices
        for bad, fragment in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "must name one"),
                              ({"response_format": {"type": "json_object"}}, "either may call tools")]:
            with pytest.raises(openai.BadRequestError, match=fragment):
                ask(**bad)
        import httpx

        tokenized = httpx.post(f"{url}/tokenize", json={"messages": HI, "tools": SHORT_TOOLS}).json()
        assert tokenized["tokens"] == target.encode_messages(conversation(HI, tool_request(SHORT_TOOLS)))
        with pytest.raises(openai.BadRequestError, match="for chat completions"):
            client.completions.create(model="tiny", prompt="hi", max_tokens=4, extra_body={"tools": SHORT_TOOLS})
        with pytest.raises(openai.BadRequestError, match="needs its content"):
            client.chat.completions.create(model="tiny", messages=[{"role": "user"}], max_tokens=4)


def streamed_calls(chunks) -> list[tuple]:
    """The calls a stream's chunks carry, as OpenAI streams them (a call's id and name first, then its arguments in
    pieces): (index, name, how many pieces its arguments came in, the arguments), each with one id."""
    calls: dict[int, list] = {}
    for chunk in chunks:
        for delta in chunk.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in calls and delta.function.name and delta.type == "function"
                calls[delta.index] = [delta.index, delta.function.name, 0, delta.function.arguments or ""]
            else:
                assert delta.function.name is None
                calls[delta.index][2] += 1
                calls[delta.index][3] += delta.function.arguments
    return [tuple(call) for _, call in sorted(calls.items())]


def pushed_llm(monkeypatch):
    """LLM on a tiny byte-level target whose configs are biased by call_bias: a random model, pushed to finish its
    calls."""
    from dflash import LLM

    llm = LLM("tiny-llama-bytes", method="ngram")
    configured = llm._config

    def biased(*args):
        config = configured(*args)
        config.sampling.logit_bias = call_bias(llm.target, None)
        return config
    monkeypatch.setattr(llm, "_config", biased)
    return llm


def test_llm_chat_reads_the_calls(monkeypatch):
    llm = pushed_llm(monkeypatch)
    result = llm.chat(HI, tools=SHORT_TOOLS, tool_choice={"type": "function", "function": {"name": "clock"}},
                      max_new_tokens=40)
    assert result.finish_reason == "stop"
    assert [c["function"] for c in result.tool_calls] == [{"name": "clock", "arguments": "{}"}]
    assert llm.chat(HI, tools=SHORT_TOOLS, tool_choice="none", max_new_tokens=4).tool_calls is None
    with pytest.raises(UserError, match="either may call tools"):
        llm.chat(HI, tools=SHORT_TOOLS, response_format="json_object")


def push_calls(monkeypatch, module, target) -> None:
    """A command module's configs biased by call_bias: a random model, pushed to finish its call."""
    configured = module.config_from_args

    def biased(args, **more):
        config = configured(args, **more)
        config.sampling.logit_bias = call_bias(target, None)
        return config
    monkeypatch.setattr(module, "config_from_args", biased)


def test_batch_rows_carry_their_own_tools(tmp_path, capsys, monkeypatch):
    import dflash.batch as batch
    from dflash.cli import main
    from dflash.testing import tiny_target

    target = tiny_target("qwen2", vocab_size=320, logit_scale=4.0, tokenizer="bytes")  # the CLI's tiny-qwen2-bytes
    push_calls(monkeypatch, batch, target)
    clock = {"type": "function", "function": {"name": "clock"}}
    rows = [{"id": "words", "messages": HI}, {"id": "call", "messages": HI, "tools": SHORT_TOOLS, "tool_choice": clock},
            {"id": "none", "messages": HI, "tools": SHORT_TOOLS, "tool_choice": "none"}]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["batch", str(source), "--output", str(out), "--target", "tiny-qwen2-bytes", "--method", "ngram",
            "--max-new-tokens", "60", "--max-batch", "3", "--no-progress"]
    assert main(argv) == 0
    answers = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    request = tool_request(SHORT_TOOLS, clock)
    fmt, schema = request.output_format()
    expected = SpeculativeDecoder(target).generate(
        target.encode_messages(conversation(HI, request)),
        GenerationConfig(60, sampling=SamplingConfig(logit_bias=call_bias(target, None)), response_format=fmt,
                         json_schema=schema))
    assert answers["call"]["text"] == expected.text and answers["call"]["finish_reason"] == "tool_calls"
    assert [c["function"] for c in answers["call"]["tool_calls"]] == [{"name": "clock", "arguments": "{}"}]
    assert "tool_calls" not in answers["none"] and answers["none"]["text"] == answers["words"]["text"]
    source.write_text(json.dumps({"messages": HI, "tools": SHORT_TOOLS, "tool_choice": "always"}) + "\n")
    assert main(argv[:3] + [str(tmp_path / "other.jsonl")] + argv[4:]) == 2
    assert "in.jsonl:1: tool_choice must be one of none, auto, required" in capsys.readouterr().err


def test_generate_takes_tools(capsys, monkeypatch, tmp_path):
    import dflash.generate as generate
    from dflash.cli import main
    from dflash.testing import tiny_target

    target = tiny_target("qwen2", vocab_size=320, logit_scale=4.0, tokenizer="bytes")  # the CLI's tiny-qwen2-bytes
    push_calls(monkeypatch, generate, target)
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(SHORT_TOOLS))
    argv = ["generate", "--target", "tiny-qwen2-bytes", "--method", "ngram", "--max-new-tokens", "60", "--json",
            "--tools", str(tools), "--tool-choice", "clock", "Hi?"]
    assert main(argv) == 0
    payload = json.loads(capsys.readouterr().out)
    assert [c["function"] for c in payload["tool_calls"]] == [{"name": "clock", "arguments": "{}"}]
    for bad, message in [(["--tool-choice", "nope"],
                          "must name one of the function tools (weather, clock), got 'nope'"),
                         (["--no-chat"], "--tools needs the chat template"),
                         (["--tools", "[{"], "--tools takes a file holding OpenAI's tools list")]:
        assert main(argv[:-1] + bad + ["Hi?"]) == 2
        assert message in capsys.readouterr().err


# ---- the hermes format: a template's own <tool_call> tags ----------------------------------------------------------
CALL_TEXT = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
WEATHER_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>'


def hermes_grammar(choice="auto", parallel=True):
    return output_grammar(*tool_request(TOOLS, choice, parallel, style="hermes").output_format())


def test_the_template_picks_the_format(hermes_targets, byte_targets):
    hermes, plain = hermes_targets["llama"].tokenizer, byte_targets["llama"].tokenizer
    assert tool_style(hermes) == "hermes" and tool_style(plain) == "json"
    assert tool_style(hermes, "json") == "json"
    with pytest.raises(UserError, match="needs a chat template that writes calls so"):
        tool_style(plain, "hermes")
    with pytest.raises(UserError, match="must be one of auto, json, hermes"):
        tool_style(plain, "xml")


def test_a_framed_grammar_takes_words_then_calls_in_tags_and_nothing_after():
    auto, one = hermes_grammar(), hermes_grammar(parallel=False)
    required, named = hermes_grammar("required"), hermes_grammar({"type": "function", "function": {"name": "get_time"}})
    words = "Let me see: <b>bold</b> <tool_call"  # a near miss of the tag is text
    cases = {  # text -> whether auto, auto with one call, required, named get_time may end after it
        "": (True, True, False, False), words: (True, True, False, False),
        CALL_TEXT: (True, True, True, True), "Sure.\n" + CALL_TEXT: (True, True, False, False),
        "<<tool_call>" + CALL_TEXT[11:]: (True, True, False, False),  # the tag after a stray `<`
        CALL_TEXT + "\n" + WEATHER_TEXT: (True, False, True, False),
        WEATHER_TEXT: (True, True, True, False),
    }
    for text, expected in cases.items():
        for grammar, ok in zip((auto, one, required, named), expected):
            state = grammar.feed_bytes(START_STATE, text.encode())
            assert (state is not None and grammar.may_end(state)) == ok, (text, grammar.frame)
    for wrong in [CALL_TEXT + " Done.", "<tool_call> {", "<tool_call>\n[", CALL_TEXT[:-1] + "x",
                  '<tool_call>\n{"name": "get_weather", "arguments": {}}']:  # city is required
        assert auto.feed_bytes(START_STATE, wrong.encode()) is None, wrong
    assert auto.feed_bytes(START_STATE, CALL_TEXT[:-3].encode()) is not None  # a call under way may not end
    assert not auto.may_end(auto.feed_bytes(START_STATE, CALL_TEXT[:-3].encode()))
    assert auto.feed_bytes(START_STATE, (CALL_TEXT + "\n<tool_call>").encode()) is not None
    assert required.feed_bytes(START_STATE, b"Sure") is None


def test_masks_in_words_and_in_tags_are_every_token_fed():
    from dflash.testing import tiny_hermes_tokenizer

    tokenizer = tiny_hermes_tokenizer(320)  # and tokens that end the tag, some with what may follow it, some not
    tokenizer.add_tokens(["_call>\n{", "_call> ", "call>", "l>\n", ">!", "a>"])
    texts = [("Hi <tool_c <<tool_call>" + CALL_TEXT[11:] + "\n" + WEATHER_TEXT).encode(), b"a>b<tool_call>\n{"]
    assert assert_masks_are_fed(hermes_grammar(), texts, tokenizer) > 100
    assert assert_masks_are_fed(hermes_grammar("required", False), [CALL_TEXT.encode()], tokenizer) > 40


def test_hermes_calls_are_read_from_the_tags():
    request = tool_request(TOOLS, style="hermes")
    for text in [CALL_TEXT, "Let me check.\n" + CALL_TEXT, CALL_TEXT + "\n" + WEATHER_TEXT + "\n",
                 '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>']:  # whitespace is free when read
        calls = request.calls(text)
        assert calls and calls[0]["function"] == {"name": "get_time", "arguments": "{}"}, text
    assert len(request.calls(CALL_TEXT + "\n" + WEATHER_TEXT)) == 2
    assert request.content("Let me check.\n" + CALL_TEXT) == "Let me check." and request.content(CALL_TEXT) is None
    for text in ["No calls.", CALL_TEXT[:-3], CALL_TEXT + " and more", CALL_TEXT.replace("get_time", "other"),
                 '<tool_call>\n{"name": "get_time", "arguments": {}} x\n</tool_call>',
                 '<tool_call>\n{"name": "get_time"']:
        assert request.calls(text) is None, text
    assert [request.opening(t, at_start=False) for t in ("Hi", "Hi <tool", "Hi <tool_call>", "a < b")] == \
        ["text", "maybe", "calls", "text"]


def test_a_hermes_template_renders_the_tools_the_calls_and_the_results(hermes_targets):
    target = hermes_targets["llama"]
    request = tool_request(TOOLS, style="hermes")
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    turns = conversation(messages, request)
    assert turns[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert turns[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1", "name": "get_weather"}
    text = target.tokenizer.decode(encode_chat(target, messages, request))
    assert text.startswith("<user> tools: get_weather get_time ")  # the template describes the tools itself
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>18C</tool_response>" in text and "You can call functions" not in text
    json_text = target.tokenizer.decode(encode_chat(target, messages, tool_request(TOOLS)))
    assert "You can call functions" in json_text and "<tool_call>" not in json_text


def hermes_bias(target, tag: float) -> dict[int, float]:
    """call_bias, and a push towards the tag: strong, a call at once; weaker, under sampling, words first."""
    tags = target.tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    return {**call_bias(target, None), tags[0]: tag, tags[1]: 3.0}


def every_proposer_as_the_plain_loop(target, prompt_ids, request, sampling, max_new=60):
    """Each proposer's output under the request's grammar, checked equal to the plain constrained loop's; the last."""
    fmt, schema = request.output_format()
    expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=max_new,
                                      grammar=output_grammar(fmt, schema))
    config = GenerationConfig(max_new, sampling=sampling, response_format=fmt, json_schema=schema)
    for name, proposer in proposers(target, expected, len(prompt_ids)).items():
        result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
        assert result.tokens == expected, (request.choice, sampling, name)
    return result


@pytest.mark.parametrize("arch", ARCHS[:2])
def test_hermes_calls_under_every_choice_are_the_plain_loops_for_every_proposer(hermes_targets, arch):
    target = hermes_targets[arch]
    prompt_ids = target.encode_prompt(PROMPT)
    called = []
    for choice, tag, seed in [("auto", 6.0, None), ("required", 3.0, None), ("auto", 3.0, 1), ("auto", 3.0, 3),
                              ({"type": "function", "function": {"name": "get_weather"}}, 3.0, None)]:
        request = tool_request(TOOLS, choice, style="hermes")
        sampling = SamplingConfig(temperature=0.0 if seed is None else 0.7, seed=seed,
                                  logit_bias=hermes_bias(target, tag))
        result = every_proposer_as_the_plain_loop(target, prompt_ids, request, sampling)
        calls = request.calls(result.text)
        assert (calls is not None) == (result.finish_reason == "stop" and "<tool_call>" in result.text), result.text
        if calls is not None:
            called.append(request.content(result.text) is not None)
        if choice != "auto":
            assert result.text.startswith("<tool_call>\n{"), result.text
    assert len(called) >= 3 and (arch != "qwen3" or any(called))  # qwen3's samples write words, then a call


def test_the_server_streams_words_then_hermes_calls():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.serving import BackgroundServer, create_app
    from dflash.testing import tiny_target

    target = tiny_target("qwen3", vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        outcomes = set()
        for tag, seed in [(6.0, None), (3.0, 1), (3.0, 2), (3.0, 3)]:
            bias = {str(k): v for k, v in hermes_bias(target, tag).items()}
            ask = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=60, logit_bias=bias,
                       temperature=0.0 if seed is None else 0.7, seed=seed, tools=TOOLS)
            whole = client.chat.completions.create(**ask).choices[0]
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask) if c.choices]
            text = "".join(c.delta.content or "" for c in chunks)
            calls = streamed_calls(chunks)
            assert chunks[-1].finish_reason == whole.finish_reason
            if whole.finish_reason == "tool_calls":
                assert [(call[1], call[3]) for call in calls] == \
                    [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
                assert (whole.message.content or "") == text.rstrip()  # words before the calls, streamed as text
                assert "<tool_call>" not in text
                outcomes.add("words and calls" if text else "calls")
            elif calls:  # cut short in a call: its start went out, as OpenAI streams it
                assert whole.message.content.startswith(text.rstrip()) and not whole.message.tool_calls
                outcomes.add("cut in a call")
            else:
                assert text == whole.message.content
                outcomes.add(whole.finish_reason)
        assert {"words and calls", "calls"} <= outcomes
        tokenized = __import__("httpx").post(f"{url}/tokenize", json={"messages": HI, "tools": SHORT_TOOLS}).json()
        assert tokenized["tokens"] == encode_chat(target, HI, tool_request(SHORT_TOOLS, style="hermes"))
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny", tool_format="json")) as url:
        tokenized = __import__("httpx").post(f"{url}/tokenize", json={"messages": HI, "tools": SHORT_TOOLS}).json()
        assert tokenized["tokens"] == target.encode_messages(conversation(HI, tool_request(SHORT_TOOLS)))


def test_generate_and_batch_write_calls_in_the_templates_format(capsys, monkeypatch, tmp_path):
    import dflash.batch as batch
    import dflash.generate as generate
    from dflash.cli import main

    for module in (generate, batch):
        push_calls(monkeypatch, module, load_target_cached("tiny-qwen2-hermes"))
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps(SHORT_TOOLS))
    argv = ["generate", "--target", "tiny-qwen2-hermes", "--method", "ngram", "--max-new-tokens", "60", "--json",
            "--tools", str(tools), "--tool-choice", "clock", "Hi?"]
    texts = {}
    for tool_format in ("auto", "json"):
        assert main(argv[:-1] + ["--tool-format", tool_format, "Hi?"]) == 0
        payload = json.loads(capsys.readouterr().out)
        assert [c["function"] for c in payload["tool_calls"]] == [{"name": "clock", "arguments": "{}"}]
        texts[tool_format] = payload["text"]
    assert texts["auto"].startswith("<tool_call>\n{") and texts["json"].startswith(("[", "{"))
    push_calls(monkeypatch, generate, load_target_cached("tiny-qwen2-llama3"))
    assert main([a.replace("hermes", "llama3") for a in argv]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert json.loads(payload["text"]) == {"name": "clock", "parameters": {}}
    assert [c["function"]["name"] for c in payload["tool_calls"]] == ["clock"]
    bytes_argv = [a.replace("hermes", "bytes") for a in argv]
    assert main(bytes_argv[:-1] + ["--tool-format", "hermes", "Hi?"]) == 2
    assert "needs a chat template that writes calls so" in capsys.readouterr().err
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"id": "a", "messages": HI, "tools": SHORT_TOOLS, "tool_choice": "required"}) + "\n")
    assert main(["batch", str(source), "--output", str(out), "--target", "tiny-qwen2-hermes", "--method", "ngram",
                 "--max-new-tokens", "60", "--no-progress"]) == 0
    answer = json.loads(out.read_text())
    assert answer["text"].startswith("<tool_call>\n{") and answer["finish_reason"] == "tool_calls"
    assert answer["tool_calls"][0]["function"]["name"] in ("weather", "clock")


# ---- the llama3_json format: Llama 3's {"name", "parameters"} objects ---------------------------------------------
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "P"}}'


@pytest.fixture(scope="module")
def llama3_target():
    from dflash.testing import tiny_target

    return tiny_target("llama", vocab_size=320, logit_scale=4.0, tokenizer="llama3")


def test_llamas_format_is_one_object_with_parameters(llama3_target, hermes_targets):
    assert tool_style(llama3_target.tokenizer) == "llama3_json"
    assert tool_style(hermes_targets["llama"].tokenizer, "auto") == "hermes"
    with pytest.raises(UserError, match="tool format hermes needs a chat template that writes calls so"):
        tool_style(llama3_target.tokenizer, "hermes")
    request = tool_request(TOOLS, style="llama3_json")
    grammar = output_grammar(*request.output_format())
    for text, ends in [(LLAMA_CALL, True), ("Sunny.", True), ('[{"name": "get_time", "parameters": {}}]', True),
                       ('{"name": "get_time", "arguments": {}}', False),
                       ('{"name": "get_time", "parameters": {}}', True)]:
        state = grammar.feed_bytes(START_STATE, text.encode())
        assert (state is not None and grammar.may_end(state)) == ends, text
    assert request.calls(LLAMA_CALL)[0]["function"] == {"name": "get_weather", "arguments": '{"city": "P"}'}
    assert request.calls("[" + LLAMA_CALL + "]") is None and request.calls("Sunny.") is None  # words, not calls
    assert not request.several and request.opening("[", at_start=True) == "text"
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    text = llama3_target.tokenizer.decode(encode_chat(llama3_target, history, request))
    assert "dictionary of argument name" in text and ": get_weather get_time " in text
    assert '{"name": "get_weather", "parameters": {"city": "Rome"}}' in text and "ipython: 18C" in text


def test_llama_calls_under_every_choice_are_the_plain_loops_for_every_proposer(llama3_target):
    target = llama3_target
    prompt_ids = target.encode_prompt(PROMPT)
    called = 0
    for choice, opening in [("auto", "{"), ("auto", None), ("required", None),
                            ({"type": "function", "function": {"name": "get_weather"}}, None)]:
        request = tool_request(TOOLS, choice, style="llama3_json")
        result = every_proposer_as_the_plain_loop(target, prompt_ids, request,
                                                  SamplingConfig(logit_bias=call_bias(target, opening)))
        calls = request.calls(result.text)
        assert (calls is not None) == (result.finish_reason == "stop" and result.text.startswith("{")), result.text
        called += calls is not None
    assert called >= 2
