"""Prompts from user JSONL rows in the layouts people keep them in (jsonl.prompt_of), as bench and data read them."""

import pytest

from dflash.jsonl import PromptRow, prompt_of


@pytest.mark.parametrize("row, expected", [
    ({"prompt": "p"}, PromptRow(["p"])),
    ({"turns": ["a", "b"], "prompt": "a"}, PromptRow(["a", "b"])),  # MT-Bench: the turns win
    ({"turns": ["a", " "], "prompt": "a"}, PromptRow(["a"])),  # an empty turn: not a list of turns
    ({"question": "q"}, PromptRow(["q"])),
    ({"problem": "m", "solution": "s"}, PromptRow(["m"])),
    ({"query": "q"}, PromptRow(["q"])),
    ({"instruction": "Translate.", "input": "Good morning"}, PromptRow(["Translate.\n\nGood morning"])),
    ({"instruction": "Translate.", "input": ""}, PromptRow(["Translate."])),
    ({"prompt": "wins", "question": "loses", "instruction": "loses"}, PromptRow(["wins"])),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "u1"},
                   {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]},
     PromptRow(["u1", "u2"], "Be brief.")),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "look "}, {"type": "image_url"},
                                                {"type": "text", "text": "here"}]}]}, PromptRow(["look here"])),
    ({"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"},
                   {"role": "system", "content": "late"}]}, PromptRow(["u"], "d")),
    ({"conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "h1"},
                        {"from": "gpt", "value": "g1"}, {"from": "human", "value": "h2"}]},
     PromptRow(["h1", "h2"], "s")),
    ({"prompt": [{"role": "user", "content": "chat in prompt"}]}, PromptRow(["chat in prompt"])),
])
def test_each_layout_gives_its_user_turns_and_system_message(row, expected):
    assert prompt_of(row) == expected


@pytest.mark.parametrize("row", [
    {"text": "raw text is not a prompt"},
    {"prompt": "   "},
    {"messages": [{"role": "assistant", "content": "only the model speaks"}]},
    {"messages": [{"role": "system", "content": "s"}]},
    {"messages": ["not a message"]},
    {"messages": []},
    {"conversations": [{"from": "gpt", "value": "g"}]},
    ["a", "list"],
    "a string",
])
def test_rows_without_a_user_prompt_have_none(row):
    assert prompt_of(row) is None


def test_a_row_as_the_conversation_to_answer_next():
    from dflash.jsonl import conversation_of

    chat = {"messages": [{"role": "developer", "content": "d"}, {"role": "user", "content": "u1"},
                         {"role": "assistant", "content": "a1"}, {"role": "tool", "content": "t"},
                         {"role": "user", "content": "u2"}, {"role": "assistant", "content": "a2"}]}
    assert conversation_of(chat) == [{"role": "system", "content": "d"}, {"role": "user", "content": "u1"},
                                     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert conversation_of({"conversations": [{"from": "human", "value": "h"}, {"from": "gpt", "value": "g"}]}) == [
        {"role": "user", "content": "h"}]
    assert conversation_of({"question": "q"}) == [{"role": "user", "content": "q"}]
    assert conversation_of({"turns": ["one"]}) == [{"role": "user", "content": "one"}]
    assert conversation_of({"turns": ["one", "two"]}) is None  # the second follows an answer not yet given
    assert conversation_of({"messages": [{"role": "assistant", "content": "a"}]}) is None
    assert conversation_of({"text": "t"}) is None
