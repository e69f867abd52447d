"""Anthropic's Messages API (serving/messages.py) through the real anthropic client: every reply against the same
server's chat completions for the same conversation (themselves held against the engine in test_server.py), whole
and streamed (the SDK's own stream accumulator checks the events' order and builds the message); stop sequences,
tool_use and tool_result, thinking, count_tokens, errors in Anthropic's shape, and the x-api-key header."""

import json

import pytest

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from dflash.methods.ngram import NgramProposer  # noqa: E402
from dflash.serving import BackgroundServer, create_app  # noqa: E402
from dflash.serving.messages import conversation  # noqa: E402
from dflash.serving.schemas import schemas  # noqa: E402
from test_reasoning import thinking_app  # noqa: E402
from test_tools import HI, PROMPT, SHORT_TOOLS, call_bias  # noqa: E402

# SHORT_TOOLS as Anthropic lays them out
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
GREEDY = {"temperature": 0}  # Anthropic's current SDK has no sampling fields: they go as extra_body
CLIENT_TOOLS = [{"name": t["function"]["name"], **({"input_schema": t["function"]["parameters"]}
                                                   if "parameters" in t["function"] else {})} for t in SHORT_TOOLS]


@pytest.fixture(scope="module")
def servers(byte_targets):
    app = create_app(byte_targets["llama"], NgramProposer(max_draft=7), "tiny")
    with BackgroundServer(app) as url:
        yield (anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60),
               openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60))


def chat(chat_client, messages, **kwargs):
    return chat_client.chat.completions.create(model="tiny", messages=messages, **{"temperature": 0, **kwargs})


def streamed(client, **kwargs):
    """A streamed message's events and the message the SDK builds from them."""
    with client.messages.stream(model="tiny", **kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def texts(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


@pytest.mark.parametrize("system", [None, "Be brief.", [{"type": "text", "text": "Be brief."}]])
def test_text_is_the_chat_reply_whole_and_streamed(servers, system):
    client, chat_client = servers
    prefix = [{"role": "system", "content": "Be brief."}] if system else []
    for max_tokens in (40, 3):
        expected = chat(chat_client, prefix + HI, max_tokens=max_tokens)
        ask = dict(max_tokens=max_tokens, extra_body=GREEDY, messages=HI, **({"system": system} if system else {}))
        message = client.messages.create(model="tiny", **ask)
        assert texts(message) == expected.choices[0].message.content
        assert message.id.startswith("msg_") and message.role == "assistant" and message.model == "tiny"
        cut = expected.choices[0].finish_reason == "length"
        assert message.stop_reason == ("max_tokens" if cut else "end_turn") and message.stop_sequence is None
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.usage.prompt_tokens
        assert message.usage.output_tokens == expected.usage.completion_tokens
        events, final = streamed(client, **ask)
        assert texts(final) == texts(message) and final.stop_reason == message.stop_reason
        assert final.usage.output_tokens == message.usage.output_tokens
        kinds = [event.type for event in events]
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        if texts(message):
            assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    counted = client.messages.count_tokens(model="tiny", messages=HI, **({"system": system} if system else {}))
    assert counted.input_tokens == expected.usage.prompt_tokens
    import httpx

    metrics = httpx.get(f"{str(client.base_url).rstrip('/')}/metrics").text
    assert 'dflash_requests_total{endpoint="/v1/messages",status="200"}' in metrics  # counted as its own endpoint


def test_a_stop_sequence_ends_the_reply_and_is_named(servers, byte_targets):
    client, chat_client = servers
    ids = byte_targets["llama"].tokenizer.convert_tokens_to_ids
    letters = {str(ids(c)): 4.0 for c in "abcdefghijklmnopqrstuvwxyz"}  # a reply of words, to stop inside
    sampled = {"logit_bias": letters, "seed": 7, "temperature": 1.0}
    reply = chat(chat_client, HI, max_tokens=40, **sampled).choices[0].message.content
    at = next(k for k in range(3, len(reply) - 2) if reply.find(reply[k:k + 2]) == k and reply[k:k + 2].isalpha())
    sequence = reply[at:at + 2]
    ask = dict(max_tokens=40, extra_body=sampled, messages=HI, stop_sequences=[sequence, "never written"])
    message = client.messages.create(model="tiny", **ask)
    assert texts(message) == reply[:reply.find(sequence)]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", sequence)
    final = streamed(client, **ask)[1]
    assert (texts(final), final.stop_reason, final.stop_sequence) == (texts(message), "stop_sequence", sequence)


def test_tool_use_is_the_chat_calls_whole_and_streamed(servers, byte_targets):
    client, chat_client = servers
    bias = {str(k): v for k, v in call_bias(byte_targets["llama"], None).items()}
    named = {"type": "function", "function": {"name": "clock"}}
    for choice, chat_choice in [({"type": "any"}, "required"), ({"type": "tool", "name": "clock"}, named)]:
        expected = chat(chat_client, HI, max_tokens=60, tools=SHORT_TOOLS, tool_choice=chat_choice,
                        parallel_tool_calls=False, logit_bias=bias).choices[0].message.tool_calls
        ask = dict(max_tokens=60, messages=HI, tools=CLIENT_TOOLS, extra_body={"logit_bias": bias, **GREEDY},
                   tool_choice={**choice, "disable_parallel_tool_use": True})
        message = client.messages.create(model="tiny", **ask)
        calls = [block for block in message.content if block.type == "tool_use"]
        assert [(c.name, c.input) for c in calls] == [(c.function.name, json.loads(c.function.arguments))
                                                      for c in expected]
        assert message.stop_reason == "tool_use" and texts(message) == ""
        assert all(c.id.startswith("toolu_") for c in calls)
        events, final = streamed(client, **ask)
        assert [(c.name, c.input) for c in final.content if c.type == "tool_use"] == [(c.name, c.input) for c in calls]
        pieces = [e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        assert "".join(e.delta.partial_json for e in pieces) == "".join(c.function.arguments for c in expected)
        assert final.stop_reason == "tool_use"
    # the call and its result sent back: the conversation chat sees with tool_calls and a tool turn
    history = HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "noon"}]
    after = client.messages.create(model="tiny", max_tokens=8, extra_body=GREEDY, tools=CLIENT_TOOLS, messages=HI + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "clock", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}]}])
    expected = chat(chat_client, history, tools=SHORT_TOOLS, max_tokens=8)
    assert texts(after) == (expected.choices[0].message.content or "")
    assert after.usage.input_tokens + after.usage.cache_read_input_tokens == expected.usage.prompt_tokens


