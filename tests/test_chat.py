"""`dflash chat`: turns from standard input, each reply the target's own greedy answer to the whole conversation,
old exchanges dropped to fit, Ctrl-C stopping a reply cleanly."""

import io
import os
import signal

import pytest

from dflash.chat import Conversation, StopOnInterrupt
from dflash.cli import main
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.models.target import TemplateOptions
from dflash.testing import tiny_target


def chat(capsys, monkeypatch, lines, *argv):
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    code = main(["chat", "--target", "tiny-qwen2", "--max-new-tokens", "10", "--quiet", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def ar_replies(turns, system=None, max_new=10):
    """Plain greedy decoding of each turn after the conversation so far (its own earlier replies), /reset honoured"""
    target = tiny_target("qwen2", logit_scale=4.0)  # the CLI's tiny-qwen2: its replies follow its context
    decoder, replies = SpeculativeDecoder(target), []
    opening = [{"role": "system", "content": system}] if system else []
    messages = list(opening)
    for turn in turns:
        if turn == "/reset":
            messages = list(opening)
            continue
        messages.append({"role": "user", "content": turn})
        reply = decoder.generate(target.encode_messages(messages), GenerationConfig(max_new_tokens=max_new)).text
        messages.append({"role": "assistant", "content": reply})
        replies.append(reply)
    return replies


@pytest.mark.parametrize("method", ["ngram", "dflash+ngram"])
def test_each_reply_is_the_targets_own_answer_to_the_conversation(capsys, monkeypatch, method):
    turns = ["w1 w2 w3", "w4 w5", "/reset", "w4 w5"]
    code, out, err = chat(capsys, monkeypatch, turns, "--method", method, "--system", "w9 w8")
    replies = ar_replies(turns, "w9 w8")
    assert code == 0 and out == "".join(reply + "\n" for reply in replies)
    assert replies[1] != replies[2]  # the same words after the first exchange and after /reset: its context told


def test_blank_lines_are_skipped_and_exit_ends_the_chat(capsys, monkeypatch):
    code, out, _ = chat(capsys, monkeypatch, ["", "w1 w2", "/exit", "w3"], "--method", "ngram")
    assert code == 0 and out == ar_replies(["w1 w2"])[0] + "\n"


def test_the_oldest_exchanges_go_first_when_the_conversation_outgrows_the_room():
    target = tiny_target("llama")
    conversation = Conversation("w9", [("w1 " * 20, "w2 " * 20), ("w3", "w4"), ("w5", "w6")])
    whole = len(target.encode_messages(conversation.messages("w7")))
    ids, dropped = conversation.fit(target.encode_messages, "w7", whole - 1)
    assert dropped == 1 and conversation.exchanges == [("w3", "w4"), ("w5", "w6")]
    assert ids == target.encode_messages(conversation.messages("w7")) and len(ids) < whole
    ids, dropped = conversation.fit(target.encode_messages, "w7", len(ids))
    assert dropped == 0 and len(conversation.exchanges) == 2
    with pytest.raises(UserError, match="no room"):
        conversation.fit(target.encode_messages, "w7 " * 50, 10)
    assert conversation.system == "w9" and conversation.exchanges == []


def test_a_message_too_long_for_the_context_is_said_and_the_chat_goes_on(capsys, monkeypatch):
    code, out, err = chat(capsys, monkeypatch, ["w1 " * 5000, "w1 w2"], "--method", "ngram")
    assert code == 0 and "no room for a reply" in err and "Traceback" not in err
    assert out == ar_replies(["w1 w2"])[0] + "\n"


def test_ctrl_c_during_a_reply_asks_it_to_stop_instead_of_raising():
    before = signal.getsignal(signal.SIGINT)
    with StopOnInterrupt() as stop:
        assert not stop.asked
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt inside the engine
        assert stop.asked
    assert signal.getsignal(signal.SIGINT) is before


def test_a_stopped_reply_is_cut_cleanly_and_kept_in_the_conversation(capsys, monkeypatch):
    """SIGINT after the first committed tokens: the reply ends there ('cancelled'), a prefix of the whole one"""
    from dflash import chat as chat_module

    real = chat_module.LiveText

    class InterruptingText(real):
        def __call__(self, new_ids):
            super().__call__(new_ids)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(chat_module, "LiveText", InterruptingText)
    monkeypatch.setattr("sys.stdin", io.StringIO("w1 w2 w3\n"))
    assert main(["chat", "--target", "tiny-qwen2", "--method", "ngram", "--max-new-tokens", "30"]) == 0
    out, err = capsys.readouterr()
    assert "(stopped)" in err
    whole = ar_replies(["w1 w2 w3"], max_new=30)[0]
    assert whole.startswith(out.rstrip("\n")) and len(out.rstrip("\n")) < len(whole)


def test_the_templates_own_variables_reach_every_turn(capsys, monkeypatch):
    """--chat-template-kwargs: a Qwen3-like template that closes the thinking in the prompt when enable_thinking is
    false; the replies are the target's own to those prompts."""
    lines = ["Hi", "More"]
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(line + "\n" for line in lines)))
    argv = ["chat", "--target", "tiny-qwen2-hermes", "--max-new-tokens", "6", "--method", "ngram",
            "--chat-template-kwargs", '{"enable_thinking": false}']
    assert main(argv) == 0
    out, err = capsys.readouterr()
    target = tiny_target("qwen2", vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    ids = target.encode_messages([{"role": "user", "content": "Hi"}],
                                 options=TemplateOptions({"enable_thinking": False}))
    assert target.decode(ids).endswith("<assistant> <think>\n\n</think>\n\n")
    first = SpeculativeDecoder(target).generate(ids, GenerationConfig(max_new_tokens=6)).text
    assert out.startswith(first) and f"prompt {len(ids)} tokens" in err
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\n"))
    assert main(argv[:-1] + ["[1]"]) == 2
    assert "chat_template_kwargs must be an object" in capsys.readouterr().err


def test_a_reasoning_parser_keeps_each_replys_thinking_apart(capsys, monkeypatch):
    """--reasoning-parser: each reply streams whole (thinking too); the conversation keeps its answer as the content
    and its thinking as `reasoning_content`, and a JSON answer comes after the thinking."""
    import dflash.chat as chat_module
    from dflash.loading import load_target_cached
    from dflash.reasoning import split
    from test_reasoning import thinking_bias

    target = load_target_cached("tiny-qwen3-hermes")
    configured, kept = chat_module.config_from_args, []

    def thinking(args, **more):  # samples that think, then answer
        config = configured(args, **more)
        config.sampling.logit_bias = thinking_bias(target)
        config.sampling.temperature, config.sampling.seed = 0.8, 1
        return config

    messages = chat_module.Conversation.messages
    monkeypatch.setattr(chat_module, "config_from_args", thinking)
    monkeypatch.setattr(chat_module.Conversation, "messages",
                        lambda self, user: kept.append(messages(self, user)) or kept[-1])
    monkeypatch.setattr("sys.stdin", io.StringIO("Hi\nMore\n"))
    argv = ["chat", "--target", "tiny-qwen3-hermes", "--method", "ngram", "--max-new-tokens", "50", "--quiet",
            "--reasoning-parser", "qwen3", "--response-format", "json_object"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    earlier = kept[-1][1]  # the first reply, as the second turn's conversation holds it
    assert earlier["role"] == "assistant" and earlier["content"].startswith("{")  # JSON after the thought
    shown = out[: out.index(earlier["content"]) + len(earlier["content"])]  # the first reply as it streamed
    assert shown.startswith("<think>") and earlier["reasoning_content"]
    assert split(shown, "optional") == (earlier["reasoning_content"], earlier["content"])
