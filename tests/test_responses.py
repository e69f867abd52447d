"""The Responses API (serving/responses.py) through the real openai client: every output against the same server's
chat completions for the same conversation (themselves held against the engine in test_server.py), whole and
streamed (the SDK's own stream accumulator checks the events' order and identities); conversations continued by
previous_response_id; function calls, reasoning and structured output; bad requests refused in one line."""

import json

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from dflash.methods.ngram import NgramProposer  # noqa: E402
from dflash.serving import BackgroundServer, create_app  # noqa: E402
from dflash.serving.responses import input_messages  # noqa: E402
from test_reasoning import thinking_app  # noqa: E402
from test_tools import HI, PROMPT, SHORT_TOOLS, call_bias  # noqa: E402

# SHORT_TOOLS in the Responses API's layout: each function's fields beside its type
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in SHORT_TOOLS]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}


@pytest.fixture(scope="module")
def client(byte_targets):
    target = byte_targets["llama"]
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny")) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **kwargs)


def streamed(client, **kwargs) -> tuple[list, object]:
    """A streamed response's events and its final response (the SDK's, accumulated from the events, where it is
    completed; the last event's where it is incomplete)."""
    with client.responses.stream(model="tiny", **kwargs) as stream:
        events = list(stream)
    final = events[-1].response
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type == f"response.{final.status}" and final.id == events[0].response.id
    return events, final


def deltas(events, kind: str) -> str:
    return "".join(event.delta for event in events if event.type == kind)