def test_a_prefill_is_gone_on_with(servers):
    """A conversation that ends with the assistant's words goes on with them (chat's continue_final_message)."""
    client, chat_client = servers
    prefilled = HI + [{"role": "assistant", "content": "Well,"}]
    expected = chat(chat_client, prefilled, max_tokens=12, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    message = client.messages.create(model="tiny", max_tokens=12, messages=prefilled, extra_body=GREEDY)
    assert texts(message) == expected.choices[0].message.content
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == expected.usage.prompt_tokens
    assert client.messages.count_tokens(model="tiny", messages=prefilled).input_tokens == expected.usage.prompt_tokens
    import httpx

    new_turn = httpx.post(f"{str(client.base_url).rstrip('/')}/tokenize", json={"messages": prefilled}).json()
    assert new_turn["count"] != expected.usage.prompt_tokens  # the prefill is not closed and a new turn opened


def test_thinking_comes_back_as_its_own_block():
    app, bias = thinking_app()
    thought = 0
    with BackgroundServer(app) as url:
        client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
        chat_client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for seed in (2, 3, 5):
            # JSON after the thinking (output_config's schema, chat's response_format): the grammar lets a random
            # model think first
            expected = chat_client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=80, temperature=0.8,
                seed=seed, logit_bias=bias, response_format={"type": "json_schema", "json_schema": {
                    "name": "output", "schema": SCHEMA}}).choices[0].message.model_dump()
            ask = dict(max_tokens=80, messages=[{"role": "user", "content": PROMPT}],
                       output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
                       extra_body={"logit_bias": bias, "seed": seed, "temperature": 0.8})
            message = client.messages.create(model="tiny", **ask)
            thinking = [block.thinking for block in message.content if block.type == "thinking"]
            assert thinking == [expected.get("reasoning")] * bool(expected.get("reasoning"))
            assert texts(message) == (expected["content"] or "")
            final = streamed(client, **ask)[1]
            assert [b.thinking.strip() for b in final.content if b.type == "thinking"] == thinking
            assert texts(final).rstrip() == texts(message).rstrip()
            thought += bool(thinking)
            if thinking:  # the thinking goes back to the template with the reply in the next turn
                turn = {"role": "assistant", "content": [b.model_dump() for b in message.content]}
                after = client.messages.count_tokens(model="tiny", messages=ask["messages"] + [turn, {
                    "role": "user", "content": "And?"}])
                assert after.input_tokens > message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert thought


