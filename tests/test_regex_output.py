"""Outputs held to a regular expression or a list of choices (regex_grammar.py, vLLM's structured outputs `regex`
and `choice`): the grammar against Python's re.fullmatch, masks against feeding every token, constrained decoding
against the plain constrained loop for every proposer (greedy and seeded), and the server, LLM and CLI surfaces."""

import json
import random
import re

import pytest

from conftest import ARCHS
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.methods.ngram import NgramProposer
from dflash.regex_grammar import PatternGrammar, choice_expression, pattern_format, unanchored
from dflash.sampling import SamplingConfig
from test_structured import (assert_held_like_the_plain_loop, assert_masks_are_fed, plain_constrained_loop,
                             proposers)

CHOICES = ["C++", "a.b", "(x)", "naïve", "yes", "yes!"]
EXPRESSIONS = [r"(?P<area>\d{3})-(?P<number>\d{4})", r"(yes|no|maybe)", r"[a-z]+( [a-z]+)*", r"é+x?ü{0,2}",
               r"(ab|a)*c", r"^\w+@\w+\.com$", r"[^a-c]{2,3}", choice_expression(CHOICES)]
ALPHABET = "abcxyz019-@. é\u00fc\u4e2d!+()C"


def matches(grammar: PatternGrammar, text: str) -> bool:
    state = grammar.feed_bytes(grammar.initial, text.encode())
    return state is not None and grammar.may_end(state)


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_the_grammar_matches_whole_outputs_as_python_does(expression):
    """Whole matches as re.fullmatch's (ASCII classes, as the pattern subset's); every prefix of a match, byte by
    byte through its multi-byte characters, is a live state; a refused text is refused at its first byte no match
    continues."""
    grammar, rng = PatternGrammar(expression), random.Random(0)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8))) for _ in range(2000)]
    examples = CHOICES + ["555-1234", "maybe", "ab ab", "éxü", "aabac", "me@home.com", "xyz", "中!"]
    for example in examples * 20:  # near misses: a character changed, added or dropped
        at = rng.randint(0, len(example))
        texts.append(example[:at] + rng.choice(["", rng.choice(ALPHABET)]) + example[at + rng.randint(0, 1):])
    texts += examples
    found = 0
    for text in texts:
        expected = re.fullmatch(unanchored(expression), text, re.ASCII) is not None
        assert matches(grammar, text) == expected, (expression, text)
        if expected:
            found += 1
            data = text.encode()
            assert all(grammar.feed_bytes(grammar.initial, data[:n]) is not None for n in range(len(data)))
    assert found >= 2


def test_choices_match_exactly_themselves():
    grammar = PatternGrammar(choice_expression(CHOICES))
    assert all(matches(grammar, choice) for choice in CHOICES)
    assert not any(matches(grammar, text) for text in ["C+", "axb", "x", "naive", "yes!!", ""])
    state = grammar.feed_bytes(grammar.initial, b"yes")
    assert grammar.may_end(state) and not grammar.finished(state)  # "yes!" may go on
    assert grammar.finished(grammar.feed_bytes(grammar.initial, b"yes!"))
    assert unanchored(r"^a\$") == r"a\$" and unanchored(r"a\\$") == "a\\\\"
    assert matches(PatternGrammar(r"(?<digit>\d)x"), "1x")  # ECMA's named groups, as JSON Schema's patterns write


@pytest.mark.parametrize("expression", [r"\d{2}(\.\d)?", choice_expression(CHOICES), r"[a-z]{1,4}!"])
@pytest.mark.parametrize("share", [0, 10**9], ids=["walked", "tabled"])
def test_masks_are_every_token_fed(expression, share, monkeypatch):
    import dflash.structured as structured

    monkeypatch.setattr(structured, "TABLE_SHARE", share)
    rng = random.Random(1)
    grammar = PatternGrammar(expression)
    texts = [t for t in ("".join(rng.choice(ALPHABET) for _ in range(6)) for _ in range(400)) if matches(grammar, t)]
    texts += [c for c in CHOICES if matches(grammar, c)] + ["12.5", "ab!"]
    assert assert_masks_are_fed(grammar, [t.encode() for t in texts if matches(grammar, t)]) > 3


@pytest.mark.parametrize("arch", ARCHS)
def test_constrained_outputs_are_the_plain_loops_for_every_proposer(byte_targets, arch):
    target = byte_targets[arch]
    prompt_ids = target.encode_prompt("Is it good?")
    for expression in (choice_expression(["positive", "negative", "neutral"]), r"[0-9]{1,3}(\.[0-9])? (kg|g)"):
        for result in assert_held_like_the_plain_loop(target, prompt_ids, PatternGrammar(expression), "regex",
                                                      {"regex": expression}):
            assert result.finish_reason == "stop" and re.fullmatch(expression, result.text), result.text