@pytest.mark.parametrize("instructions", [None, "Be brief."])
def test_text_is_the_chat_reply_whole_and_streamed(client, instructions):
    system = [{"role": "system", "content": instructions}] if instructions else []
    for max_tokens in (40, 3):
        expected = chat(client, system + HI, max_tokens=max_tokens)
        ask = dict(input="Hi?", max_output_tokens=max_tokens, temperature=0, instructions=instructions)
        response = client.responses.create(model="tiny", **ask)
        assert response.output_text == expected.choices[0].message.content
        cut = expected.choices[0].finish_reason == "length"
        assert response.status == ("incomplete" if cut else "completed")
        assert (response.incomplete_details is not None) == cut
        assert (response.usage.input_tokens, response.usage.output_tokens) == (
            expected.usage.prompt_tokens, expected.usage.completion_tokens)
        assert [item.type for item in response.output] == ["message"]
        assert response.model_extra["dflash"]["method"] == "ngram"
        events, final = streamed(client, **ask)
        assert final.output_text == deltas(events, "response.output_text.delta") == response.output_text
        assert [event.type for event in events[2:4]] == ["response.output_item.added", "response.content_part.added"]
        assert [event.type for event in events[-4:-1]] == [
            "response.output_text.done", "response.content_part.done", "response.output_item.done"]
        assert final.status == response.status and final.usage.output_tokens == response.usage.output_tokens
    assert len([e for e in events if e.type == "response.output_text.delta"]) >= 1
    as_items = client.responses.create(model="tiny", max_output_tokens=40, temperature=0, instructions=instructions,
                                       input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi?"}]}])
    assert as_items.output_text == chat(client, system + HI, max_tokens=40).choices[0].message.content


def test_a_conversation_goes_on_from_a_stored_response(client):
    first = client.responses.create(model="tiny", input="Hi?", max_output_tokens=12, temperature=0,
                                    instructions="Be brief.")
    second = client.responses.create(model="tiny", input="And?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    # the earlier instructions do not carry over (as OpenAI's); the earlier reply does
    history = HI + [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And?"}]
    expected = chat(client, history, max_tokens=12)
    assert second.output_text == expected.choices[0].message.content
    assert second.usage.input_tokens == expected.usage.prompt_tokens
    assert second.previous_response_id == first.id
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    for gone in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(model="tiny", input="x", previous_response_id=first.id)):
        with pytest.raises(openai.NotFoundError, match="not found"):
            gone()
    unkept = client.responses.create(model="tiny", input="Hi?", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)


def test_function_calls_are_the_chat_calls_whole_and_streamed(client, byte_targets):
    bias = {str(k): v for k, v in call_bias(byte_targets["llama"], None).items()}
    pieces = 0
    for choice, chat_choice in [("required", "required"), ({"type": "function", "name": "clock"},
                                                           {"type": "function", "function": {"name": "clock"}})]:
        expected = chat(client, HI, max_tokens=60, tools=SHORT_TOOLS, tool_choice=chat_choice,
                        parallel_tool_calls=False, logit_bias=bias).choices[0].message.tool_calls
        ask = dict(input="Hi?", tools=FLAT_TOOLS, tool_choice=choice, parallel_tool_calls=False,
                   max_output_tokens=60, temperature=0, extra_body={"logit_bias": bias})
        response = client.responses.create(model="tiny", **ask)
        calls = [item for item in response.output if item.type == "function_call"]
        assert [(c.name, c.arguments) for c in calls] == [(c.function.name, c.function.arguments) for c in expected]
        assert all(c.call_id.startswith("call_") and c.status == "completed" for c in calls)
        scored = client.responses.create(model="tiny", top_logprobs=2, **ask)  # a call's tokens have no place
        assert [(c.type, c.name, c.arguments) for c in scored.output] == [(c.type, c.name, c.arguments) for c in calls]
        assert response.status == "completed" and response.output_text == ""
        events, final = streamed(client, **ask)
        streamed_calls = [item for item in final.output if item.type == "function_call"]
        assert [(c.name, c.arguments) for c in streamed_calls] == [(c.name, c.arguments) for c in calls]
        assert deltas(events, "response.function_call_arguments.delta") == "".join(c.arguments for c in calls)
        pieces = max(pieces, len([e for e in events if e.type == "response.function_call_arguments.delta"]))
    assert pieces > 2  # arguments streamed as they were written
    # the call and its output sent back as items: the conversation chat sees with tool_calls and a tool turn
    items = [{"role": "user", "content": "Hi?"},
             {"type": "function_call", "call_id": "call_1", "name": "clock", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "noon"}]
    history = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]
    after = client.responses.create(model="tiny", input=items, tools=FLAT_TOOLS, max_output_tokens=8, temperature=0)
    expected = chat(client, history, tools=SHORT_TOOLS, max_tokens=8)
    assert after.output_text == (expected.choices[0].message.content or "")
    assert after.usage.input_tokens == expected.usage.prompt_tokens


def test_structured_output_is_the_chat_reply(client, byte_targets):
    from test_structured import structure_bias

    bias = {str(k): v for k, v in structure_bias(byte_targets["llama"]).items()}
    expected = chat(client, HI, max_tokens=40, logit_bias=bias, response_format={
        "type": "json_schema", "json_schema": {"name": "count", "schema": SCHEMA}}).choices[0].message.content
    response = client.responses.create(model="tiny", input="Hi?", max_output_tokens=40, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "count", "schema": SCHEMA}},
                                       extra_body={"logit_bias": bias})
    assert response.output_text == expected and isinstance(json.loads(expected)["ok"], bool)
    assert response.text.format.type == "json_schema"
    terse = client.responses.create(model="tiny", input="Hi?", max_output_tokens=40, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "count", "schema": SCHEMA},
                                          "verbosity": "low"}, extra_body={"logit_bias": bias})
    assert terse.output_text == expected  # text's other fields (verbosity) change nothing here


