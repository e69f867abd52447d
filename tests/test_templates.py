"""How a conversation goes through the chat template: the template's own variables (chat_template_kwargs, as
Qwen3's enable_thinking), continue_final_message (a reply's start written for the target) and a template's own
errors, in the server, LLM and generate, as vLLM and SGLang take them."""

import json

import pytest

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.models.target import TemplateOptions

# the byte target's template, and a variable of its own: `mood` written before the reply, `strict` refusing a
# conversation that does not open with a user turn (as Qwen's templates raise_exception)
TEMPLATE = (
    "{% if strict and messages[0].role != 'user' %}{{ raise_exception('the first turn must be the user') }}"
    "{% endif %}{% for m in messages %}{{ '<user> ' if m.role == 'user' else '<assistant> ' }}{{ m.content }}"
    "{% if not loop.last or add_generation_prompt %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% if mood %}({{ mood }}) {% endif %}{% endif %}"
)
HI = [{"role": "user", "content": "Hi?"}]
STARTED = HI + [{"role": "assistant", "content": "Well,"}]


@pytest.fixture(scope="module")
def target():
    from dflash.testing import tiny_target

    target = tiny_target("llama", vocab_size=320, logit_scale=4.0, tokenizer="bytes")
    target.tokenizer.chat_template = TEMPLATE
    return target


def text_of(target, messages, **options) -> str:
    return target.tokenizer.decode(target.encode_messages(messages, options=TemplateOptions(**options)))


def test_the_templates_own_variables_and_a_continued_reply(target):
    assert text_of(target, HI) == "<user> Hi? <assistant> "
    assert text_of(target, HI, kwargs={"mood": "glad"}) == "<user> Hi? <assistant> (glad) "
    assert text_of(target, STARTED, add_generation_prompt=False, continue_final_message=True) == \
        "<user> Hi? <assistant> Well,"  # no new turn: the reply goes on from "Well,"


@pytest.mark.parametrize("messages, options, fragment", [
    (HI, {"kwargs": {"tools": []}}, "may not set tools"),
    (HI, {"kwargs": ["mood"]}, "must be an object"),
    (HI, {"continue_final_message": True}, "send it with add_generation_prompt false"),
    (HI, {"continue_final_message": True, "add_generation_prompt": False}, "needs an assistant message last"),
    ([{"role": "assistant", "content": "x"}], {"kwargs": {"strict": True}}, "refused these messages: the first turn"),
])
def test_bad_template_options_are_refused_in_one_line(target, messages, options, fragment):
    with pytest.raises(UserError, match=fragment):
        target.encode_messages(messages, options=TemplateOptions(**options))


