"""Structural tags (vLLM's and SGLang's `structural_tag`, structural_tags.py): free text in which triggers open JSON
documents between tags, against a reference recogniser on random texts; masks against feeding every token (free
text, documents, tokens that close a document and go on); constrained decoding against the plain loop for every
proposer; refusals in one line; the server, LLM, generate and batch."""

import json
import random
import re

import pytest

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.errors import UserError
from dflash.sampling import SamplingConfig
from dflash.structural_tags import structural_tag_format, tag_grammar
from dflash.structured import output_grammar
from test_structured import assert_masks_are_fed, plain_constrained_loop, proposers

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALLS = {"structures": [
    {"begin": "<function=weather>", "schema": WEATHER, "end": "</function>"},
    {"begin": "<function=clock>", "schema": {"type": "object", "properties": {}, "additionalProperties": False},
     "end": "</function>"}],
    "triggers": ["<function="]}
# the engine's: a trigger of one byte a random model can be pushed to write, and a begin and end it is then held to
SHORT = {"structures": [{"begin": "<w>", "schema": WEATHER, "end": "</w>"}], "triggers": ["<"]}


def grammar_of(given: dict):
    return tag_grammar(structural_tag_format(given)[1])


def xgrammar_layout(legacy: dict, **flags) -> dict:
    """A legacy structural tag in xgrammar's newer layout (triggered_tags of tags with json_schema contents)."""
    tags = [{"type": "tag", "begin": s["begin"], "content": {"type": "json_schema", "json_schema": s["schema"]},
             "end": s["end"]} for s in legacy["structures"]]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": legacy["triggers"],
                                                 "tags": tags, **flags}}


def accepts(grammar, text: str) -> bool:
    state = grammar.feed_bytes(grammar.initial, text.encode())
    return state is not None and grammar.may_end(state)


def reference(text: str, given: dict) -> bool:
    """Whether `text` is free text whose every trigger goes on into a structure: its begin, a document of its schema
    (as json.dumps writes one: WEATHER's {"city": text}, or {}), its end; read left to right."""
    at, triggers = 0, given["triggers"]
    while True:
        found = None  # the first place a trigger ends, the longest trigger ending there
        for end in range(at + 1, len(text) + 1):
            ending = [t for t in triggers if end - len(t) >= at and text[end - len(t):end] == t]
            if ending:
                found = end - max(map(len, ending))
                break
        if found is None:
            return True
        structure = next((s for s in given["structures"] if text.startswith(s["begin"], found)), None)
        if structure is None:
            return False
        try:
            document, end = json.JSONDecoder().raw_decode(text, found + len(structure["begin"]))
        except ValueError:
            return False
        if json.dumps(document) != text[found + len(structure["begin"]):end]:
            return False  # written otherwise than the grammar holds it (spaces, order)
        keys = list(structure["schema"]["properties"])
        if list(document) != keys or not all(isinstance(v, str) for v in document.values()):
            return False
        if not text.startswith(structure["end"], end):
            return False
        at = end + len(structure["end"])


def random_text(rng: random.Random) -> str:
    pieces = ["Hi ", "ok", "<", "<f", "<function=", "<function=weather>", "<function=clock>", '{"city": "Paris"}',
              "{}", '{"town": "x"}', '{"city": 1}', "</function>", "</f", " ", "\n", "é"]
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 7)))


# ---- the grammar ---------------------------------------------------------------------------------------------------
def test_tags_take_what_the_reference_takes():
    grammar, rng = grammar_of(CALLS), random.Random(0)
    whole = 0
    for _ in range(3000):
        text = random_text(rng)
        expected = reference(text, CALLS)
        whole += expected and "</function>" in text
        assert accepts(grammar, text) == expected, text
    assert whole > 50
    examples = ['I will look. <function=weather>{"city": "Paris"}</function> It is sunny.',
                "<function=clock>{}</function><function=clock>{}</function>", "<<function=clock>{}</function>x<f"]
    assert all(accepts(grammar, t) for t in examples)
    for text in ("<function=weather>", '<function=weather> {"city": "P"}</function>', "<function=other>"):
        assert not accepts(grammar, text), text  # inside a structure; a space before the document; no such begin


def test_xgrammars_layout_and_its_flags():
    newer, rng = grammar_of(xgrammar_layout(CALLS)), random.Random(2)
    legacy = grammar_of(CALLS)
    for _ in range(500):
        text = random_text(rng)
        assert accepts(newer, text) == accepts(legacy, text), text
    call = '<function=clock>{}</function>'
    first = grammar_of(xgrammar_layout(CALLS, at_least_one=True))
    assert accepts(first, call + " then words " + call) and not accepts(first, "Hi " + call)
    assert not accepts(first, "") and first.feed_bytes(first.initial, b"<function=c") is not None
    once = grammar_of(xgrammar_layout(CALLS, stop_after_first=True))
    assert accepts(once, "Hi " + call) and accepts(once, "Hi") and not accepts(once, call + " more")
    assert once.finished(once.feed_bytes(once.initial, call.encode()))
    barred = grammar_of(xgrammar_layout(CALLS, excludes=["</think>", "<|end|>"]))
    assert accepts(barred, "Hi " + call) and not accepts(barred, "a </think> b") and not accepts(barred, "<|end|>")
    both = grammar_of(xgrammar_layout(CALLS, at_least_one=True, stop_after_first=True, excludes=["END"]))
    assert accepts(both, call) and not accepts(both, call + "x") and not accepts(both, "x" + call)
    texts = [(call + " ok " + call).encode(), b"<function=weather>{\"city\": \"x\"}</function>"]
    assert_masks_are_fed(first, texts)
    assert_masks_are_fed(barred, [b"Hi <|en <function=clock>{}</function></thin"])
    assert_masks_are_fed(both, [call.encode()])
    assert_masks_are_fed(first.thinking_first("open"), [b"Hmm</think>\n " + call.encode()])