def test_reasoning_comes_back_as_its_own_item():
    app, bias = thinking_app()
    thought = 0
    with BackgroundServer(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for seed in (2, 3, 5):
            # JSON after the thinking: the grammar lets a random model think first
            sampling = dict(temperature=0.8, extra_body={"logit_bias": bias, "seed": seed},
                            text={"format": {"type": "json_object"}})
            message = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=80, temperature=0.8,
                seed=seed, logit_bias=bias, response_format={"type": "json_object"}).choices[0].message.model_dump()
            thinking = message.get("reasoning")
            response = client.responses.create(model="tiny", input=PROMPT, max_output_tokens=80, **sampling)
            reasoning = [item for item in response.output if item.type == "reasoning"]
            assert [item.content[0].text for item in reasoning] == [thinking] * bool(thinking)
            assert response.output_text == (message["content"] or "")
            assert response.usage.output_tokens_details.reasoning_tokens > 0 or not reasoning
            events, final = streamed(client, input=PROMPT, max_output_tokens=80, **sampling)
            assert deltas(events, "response.reasoning_text.delta").strip() == (thinking or "")
            assert final.output_text.rstrip() == (message["content"] or "").rstrip()
            thought += bool(reasoning)
            if reasoning:  # the reasoning goes back to the template with the reply in the next turn
                after = client.responses.create(model="tiny", input="And?", previous_response_id=response.id,
                                                max_output_tokens=2)
                assert after.usage.input_tokens > response.usage.input_tokens
    assert thought


def token_logprobs(entries) -> list[tuple]:
    """Log-probabilities as (token, bytes, its top alternatives), for comparing the APIs' layouts."""
    return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]


def values(entries) -> list[float]:
    return [e.logprob for e in entries] + [t.logprob for e in entries for t in e.top_logprobs]


def test_log_probabilities_are_the_chat_replys_whole_and_streamed(client):
    expected = chat(client, HI, max_tokens=24, logprobs=True, top_logprobs=3).choices[0]
    for ask in (dict(include=["message.output_text.logprobs"], top_logprobs=3), dict(top_logprobs=3)):
        response = client.responses.create(model="tiny", input="Hi?", max_output_tokens=24, temperature=0, **ask)
        (part,) = response.output[0].content
        assert part.text == expected.message.content and response.top_logprobs == 3
        assert token_logprobs(part.logprobs) == token_logprobs(expected.logprobs.content)
        assert values(part.logprobs) == pytest.approx(values(expected.logprobs.content), abs=1e-4)
        assert all(len(e.top_logprobs) == 3 for e in part.logprobs)
        events, final = streamed(client, input="Hi?", max_output_tokens=24, temperature=0, **ask)
        sent = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
        assert token_logprobs(sent) == token_logprobs(final.output[0].content[0].logprobs) == token_logprobs(
            part.logprobs)
        assert len([event for event in events if event.type == "response.output_text.delta"]) > 1
    alone = client.responses.create(model="tiny", input="Hi?", max_output_tokens=24, temperature=0,
                                    include=["message.output_text.logprobs", "reasoning.encrypted_content"])
    assert token_logprobs(alone.output[0].content[0].logprobs) == [(e.token, e.bytes, []) for e in part.logprobs]
    plain = client.responses.create(model="tiny", input="Hi?", max_output_tokens=24, temperature=0)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text


