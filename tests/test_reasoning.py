"""Reasoning models' thinking (reasoning.py): where it starts, read from the prompt; the reply split into thinking
and answer, whole and streamed; grammars that hold the answer after the thinking (each mask against feeding every
token; constrained decoding against the plain loop for every proposer); the server's and LLM's `reasoning`."""

import json
import random

import pytest

from conftest import ARCHS
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.models.target import TemplateOptions
from dflash.reasoning import ThinkingDeltas, check_parser, split, thinking_of, thinking_state
from dflash.sampling import SamplingConfig
from dflash.structured import output_grammar
from dflash.tools import tool_request
from test_structured import assert_masks_are_fed, plain_constrained_loop, proposers
from test_tools import PROMPT, TOOLS, call_bias, streamed_calls

REPLIES = ["<think>\nHmm, 2+2.\n</think>\n\n4.", "\n<think>a</think>b", "<think>still thinking", "No thought.",
           "<thinking> is a word", "  <think></think>", "<think>x</thi</think>y</think>z", ""]


@pytest.fixture(scope="module")
def thinker():
    from dflash.testing import tiny_target

    return tiny_target("qwen3", vocab_size=320, logit_scale=4.0, tokenizer="hermes")


def test_where_the_thinking_starts_is_read_from_the_prompt(thinker):
    def state(**kwargs):
        long = "a long question " * 20  # more tokens than thinking_of decodes
        ids = thinker.encode_messages([{"role": "user", "content": long}], options=TemplateOptions(kwargs))
        assert thinking_of(thinker, ids, "think") == thinking_state(thinker.decode(ids))
        assert thinking_of(thinker, ids, None) is None
        return thinking_state(thinker.decode(ids))
    assert (state(), state(enable_thinking=False), state(think_open=True)) == ("optional", None, "open")
    assert check_parser("qwen3") == check_parser("deepseek_r1") == "think" and check_parser("none") is None
    with pytest.raises(UserError, match="must be one of none, think"):
        check_parser("granite")


def test_a_reply_splits_into_its_thinking_and_its_answer():
    assert split(REPLIES[0], "optional") == ("Hmm, 2+2.", "4.")
    assert split(REPLIES[2], "optional") == ("still thinking", "")  # cut short while thinking
    assert split("Hmm.</think>Yes", "open") == ("Hmm.", "Yes") and split("Hmm", "open") == ("Hmm", "")
    assert split(REPLIES[3], "optional") == (None, "No thought.") and split(REPLIES[4], "optional")[0] is None
    assert split(REPLIES[0], None) == (None, REPLIES[0])


@pytest.mark.parametrize("state", ["open", "optional", None])
def test_streamed_thinking_is_the_whole_replys_however_the_text_is_cut(state):
    rng = random.Random(0)
    for reply in REPLIES + ["Hmm.</think>Yes", "a</think>"]:
        thought, answer = split(reply, state)
        for _ in range(30):
            cuts = sorted(rng.sample(range(len(reply) + 1), min(len(reply) + 1, rng.randint(0, 5))))
            pieces = [reply[a:b] for a, b in zip([0] + cuts, cuts + [len(reply)])]
            deltas = ThinkingDeltas(state)
            parts = [deltas.push(piece) for piece in pieces] + [deltas.finish()]
            assert "".join(p[0] for p in parts).strip() == (thought or ""), (reply, pieces)
            assert "".join(p[1] for p in parts) == answer, (reply, pieces)


@pytest.mark.parametrize("thinking", ["open", "optional"])
def test_a_grammar_after_thinking_takes_any_thought_then_the_document(thinking):
    grammar = output_grammar("json_object", None, thinking)
    prefix = "" if thinking == "open" else "<think>"
    good = [prefix + "Hmm </thin <think> {x</think>\n\n{\"a\": 1}", prefix + "</think>{}"]
    if thinking == "optional":
        good.append('{"a": 1}')  # no thinking at all
    for text in good:
        state = grammar.feed_bytes(grammar.initial, text.encode())
        assert state is not None and grammar.may_end(state), text
    for text in [prefix + "Hmm", prefix + "x</think>words", prefix + "x</think>" + " " * 40 + "{}"]:
        state = grammar.feed_bytes(grammar.initial, text.encode())
        assert state is None or not grammar.may_end(state), text
    assert (grammar.feed_bytes(grammar.initial, b"Hi") is None) == (thinking == "optional")