def test_a_choices_rest_is_drafted_free_once_its_first_bytes_decide_it(byte_targets, monkeypatch):
    from test_control import FakeClock

    target = byte_targets["llama"]
    prompt_ids = target.encode_prompt("Pick one.")
    expression = choice_expression(["an extraordinarily long answer", "brief"])
    config = GenerationConfig(60, response_format="regex", json_schema={"regex": expression})
    proposer, clock = NgramProposer(max_draft=7), FakeClock()
    with monkeypatch.context() as patched:  # costs that a busy machine cannot change
        clock.install(patched, target, proposer)
        decoder = SpeculativeDecoder(target, proposer, timer=clock)
        results = [decoder.generate(prompt_ids, config) for _ in range(2)]  # the second knows the costs
    assert results[0].tokens == results[1].tokens
    assert results[1].text == "an extraordinarily long answer"  # this random target's pick
    assert results[1].stats.lookup_rounds >= 1 and results[1].stats.num_rounds < len(results[1].tokens) // 2


@pytest.mark.parametrize("regex, choice, fragment", [
    ("a", ["b"], "not both"), (None, [], "non-empty strings"), (None, ["a", ""], "non-empty strings"),
    (r"(?=a)", None, "lookaround"), (r"(?<=a)b", None, "lookaround"), (r"(?i)a", None, "a flag"),
    (r"\bword", None, "escape"), (3, None, "must be a string"),
])
def test_bad_expressions_are_refused_in_one_line(regex, choice, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        pattern_format(regex, choice)


@pytest.mark.parametrize("thinking", ["open", "optional"])
def test_a_pattern_after_thinking_takes_any_thought_then_a_match(thinking):
    from dflash.testing import tiny_target

    grammar = PatternGrammar(r"(yes|no)\.").thinking_first(thinking)
    prefix = "" if thinking == "open" else "<think>"
    for text, whole in [(prefix + "Hmm </thin {x</think>\n\nyes.", True), (prefix + "</think>no.", True),
                        (prefix + "Hmm", False), (prefix + "x</think>maybe", None), (prefix + "x</think>yes", False)]:
        state = grammar.feed_bytes(grammar.initial, text.encode())
        assert (None if state is None else grammar.may_end(state)) == whole, text
    assert matches(grammar, "no.") == (thinking == "optional")  # no thinking at all, where it is optional
    hermes = tiny_target("qwen3", vocab_size=320, logit_scale=4.0, tokenizer="hermes").tokenizer
    texts = [prefix + "Hm <th </think>\n yes.", prefix + "</think>no.", "no."[: 3 * (thinking == "optional")]]
    assert assert_masks_are_fed(grammar, [t.encode() for t in texts if t], hermes) > 10


@pytest.mark.parametrize("arch", ARCHS[:2])
def test_answers_after_thinking_are_the_plain_loops_for_every_proposer(arch):
    from dflash.testing import tiny_target
    from test_reasoning import thinking_bias

    target = tiny_target(arch, vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    prompt_ids = target.encode_prompt("Is it good?")
    expression = choice_expression(["positive", "negative"])
    thought = 0
    for thinking in ("open", "optional"):
        grammar = PatternGrammar(expression).thinking_first(thinking)
        for seed in (1, 2):
            sampling = SamplingConfig(temperature=0.9, seed=seed, logit_bias=thinking_bias(target))
            expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=40, grammar=grammar)
            config = GenerationConfig(40, sampling=sampling, response_format="regex", json_schema={"regex": expression},
                                      thinking=thinking)
            for name, proposer in proposers(target, expected, len(prompt_ids)).items():
                result = SpeculativeDecoder(target, proposer).generate(prompt_ids, config)
                assert result.tokens == expected, (name, thinking, seed)
            thought += "</think>" in result.text
            if result.finish_reason == "stop":
                assert result.text.split("</think>")[-1].strip() in ("positive", "negative"), result.text
    assert thought


def test_the_server_takes_vllms_structured_outputs(byte_targets):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.serving import BackgroundServer, create_app

    target = byte_targets["qwen3"]
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(extra, endpoint="chat", **kwargs):
            if endpoint == "chat":
                reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi?"}],
                                                       max_tokens=30, temperature=0, extra_body=extra, **kwargs)
                return reply.choices[0].message.content
            if endpoint == "responses":
                return client.responses.create(model="tiny", input="Hi?", max_output_tokens=30, temperature=0,
                                               extra_body=extra, **kwargs).output_text
            return client.completions.create(model="tiny", prompt="Hi?", max_tokens=30, temperature=0,
                                             extra_body=extra, **kwargs).choices[0].text

        colours = ["red", "green", "blue"]
        for endpoint in ("chat", "completions", "responses"):
            assert ask({"structured_outputs": {"choice": colours}}, endpoint) in colours
            assert ask({"guided_choice": colours}, endpoint) == ask({"structured_outputs": {"choice": colours}},
                                                                     endpoint)
            assert re.fullmatch(r"\d{2}-\d{2}", ask({"guided_regex": r"\d{2}-\d{2}"}, endpoint))
            sglang = ask({"regex": r"\d{2}-\d{2}"}, endpoint)  # SGLang's field
            assert sglang == ask({"guided_regex": r"\d{2}-\d{2}"}, endpoint)
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
        via_openai = ask({}, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
        assert ask({"structured_outputs": {"json": schema}}) == ask({"guided_json": json.dumps(schema)}) == via_openai
        assert ask({"structured_outputs": {"json_object": True}}) == ask({}, response_format={"type": "json_object"})
        for extra, kwargs, fragment in [
            ({"structured_outputs": {"structural_tag": {"x": 1}}}, {}, "triggers must be a non-empty list"),
            ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, {}, "one constraint"),
            ({"regex": "a", "guided_regex": "a"}, {}, "one constraint"),
            ({"guided_regex": "(?=a)"}, {}, "lookaround"),
            ({"guided_choice": ["a"]}, {"response_format": {"type": "json_object"}}, "each constrain"),
            ({"guided_json": "{"}, {}, "must be a JSON Schema"),
        ]:
            with pytest.raises(openai.BadRequestError, match=fragment):
                ask(extra, **kwargs)