def test_log_probabilities_are_the_messages_only(byte_targets):
    """A reply that thinks shows the log-probabilities of its message's words alone (not its thinking's, nor the
    whitespace after it): their tokens spell the message, whole and streamed alike."""
    app, bias = thinking_app()
    with BackgroundServer(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        thought = 0
        for seed in (2, 3, 5):
            ask = dict(input=PROMPT, max_output_tokens=80, temperature=0.8, top_logprobs=1,
                       extra_body={"logit_bias": bias, "seed": seed}, text={"format": {"type": "json_object"}})
            response = client.responses.create(model="tiny", **ask)
            final = streamed(client, **ask)[1]
            assert [(item.type, item.content[0].text if item.content else None) for item in final.output] == [
                (item.type, item.content[0].text if item.content else None) for item in response.output]
            messages = [item for item in response.output if item.type == "message"]
            for message, sent in zip(messages, [item for item in final.output if item.type == "message"]):
                (part,) = message.content
                assert bytes(b for e in part.logprobs for b in e.bytes).decode() == part.text
                assert token_logprobs(part.logprobs) == token_logprobs(sent.content[0].logprobs)
                assert values(part.logprobs) == pytest.approx(values(sent.content[0].logprobs), abs=1e-4)
            thought += any(item.type == "reasoning" for item in response.output) and bool(messages)
        assert thought


def test_truncation_auto_drops_the_oldest_exchanges_until_the_reply_fits(client, byte_targets):
    import httpx

    context = byte_targets["llama"].max_context
    exchanges = [[{"role": "user", "content": f"Question {k}: " + "why " * 12},
                  {"role": "assistant", "content": f"Answer {k}: " + "because " * 8}] for k in range(12)]
    turns = [{"role": "developer", "content": "Be brief."}] + [m for pair in exchanges for m in pair] + HI
    base = str(client.base_url).removesuffix("/v1/")
    assert httpx.post(f"{base}/tokenize", json={"messages": turns}).json()["count"] > context
    with pytest.raises(openai.BadRequestError, match="does not fit"):
        client.responses.create(model="tiny", input=turns, max_output_tokens=16)
    response = client.responses.create(model="tiny", input=turns, max_output_tokens=16, temperature=0,
                                       truncation="auto")
    assert response.truncation == "auto" and response.usage.input_tokens + 16 < context
    kept = next(k for k in range(12) if httpx.post(f"{base}/tokenize", json={
        "messages": turns[:1] + turns[1 + 2 * k:]}).json()["count"] == response.usage.input_tokens)
    assert kept > 0  # the oldest exchanges went, the developer's message stayed
    expected = chat(client, turns[:1] + turns[1 + 2 * kept:], max_tokens=16)
    assert response.output_text == expected.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="truncation must be"):
        client.responses.create(model="tiny", input="Hi?", truncation="middle")


def settled(client, response_id: str, timeout: float = 30.0):
    """A background response once it has ended (polled, as a client does)."""
    import time

    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, f"{response_id} still {response.status}"
        time.sleep(0.05)
    return response