def test_the_first_trigger_to_end_opens_its_structure():
    grammar = grammar_of({"structures": [{"begin": "ab{", "schema": {"type": "object"}, "end": "}"},
                                         {"begin": "xabc", "schema": {"type": "object"}, "end": ""},
                                         {"begin": "yab", "schema": {"type": "object"}, "end": ""}],
                          "triggers": ["ab", "xabc", "yab"]})
    assert grammar.feed_bytes(grammar.initial, b"xabc") is None  # "ab" ended first: its begin "ab{" goes on
    assert accepts(grammar, 'xab{{"a": 1}}') and accepts(grammar, "ab{{}}")
    assert accepts(grammar, "yab{}") and not accepts(grammar, "yab{{}}")  # "yab" and "ab" end together: the longer


def test_masks_are_every_token_fed():
    grammar = grammar_of(CALLS)
    texts = ['Hi <function=weather>{"city": "a\\"b"}</function> ok <function=clock>{}</function>',
             "<<f <function=clock>{}</function>", "<function=weather>{\"city\": \"\u00e9\"}</function>"]
    assert assert_masks_are_fed(grammar, [t.encode() for t in texts]) > 50
    thinking = grammar.thinking_first("optional")
    assert assert_masks_are_fed(thinking, [b"<think>x <f</think>\n<function=clock>{}</function>"]) > 10