def test_blocks_become_the_chat_conversation():
    body = schemas().MessagesRequest(model="tiny", max_tokens=4, system=[{"type": "text", "text": "Be brief."}],
                                     messages=[
        {"role": "user", "content": [{"type": "text", "text": "<reminder>"}, {"type": "text", "text": "Hi?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Hmm.", "signature": "x"}, {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "t1", "name": "clock", "input": {}},
            {"type": "tool_use", "id": "t2", "name": "weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": "noon"},
            {"type": "tool_result", "tool_use_id": "t2", "content": [{"type": "text", "text": "sun"}]},
            {"type": "text", "text": "Thanks."}]}])
    assert conversation(body) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "<reminder>\n\nHi?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Hmm.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "clock", "arguments": "{}"}},
            {"id": "t2", "type": "function", "function": {"name": "weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "noon"},
        {"role": "tool", "tool_call_id": "t2", "content": "sun"}, {"role": "user", "content": "Thanks."}]


@pytest.mark.parametrize("ask, fragment", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image' blocks"),
    ({"messages": [{"role": "system", "content": "x"}]}, "role must be user or assistant"),
    ({"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "only client tools"),
    ({"messages": HI, "tools": CLIENT_TOOLS, "tool_choice": {"type": "some"}}, "tool_choice must be"),
    ({"messages": HI, "tool_choice": {"type": "any"}}, "tool_choice needs tools"),
    ({"messages": HI, "system": [{"type": "image"}]}, "only text blocks"),
])
def test_bad_requests_are_refused_in_anthropics_shape(servers, ask, fragment):
    client = servers[0]
    with pytest.raises(anthropic.BadRequestError, match=fragment) as caught:
        client.messages.create(model="tiny", max_tokens=4, **ask)
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "invalid_request_error"


def test_missing_fields_and_other_models_are_refused(servers):
    client = servers[0]
    with pytest.raises(anthropic.UnprocessableEntityError, match="max_tokens"):
        client.post("/v1/messages", body={"model": "tiny", "messages": HI}, cast_to=object)
    with pytest.raises(anthropic.NotFoundError, match="not served") as caught:
        client.messages.create(model="other", max_tokens=4, messages=HI)
    assert caught.value.body["error"]["type"] == "not_found_error"


def test_an_api_key_is_taken_from_x_api_key(byte_targets):
    app = create_app(byte_targets["llama"], NgramProposer(max_draft=7), "tiny", api_key="sesame")
    with BackgroundServer(app) as url:
        keyed = anthropic.Anthropic(base_url=url, api_key="sesame", max_retries=0, timeout=60)
        assert keyed.messages.create(model="tiny", max_tokens=2, messages=HI).type == "message"
        wrong = anthropic.Anthropic(base_url=url, api_key="open", max_retries=0, timeout=60)
        with pytest.raises(anthropic.AuthenticationError, match="x-api-key") as caught:
            wrong.messages.create(model="tiny", max_tokens=2, messages=HI)
        assert caught.value.body["error"]["type"] == "authentication_error"


def test_a_stop_sequence_is_named_in_the_text_without_special_tokens(servers, byte_targets):
    """With skip_special_tokens (vLLM's field, which the server takes here too) the stop sequence that ended the
    reply is found in the text the reply is, special tokens left out."""
    client, chat_client = servers
    ids = byte_targets["llama"].tokenizer.convert_tokens_to_ids
    letters = {str(ids(c)): 4.0 for c in "abcdefghijklmnopqrstuvwxyz"}
    sampled = {"logit_bias": {**letters, str(ids("<mask>")): 6.0}, "seed": 7, "temperature": 1.0}
    kept = chat(chat_client, HI, max_tokens=40, **sampled).choices[0].message.content
    bare = chat(chat_client, HI, max_tokens=40, **sampled, extra_body={"skip_special_tokens": True})
    bare = bare.choices[0].message.content
    assert "<mask>" in kept and bare == kept.replace("<mask>", "")
    at = next(k for k in range(1, len(bare) - 1) if bare.find(bare[k:k + 2]) == k and bare[k:k + 2] not in kept)
    sequence = bare[at:at + 2]  # spans a special token the text leaves out
    message = client.messages.create(model="tiny", max_tokens=40, messages=HI, stop_sequences=[sequence],
                                     extra_body={**sampled, "skip_special_tokens": True})
    assert texts(message) == bare[:at]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", sequence)