def test_masks_while_thinking_and_after_are_every_token_fed(thinker):
    from dflash.testing import tiny_hermes_tokenizer

    tokenizer = tiny_hermes_tokenizer(320)
    # tokens that end the tag, with what may follow or not; whitespace, then a call's opening or not
    tokenizer.add_tokens(["k>", "nk>\n{", "nk> x", "</th", " [{", "\n[x", " {\""])
    for thinking, texts in [("optional", [b'<think>a<</think>\n{"a": [1]}', b'{"b": 2}', b"<th"]),
                            ("open", [b'Hmm </thi</think> \n{"a": 1}'])]:
        assert assert_masks_are_fed(output_grammar("json_object", None, thinking), texts, tokenizer) > 10
    request = tool_request(TOOLS, style="hermes")
    hermes = output_grammar(*request.output_format(), "optional")  # words may open with "<t" too: <tool_call>
    texts = [b'<think>x</think>\nSure <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
             b'<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', b"<to", b"<thinking"]
    assert assert_masks_are_fed(hermes, texts, tokenizer) > 60
    calls_or_words = output_grammar(*tool_request(TOOLS).output_format(), "optional")  # the json format's auto
    texts = [b'<think>x</think>\n [{"name": "get_time", "arguments": {}}]', b"<think></think> Hello", b"Hi"]
    assert assert_masks_are_fed(calls_or_words, texts, tokenizer) > 40


def thinking_bias(target) -> dict[int, float]:
    """call_bias, and a push towards thinking and ending the thought (samples then think, answer or both)."""
    ids = target.tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    return {**call_bias(target, None), ids[0]: 4.0, ids[1]: 3.0}


def thinking_app():
    """A server app of a tiny target with qwen3's reasoning parser, and thinking_bias as a request sends it."""
    from dflash.methods.ngram import NgramProposer
    from dflash.serving import create_app
    from dflash.testing import tiny_target

    target = tiny_target("qwen3", vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    bias = {str(k): v for k, v in thinking_bias(target).items()}
    return create_app(target, NgramProposer(max_draft=7), "tiny", reasoning_parser="qwen3"), bias


@pytest.mark.parametrize("arch", ARCHS[:2])
def test_answers_after_thinking_are_the_plain_loops_for_every_proposer(arch):
    from dflash.testing import tiny_target

    target = tiny_target(arch, vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    prompt_ids = target.encode_prompt(PROMPT)
    thought = 0
    for fmt, schema, thinking in [("json_object", None, "open"), ("json_object", None, "optional"),
                                  (*tool_request(TOOLS, "required", style="hermes").output_format(), "optional")]:
        for seed in (None, 1, 2):
            sampling = SamplingConfig(temperature=0.0 if seed is None else 0.8, seed=seed,
                                      logit_bias=thinking_bias(target))
            grammar = output_grammar(fmt, schema, thinking)
            expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=50, grammar=grammar)
            config = GenerationConfig(50, sampling=sampling, response_format=fmt, json_schema=schema,
                                      thinking=thinking)
            for name, proposer in proposers(target, expected, len(prompt_ids)).items():
                result = SpeculativeDecoder(target, proposer, adaptive=False).generate(prompt_ids, config)
                assert result.tokens == expected, (fmt, thinking, seed, name)
            reasoning, answer = split(result.text, thinking)
            thought += reasoning is not None and "</think>" in result.text
            if result.finish_reason == "stop" and fmt == "json_object":
                json.loads(answer)  # whatever the thinking, the answer after it is the document
    assert thought >= 1


def test_the_server_returns_the_thinking_apart_whole_and_streamed():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.methods.ngram import NgramProposer
    from dflash.serving import BackgroundServer, create_app
    from dflash.testing import tiny_target

    target = tiny_target("qwen3", vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    bias = {str(k): v for k, v in thinking_bias(target).items()}
    app = create_app(target, NgramProposer(max_draft=7), "tiny", reasoning_parser="qwen3")
    with BackgroundServer(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        seen = set()
        for seed in (2, 3, 5):
            for extra in ({}, {"response_format": {"type": "json_object"}}, {"tools": TOOLS, "tool_choice": "required"},
                          {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}):
                ask = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=80,
                           temperature=0.8, seed=seed, logit_bias=bias, **extra)
                whole = client.chat.completions.create(**ask).choices[0]
                message = whole.message.model_dump()
                chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **ask) if c.choices]
                deltas = [c.delta.model_dump() for c in chunks]
                thought = "".join(d.get("reasoning") or "" for d in deltas)
                assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
                assert message.get("reasoning") == message.get("reasoning_content")
                assert thought.strip() == (message.get("reasoning") or "")
                assert "".join(d.get("content") or "" for d in deltas).rstrip() == (message["content"] or "").rstrip()
                assert chunks[-1].finish_reason == whole.finish_reason
                if "extra_body" in extra:  # the prompt closed the thinking: none to split off
                    assert message.get("reasoning") is None
                thought_first = message.get("reasoning") is not None
                if thought_first and "response_format" in extra and whole.finish_reason == "stop":
                    json.loads(message["content"])
                    seen.add("json after thinking")
                if whole.finish_reason == "tool_calls":
                    calls = streamed_calls(chunks)
                    assert [(c[1], c[3]) for c in calls] == [(c.function.name, c.function.arguments)
                                                             for c in whole.message.tool_calls]
                    seen.add("calls after thinking" if message.get("reasoning") is not None else "calls")
        assert "json after thinking" in seen and "calls after thinking" in seen