def test_llm_and_generate_take_a_regex_or_a_choice(capsys, monkeypatch):
    from dflash.cli import main
    from dflash.llm import LLM

    llm = LLM("tiny-qwen2-bytes", method="ngram")
    results = llm.generate(["Hi?", "Colour?"], 20, choice=["red", "green"])
    assert all(r.text in ("red", "green") for r in results)
    assert re.fullmatch(r"[ab]{3}", llm.chat([{"role": "user", "content": "Hi?"}], 20, regex=r"[ab]{3}").text)
    with pytest.raises(UserError, match="each constrain"):
        llm.generate("Hi?", 8, response_format="json_object", choice=["a"])
    argv = ["generate", "--target", "tiny-qwen2-bytes", "--method", "ngram", "--max-new-tokens", "20", "--json"]
    assert main(argv + ["--choice", "yes", "no", "--", "Hi?"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] in ("yes", "no")
    assert main(argv + ["--regex", r"\d{4}", "Hi?"]) == 0
    assert re.fullmatch(r"\d{4}", json.loads(capsys.readouterr().out)["text"])
    assert main(argv + ["--regex", "a", "--response-format", "json_object", "Hi?"]) == 2
    assert "--response-format and --regex each constrain the output" in capsys.readouterr().err
    assert main(argv + ["--regex", "(?=a)", "Hi?"]) == 2
    assert "lookaround" in capsys.readouterr().err


def test_batch_rows_carry_vllms_structured_outputs(tmp_path, capsys):
    from dflash.cli import main
    from dflash.testing import tiny_target

    target = tiny_target("qwen2", vocab_size=320, logit_scale=4.0, tokenizer="bytes")  # the CLI's tiny-qwen2-bytes
    rows = [{"id": "choice", "prompt": "Hi?", "structured_outputs": {"choice": ["red", "green"]}},
            {"id": "regex", "prompt": "Hi?", "guided_regex": r"[a-c]{2}\d"},
            {"id": "free", "prompt": "Hi?"}]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["batch", str(source), "--output", str(tmp_path / "out.jsonl"), "--target", "tiny-qwen2-bytes",
            "--max-new-tokens", "12", "--max-batch", "3", "--no-progress"]
    assert main(argv) == 0
    texts = {row["id"]: row["text"] for row in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    ids = target.encode_messages([{"role": "user", "content": "Hi?"}])
    for rid, expression in (("choice", choice_expression(["red", "green"])), ("regex", r"[a-c]{2}\d")):
        expected = plain_constrained_loop(target, ids, SamplingConfig(), max_new=12,
                                          grammar=PatternGrammar(expression))
        assert texts[rid] == target.tokenizer.decode(expected, skip_special_tokens=True), rid
    assert texts["free"] == SpeculativeDecoder(target).generate(ids, GenerationConfig(12)).text
    for row, message in [({"prompt": "Hi?", "guided_choice": ["a"], "response_format": {"type": "json_object"}},
                          "in.jsonl:1: response_format and structured_outputs"),
                         ({"prompt": "Hi?", "structured_outputs": {"regex": "(?=x)"}}, "in.jsonl:1: pattern"),
                         ({"prompt": "Hi?", "structured_outputs": "x"}, "structured_outputs must be an object")]:
        source.write_text(json.dumps(row) + "\n")
        assert main(argv[:3] + [str(tmp_path / "other.jsonl")] + argv[4:]) == 2
        assert message in capsys.readouterr().err


def test_the_server_holds_the_answer_after_the_thinking():
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.serving import BackgroundServer, create_app
    from dflash.testing import tiny_target
    from test_reasoning import thinking_bias

    target = tiny_target("qwen3", vocab_size=320, logit_scale=4.0, tokenizer="hermes")
    bias = {str(k): v for k, v in thinking_bias(target).items()}
    thought = 0
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny", reasoning_parser="qwen3")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for seed in (1, 2, 3):
            reply = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Good?"}], max_tokens=60, temperature=0.9,
                seed=seed, logit_bias=bias, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}).choices[0]
            if reply.finish_reason == "stop":
                assert reply.message.content in ("yes", "no")
            thought += bool(reply.message.model_dump().get("reasoning"))
    assert thought