def test_the_server_takes_template_options_as_vllm_does(target):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    import httpx

    from dflash.methods.ngram import NgramProposer
    from dflash.serving import BackgroundServer, create_app

    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        tokenized = httpx.post(f"{url}/tokenize", json={"messages": HI, "chat_template_kwargs": {"mood": "glad"}})
        assert target.tokenizer.decode(tokenized.json()["tokens"]) == "<user> Hi? <assistant> (glad) "
        for messages, extra in [(HI, {"chat_template_kwargs": {"mood": "glad"}}),
                                (STARTED, {"continue_final_message": True, "add_generation_prompt": False})]:
            answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                    extra_body=extra)
            ids = target.encode_messages(messages, options=TemplateOptions(
                extra.get("chat_template_kwargs", {}), extra.get("add_generation_prompt", True),
                extra.get("continue_final_message", False)))
            expected = SpeculativeDecoder(target).generate(ids, GenerationConfig(12))
            assert answer.choices[0].message.content == expected.text
            assert answer.usage.prompt_tokens == len(ids)
        for extra, fragment in [({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
                                ({"continue_final_message": True}, "add_generation_prompt false"),
                                ({"chat_template_kwargs": {"strict": True}}, "the first turn must be the user")]:
            messages = [{"role": "system", "content": "x"}] + HI if "strict" in str(extra) else HI
            with pytest.raises(openai.BadRequestError, match=fragment):
                client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, extra_body=extra)


def test_llm_and_generate_pass_the_templates_variables(capsys, monkeypatch, target):
    import dflash.loading as loading
    from dflash import LLM
    from dflash.cli import main

    real = loading.load_target_cached
    monkeypatch.setattr(loading, "load_target_cached", lambda spec, *a, **k: target if spec == "templated"
                        else real(spec, *a, **k))
    llm = LLM("templated", method="ngram")
    result = llm.chat(HI, max_new_tokens=6, chat_template_kwargs={"mood": "glad"})
    assert result.stats.prompt_tokens == len(target.encode_messages(HI, options=TemplateOptions({"mood": "glad"})))
    continued = llm.chat(STARTED, max_new_tokens=6, continue_final_message=True)
    ids = target.encode_messages(STARTED, options=TemplateOptions({}, False, True))
    assert continued.tokens == SpeculativeDecoder(target).generate(ids, GenerationConfig(6)).tokens
    argv = ["generate", "--target", "templated", "--method", "ngram", "--max-new-tokens", "6", "--json"]
    assert main(argv + ["--chat-template-kwargs", '{"mood": "glad"}', "Hi?"]) == 0
    payload = json.loads(capsys.readouterr().out)
    ids = target.encode_messages(HI, options=TemplateOptions({"mood": "glad"}))
    assert payload["tokens"] == SpeculativeDecoder(target).generate(ids, GenerationConfig(6)).tokens
    for bad, message in [(["--chat-template-kwargs", "[1]"], "must be an object"),
                         (["--chat-template-kwargs", '{"a": 1}', "--no-chat"], "drop --no-chat")]:
        assert main(argv + bad + ["Hi?"]) == 2
        assert message in capsys.readouterr().err


def test_a_chat_template_given_on_the_command_line_replaces_the_targets(capsys, tmp_path):
    from dflash.cli import main
    from dflash.loading import load_target_cached

    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE.replace("{% if mood %}", "{% if true %}").replace("{{ mood }}", "x"))
    argv = ["generate", "--target", "tiny-llama-bytes", "--method", "ngram", "--max-new-tokens", "4", "--json"]
    reference = load_target_cached("tiny-llama-bytes")
    for given in (str(template), template.read_text()):
        assert main(argv + ["--chat-template", given, "Hi?"]) == 0
        payload = json.loads(capsys.readouterr().out)
        reference.tokenizer.chat_template = template.read_text()
        expected = SpeculativeDecoder(reference).generate(reference.encode_prompt("Hi?"), GenerationConfig(4))
        assert reference.decode(reference.encode_prompt("Hi?")).endswith("<assistant> (x) ")
        assert payload["tokens"] == expected.tokens
    for given, message in [(str(tmp_path / "none.jinja"), "no such file"), ("{% if %}", "does not parse as Jinja")]:
        assert main(argv + ["--chat-template", given, "Hi?"]) == 2
        assert message in capsys.readouterr().err


def test_a_chat_template_given_for_one_call_replaces_the_targets_for_it_alone(target):
    """LLM.chat(chat_template=...) as vLLM's: these conversations through that template (its text, or a file), the
    target's own template untouched; one that does not parse is a UserError before anything runs."""
    from dflash.llm import LLM

    own = target.tokenizer.chat_template
    mine = ("{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}>{% endif %}")
    assert text_of(target, HI, template=mine) == "[user] Hi? >" != text_of(target, HI)
    assert target.tokenizer.chat_template == own
    llm = LLM("tiny-llama-bytes", "ngram", device="cpu")
    theirs = llm.target.tokenizer.chat_template
    result = llm.chat(HI, 4, chat_template=mine)
    assert result.prompt == "[user] Hi? >" and llm.target.tokenizer.chat_template == theirs
    assert llm.chat(HI, 4).prompt_token_ids != result.prompt_token_ids
    with pytest.raises(UserError, match="does not parse as Jinja"):
        llm.chat(HI, 4, chat_template="{% if %}")