def test_llm_chat_returns_the_thinking_apart(monkeypatch):
    import dflash.loading as loading
    from dflash import LLM
    from dflash.testing import tiny_target

    target = tiny_target("qwen3", vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    monkeypatch.setattr(loading, "load_target_cached", lambda *a, **k: target)
    llm = LLM("thinker", method="ngram", reasoning_parser="think")
    configured = llm._config

    def biased(*args):
        config = configured(*args)
        config.sampling.logit_bias = thinking_bias(target)
        config.sampling.temperature, config.sampling.seed = 0.8, 1
        return config
    monkeypatch.setattr(llm, "_config", biased)
    result = llm.chat([{"role": "user", "content": PROMPT}], max_new_tokens=50, response_format="json_object")
    assert (result.reasoning, result.content) == split(result.text, "optional")
    assert result.reasoning is not None and result.finish_reason == "stop" and json.loads(result.content) is not None


def test_the_output_may_not_end_while_thinking(thinker):
    """A stop token is refused while thinking (the answer is to come), in drafts and in the mask."""
    from dflash.structured import JsonConstraint, json_vocabulary

    vocabulary = json_vocabulary(thinker.tokenizer, thinker.vocab_size)
    eos = thinker.eos_token_ids[0]
    word, close = thinker.tokenizer.convert_tokens_to_ids(["a", "</think>"])
    brace, end = thinker.tokenizer.convert_tokens_to_ids(["{", "}"])
    for thinking in ("open", "optional"):
        constraint = JsonConstraint(vocabulary, output_grammar("json_object", None, thinking), {eos})
        start = [] if thinking == "open" else thinker.tokenizer.convert_tokens_to_ids(["<think>"])
        assert constraint.allowed_prefix(start, [word, eos]) == 1
        assert not constraint.mask(start, [word])[eos] and constraint.mask(start, [word])[word]
        assert constraint.allowed_prefix(start, [word, close, brace, end, eos]) == 5


def test_generate_and_batch_return_the_thinking_apart(capsys, monkeypatch, tmp_path):
    import dflash.batch as batch
    import dflash.generate as generate
    from dflash.cli import main
    from dflash.loading import load_target_cached

    target = load_target_cached("tiny-qwen3-hermes")
    for module in (generate, batch):
        configured = module.config_from_args

        def thinking(args, _configured=configured, **more):  # samples that think, then answer
            config = _configured(args, **more)
            config.sampling.logit_bias = thinking_bias(target)
            config.sampling.temperature, config.sampling.seed = 0.8, 1
            return config
        monkeypatch.setattr(module, "config_from_args", thinking)
    common = ["--target", "tiny-qwen3-hermes", "--method", "ngram", "--max-new-tokens", "50",
              "--reasoning-parser", "qwen3", "--response-format", "json_object"]
    assert main(["generate", *common, "--json", PROMPT]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert (payload["reasoning"], payload["content"]) == split(payload["text"], "optional")
    assert payload["reasoning"] is not None and json.loads(payload["content"]) is not None
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [{"id": "thinks", "prompt": PROMPT},
            {"id": "closed", "prompt": PROMPT, "chat_template_kwargs": {"enable_thinking": False}}]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert main(["batch", str(source), "--output", str(out), *common, "--no-progress"]) == 0
    answers = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert answers["thinks"]["text"] == payload["text"] and answers["thinks"]["reasoning"] == payload["reasoning"]
    assert answers["closed"]["reasoning"] is None and answers["closed"]["content"] == answers["closed"]["text"]
    source.write_text(json.dumps({"prompt": PROMPT, "chat_template_kwargs": ["x"]}) + "\n")
    assert main(["batch", str(source), "--output", str(tmp_path / "other.jsonl"), *common]) == 2
    assert "in.jsonl:1: chat_template_kwargs must be an object" in capsys.readouterr().err