def test_a_background_response_is_polled_and_read_again_as_a_stream(client):
    ask = dict(input="Hi?", max_output_tokens=24, temperature=0)
    expected = client.responses.create(model="tiny", **ask)
    started = client.responses.create(model="tiny", background=True, **ask)
    assert started.background and started.status in ("queued", "in_progress") and started.output == []
    done = settled(client, started.id)
    assert done.status == expected.status and done.output_text == expected.output_text
    assert done.usage.output_tokens == expected.usage.output_tokens
    replayed = list(client.responses.retrieve(started.id, stream=True))
    assert [e.sequence_number for e in replayed] == list(range(len(replayed)))
    assert replayed[0].type == "response.created" and replayed[0].response.status == "queued"
    assert replayed[-1].type == f"response.{done.status}" and replayed[-1].response.output_text == done.output_text
    assert deltas(replayed, "response.output_text.delta") == done.output_text
    rest = list(client.responses.retrieve(started.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in rest] == list(range(3, len(replayed)))
    with client.responses.create(model="tiny", background=True, stream=True, **ask) as stream:
        events = list(stream)
    assert events[-1].response.output_text == expected.output_text and events[-1].response.background
    assert deltas(events, "response.output_text.delta") == expected.output_text
    after = client.responses.create(model="tiny", input="And?", previous_response_id=started.id,
                                    max_output_tokens=4, temperature=0)
    assert after.usage.input_tokens > done.usage.input_tokens  # the background reply goes on like any other
    with pytest.raises(openai.BadRequestError, match="only background responses can be cancelled"):
        client.responses.cancel(expected.id)
    with pytest.raises(openai.BadRequestError, match="only background responses can be streamed again"):
        list(client.responses.retrieve(expected.id, stream=True))
    assert client.responses.cancel(started.id).status == done.status  # it had ended: nothing to stop
    with pytest.raises(openai.BadRequestError, match="must be stored"):
        client.responses.create(model="tiny", background=True, store=False, **ask)


def test_a_background_response_waits_in_the_queue_and_is_cancelled_there(byte_targets):
    import threading

    app = create_app(byte_targets["llama"], NgramProposer(max_draft=7), "tiny")
    engine, gate = app.state.service.worker.engine, threading.Event()
    step = engine.step
    engine.step = lambda: gate.wait(30) and step()  # the engine holds its first round until the gate opens
    with BackgroundServer(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        ask = dict(input="Hi?", max_output_tokens=24, temperature=0, background=True)
        kept, dropped = (client.responses.create(model="tiny", **ask) for _ in range(2))
        assert client.responses.retrieve(kept.id).status == "queued"
        with pytest.raises(openai.BadRequestError, match="is queued"):
            client.responses.create(model="tiny", input="And?", previous_response_id=kept.id)
        cancelled = client.responses.cancel(dropped.id)
        assert cancelled.status == "cancelled" and cancelled.id == dropped.id
        gate.set()
        assert settled(client, kept.id).status in ("completed", "incomplete")
        assert client.responses.retrieve(dropped.id).status == "cancelled"
        events = list(client.responses.retrieve(dropped.id, stream=True))
        assert [e.type for e in events] == ["response.created"]  # cut there: nothing after the cancel
        assert client.responses.cancel(dropped.id).status == "cancelled"


def test_input_items_are_listed_a_page_at_a_time(client):
    given = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "And?"}]}]
    response = client.responses.create(model="tiny", input=given, max_output_tokens=2)
    newest = client.responses.input_items.list(response.id)
    assert [(item.role, item.content[0].text) for item in newest.data] == [
        ("user", "And?"), ("assistant", "Hello."), ("user", "Hi?"), ("developer", "Be brief.")]
    assert len({item.id for item in newest.data}) == 4 and newest.has_more is False
    first = client.responses.input_items.list(response.id, order="asc", limit=3)
    assert [item.id for item in first.data] == [item.id for item in newest.data[::-1][:3]] and first.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=first.data[-1].id)
    assert [item.id for item in rest.data] == [newest.data[0].id] and not rest.has_more
    text = client.responses.create(model="tiny", input="Hi?", max_output_tokens=2)
    (item,) = client.responses.input_items.list(text.id).data
    assert (item.type, item.role, item.content[0].type, item.content[0].text) == ("message", "user", "input_text",
                                                                                  "Hi?")
    with pytest.raises(openai.BadRequestError, match="limit must be in"):
        client.responses.input_items.list(text.id, limit=0)


def test_input_items_become_the_chat_conversation():
    items = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
             {"type": "function_call", "call_id": "c1", "name": "clock", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": "{\"city\": \"Rome\"}"},
             {"type": "function_call_output", "call_id": "c1", "output": "noon"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "sun"}]}]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Hmm.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"}]
    assert input_messages("Hi?") == HI


@pytest.mark.parametrize("ask, fragment", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "only text parts"),
    ({"input": "Hi?", "tools": [{"type": "web_search"}]}, "only function and custom tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "not supported here"),
    ({"input": [{"role": "tool", "content": "x"}]}, "role must be"),
    ({"input": "Hi?", "text": {"format": {"type": "yaml"}}}, "text.format must be"),
    ({"input": "Hi?", "text": {"format": {"type": "json_schema", "name": "x"}}}, "needs its schema"),
    ({"input": "Hi?", "extra_body": {"n": 2}}, "n is not supported"),
    ({"input": "Hi?", "top_logprobs": 21}, "top_logprobs must be in"),
    ({"input": "Hi?", "include": ["file_search_call.results"]}, "include may name"),
    ({"input": []}, "input is empty"),
    ({"input": "Hi?", "tool_choice": "required"}, "tool_choice needs tools"),
])
def test_bad_requests_are_refused_in_one_line(client, ask, fragment):
    with pytest.raises(openai.BadRequestError, match=fragment):
        client.responses.create(model="tiny", max_output_tokens=4, **ask)


def test_another_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError, match="not served"):
        client.responses.create(model="other", input="Hi?", max_output_tokens=4)