@pytest.mark.parametrize("given, fragment", [
    ({"structures": CALLS["structures"]}, "triggers must be a non-empty list"),
    ({"structures": [], "triggers": ["<"]}, "structures must be a list of 1 to 64"),
    ({"structures": [{"begin": "x", "schema": WEATHER, "end": "y"}], "triggers": ["<"]}, "starts with none"),
    ({"structures": [{"begin": "<a", "schema": WEATHER, "end": ""}, {"begin": "<ab", "schema": WEATHER, "end": ""}],
      "triggers": ["<"]}, "must not start one another"),
    ({"structures": [{"begin": "<a", "schema": {"type": "string"}, "end": ""}], "triggers": ["<"]},
     "structures[0].schema: a JSON schema for structured output must describe an object"),
    ({"structures": SHORT["structures"], "triggers": ["<", "["]}, "trigger '[' begins none"),
    ({"format": {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}},
     "format 'tag' is not supported here"),
    ({"format": {"type": "triggered_tags", "triggers": ["<"], "tags": [{"type": "tag", "begin": "<a>", "content": {
        "type": "json_schema", "json_schema": WEATHER, "style": "qwen_xml"}, "end": "</a>"}]}},
     "format.tags[0] must be"),
    ({"format": {"type": "triggered_tags", "triggers": ["<"], "tags": [{"begin": "<a>", "content": {
        "type": "any_text"}, "end": "</a>"}]}}, "other contents"),
    ({"format": {**{k: v for k, v in xgrammar_layout(CALLS)["format"].items()}, "at_least_one": "yes"}},
     "at_least_one and stop_after_first must be true or false"),
    ({"format": {**xgrammar_layout(CALLS)["format"], "excludes": [""]}}, "excludes must be a list of non-empty"),
    ("{", "a structural tag must be"),
])
def test_tags_that_cannot_be_held_are_refused_in_one_line(given, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        structural_tag_format(given)


# ---- generation ----------------------------------------------------------------------------------------------------
def tag_bias(target) -> dict[int, float]:
    """Pushes a random model to open a structure (`<`) and to finish its document (quotes, braces)."""
    ids = target.tokenizer.convert_tokens_to_ids
    return {ids("<"): 6.0, ids('"'): 5.0, ids("}"): 3.0, ids('"}'): 4.0, ids(":"): 3.0,
            **{ids(space): -5.0 for space in ("\u010a", "\u0109", "\u010d", "\u0120")}}


def test_tagged_outputs_are_the_plain_loops_for_every_proposer(byte_targets):
    target = byte_targets["llama"]
    prompt_ids = target.encode_prompt("What is the weather?")
    fmt, given = structural_tag_format(SHORT)
    grammar = output_grammar(fmt, given)
    for sampling in (SamplingConfig(logit_bias=tag_bias(target)),
                     SamplingConfig(temperature=0.9, seed=3, logit_bias=tag_bias(target))):
        expected = plain_constrained_loop(target, prompt_ids, sampling, max_new=60, grammar=grammar)
        config = GenerationConfig(60, sampling=sampling, response_format=fmt, json_schema=given)
        for name, proposer in proposers(target, expected, len(prompt_ids)).items():
            result = SpeculativeDecoder(target, proposer).generate(prompt_ids, config)
            assert result.tokens == expected, (name, sampling.temperature)
        assert '<w>{"city":' in result.text.replace(" ", "") and "</w>" in result.text, result.text
        for document in re.findall(r"<w>(.*?)</w>", result.text):
            assert isinstance(json.loads(document)["city"], str)


# ---- the server, LLM, generate and batch ---------------------------------------------------------------------------
def test_the_server_takes_a_structural_tag_by_each_name(byte_targets):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.methods.ngram import NgramProposer
    from dflash.serving import BackgroundServer, create_app

    target = byte_targets["llama"]
    bias = {str(k): v for k, v in tag_bias(target).items()}
    with BackgroundServer(create_app(target, NgramProposer(max_draft=7), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(**extra):
            return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi?"}],
                                                  max_tokens=40, temperature=0, logit_bias=bias, **extra)

        answer = ask(response_format={"type": "structural_tag", **SHORT}).choices[0].message.content
        held = grammar_of(SHORT)  # cut at max_tokens: a prefix of what the grammar takes
        assert "<w>{" in answer and held.feed_bytes(held.initial, answer.encode()) is not None, answer
        assert ask(response_format=xgrammar_layout(SHORT)).choices[0].message.content == answer
        once = ask(response_format=xgrammar_layout(SHORT, stop_after_first=True)).choices[0]
        assert once.finish_reason == "stop" and accepts(grammar_of(xgrammar_layout(SHORT, stop_after_first=True)),
                                                        once.message.content), once.message.content
        assert ask(extra_body={"structured_outputs": {"structural_tag": json.dumps(SHORT)}}).choices[0] \
            .message.content == answer
        chunks = ask(response_format={"type": "structural_tag", **SHORT}, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
        for extra, fragment in [({"response_format": {"type": "structural_tag", "structures": SHORT["structures"]}},
                                 "triggers must be"),
                                ({"extra_body": {"structured_outputs": {"structural_tag": {}}}}, "must be"),
                                ({"response_format": {"type": "structural_tag", **SHORT},
                                  "extra_body": {"guided_regex": "a"}}, "each constrain the output")]:
            with pytest.raises(openai.BadRequestError, match=fragment):
                ask(**extra)


def test_llm_generate_and_batch_take_a_structural_tag(tmp_path, capsys):
    from dflash import LLM
    from dflash.cli import main

    llm = LLM("tiny-llama-bytes", method="ngram")
    grammar = grammar_of(SHORT)
    for result in llm.generate(["Hi?", "Ho?"], 30, structural_tag=SHORT):
        state = grammar.feed_bytes(grammar.initial, result.text.encode())
        assert state is not None and (result.finish_reason == "length" or grammar.may_end(state))
    with pytest.raises(UserError, match="one of them"):
        llm.chat([{"role": "user", "content": "Hi?"}], 8, grammar='root ::= "a"', structural_tag=SHORT)
    source = tmp_path / "tag.json"
    source.write_text(json.dumps(SHORT))
    argv = ["generate", "--target", "tiny-llama-bytes", "--method", "ngram", "--max-new-tokens", "20", "--json"]
    for given in (str(source), json.dumps(SHORT)):
        assert main(argv + ["--structural-tag", given, "Hi?"]) == 0
        text = json.loads(capsys.readouterr().out)["text"]
        assert grammar.feed_bytes(grammar.initial, text.encode()) is not None
    for extra, message in [(["--structural-tag", '{"triggers": []}'], "triggers must be"),
                           (["--structural-tag", json.dumps(SHORT), "--regex", "a"], "each constrain the output")]:
        assert main(argv + extra + ["Hi?"]) == 2
        assert message in capsys.readouterr().err
    rows = [{"id": "a", "prompt": "Hi?", "response_format": {"type": "structural_tag", **SHORT}},
            {"id": "b", "prompt": "Hi?", "structured_outputs": {"structural_tag": SHORT}},
            {"id": "c", "prompt": "Hi?", "response_format": {"type": "structural_tag", "triggers": ["<"]}}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    assert main(["batch", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--target",
                 "tiny-llama-bytes", "--max-new-tokens", "12", "--no-progress"]) == 0
    texts = [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(texts) == 2 and all(grammar.feed_bytes(grammar.initial, t.encode()) is not None for t in texts)
    (tmp_path / "bad.jsonl").write_text(json.dumps(rows[2]) + "\n")
    assert main(["batch", str(tmp_path / "bad.jsonl"), "--output", str(tmp_path / "out2.jsonl"), "--target",
                 "tiny-llama-bytes", "--max-new-tokens", "12", "--no-progress"]) == 2
    assert "bad.jsonl:1: a structural tag's structures must be" in capsys.readouterr().err
