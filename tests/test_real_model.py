"""Greedy losslessness on the real default target, SmolLM2-135M-Instruct (fetched from its PyPI wheel)."""

import os

import pytest
import torch

from conftest import OracleProposer, RandomProposer
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer
from dflash.methods.base import MethodOptions
from dflash.methods.dflash.proposer import DFlashProposer, untrained_drafter

pytestmark = pytest.mark.real_model
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
]
MAX_NEW = 64


@pytest.fixture(scope="module", autouse=True)
def all_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    from dflash.models.target import load_target

    return load_target("smollm2-135m")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_identical_to_transformers_generate(target, prompt):
    ids = target.encode_prompt(prompt)
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    reference = SpeculativeDecoder(target).generate(ids, config)
    with torch.no_grad():
        hf = target.model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                   eos_token_id=None, pad_token_id=0)
    assert reference.tokens == hf[0, len(ids):].tolist()
    assert len(reference.tokens) == MAX_NEW

    proposers = {
        "untrained dflash": DFlashProposer(untrained_drafter(target, num_layers=1).freeze(), target),
        "oracle": OracleProposer(reference.tokens, len(ids), 15),
        "random": RandomProposer(target.vocab_size, 15),
        "shipped dflash": build_proposer("dflash", target)[0],
        "shipped dflash, a tree of 15": build_proposer("dflash", target, MethodOptions(tree=15))[0],
    }
    for name, proposer in proposers.items():
        result = SpeculativeDecoder(target, proposer).generate(ids, config)
        assert result.tokens == reference.tokens, f"{name} changed the greedy output"
    oracle = SpeculativeDecoder(target, proposers["oracle"], adaptive=False).generate(ids, config)
    assert oracle.stats.tau > 10
    if prompt == PROMPTS[0]:  # GSM8K style: the shipped drafter must be accepted (a broken checkpoint gives ~1.0)
        shipped = SpeculativeDecoder(target, proposers["shipped dflash"], adaptive=False).generate(ids, config)
        assert shipped.stats.tau > 1.2
        tree = SpeculativeDecoder(target, proposers["shipped dflash, a tree of 15"], adaptive=False).generate(
            ids, config)
        assert tree.stats.tau > shipped.stats.tau  # the same 15 drafts a round (every node), accepted deeper


def test_chat_template_and_eos(target):
    ids = target.encode_prompt("What is 2+2? Answer with one number.")
    assert target.tokenizer.decode(ids).count("<|im_start|>") >= 2
    out = SpeculativeDecoder(target).generate(ids, GenerationConfig(max_new_tokens=64))
    assert out.finish_reason == "stop" and "<|im_end|>" not in out.text and "4" in out.text


def test_shipped_drafters_compute_what_they_did_before_the_refactor(target):
    """The shipped checkpoints' outputs, computed by the code of commit 8ee6a20 (before the method registry, shared
    layers and position-indexed caches) and stored in tests/data: the same argmax drafts, logits within 1e-3. When a
    drafter is retrained, its reference is recomputed by that old code on the new weights (a worktree of 8ee6a20:
    the DFlash entry was, for the stage-4 drafter)."""
    import json
    from pathlib import Path

    from dflash.methods.base import MethodOptions

    reference = json.loads((Path(__file__).parent / "data" / "shipped_drafters_reference.json").read_text())
    seq = reference["sequence"]
    last = len(seq) - 1
    with torch.inference_mode():
        proposer, _ = build_proposer("dflash", target, MethodOptions(draft_dtype="float32"))
        drafter = proposer.drafter
        feats = target.forward(torch.tensor([seq]), None, proposer.feature_layers).features
        block = torch.tensor([[seq[-1]] + [drafter.config.mask_token_id] * 15])
        hidden = drafter(target.embed_tokens(block), torch.arange(last, last + 16)[None], feats[:, :last],
                         torch.arange(last)[None])
        logits = (hidden[0, 1:] @ target.lm_head.weight.t()).float()
        assert logits.argmax(-1).tolist() == reference["dflash"]["argmax"]
        torch.testing.assert_close(logits.max(-1).values, torch.tensor(reference["dflash"]["max"]), atol=1e-3, rtol=0)
        torch.testing.assert_close(logits.mean(-1), torch.tensor(reference["dflash"]["mean"]), atol=1e-3, rtol=0)

        proposer, _ = build_proposer("eagle3", target, MethodOptions(draft_dtype="float32"))
        feats = target.forward(torch.tensor([seq]), None, proposer.feature_layers).features
        proposer.start(seq[:last], feats[:, :last])
        assert proposer.propose(seq).tokens == reference["eagle3"]["drafts"]
        head_logits = proposer.head.logits(proposer.head.fuse(feats[:, :last])).float()[0]
        assert head_logits.argmax(-1)[-5:].tolist() == reference["eagle3"]["fuse_logits_argmax"]
        torch.testing.assert_close(head_logits.max(-1).values[-5:], torch.tensor(reference["eagle3"]["fuse_logits_max"]),
                                   atol=1e-3, rtol=0)


def test_int8_drafters_draft_what_float32_ones_do(target):
    """int8 drafting (weights per channel, activations per call) must keep the drafts: on the real model's features,
    whose few huge channels once swamped the int8 scale of the feature projection and cut acceptance from 33% to 3%,
    the int8 drafters' first drafts equal the float32 ones' in >= 85% of rounds and they accept >= 85% as many."""
    from dflash.methods.base import MethodOptions
    from dflash.models.kernels import int8_supported

    if not int8_supported(torch.randn(1)):
        pytest.skip("no fbgemm int8 kernel in this PyTorch build")
    prompt = target.encode_prompt("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
                                  "clips in May. How many clips did Natalia sell altogether in April and May?")
    seq = prompt + SpeculativeDecoder(target).generate(prompt, GenerationConfig(max_new_tokens=64,
                                                                                ignore_eos=True)).tokens
    for method in ("dflash", "eagle3"):
        first, accepted = {}, {}
        for precision in ("float32", "int8"):
            proposer, _ = build_proposer(method, target, MethodOptions(draft_dtype=precision))
            feats = target.forward(torch.tensor([seq]), None, proposer.feature_layers).features
            first[precision], accepted[precision] = [], 0
            for cut in range(len(prompt), len(seq) - 16, 2):
                proposer.start(seq[:cut], feats[:, :cut])
                drafts = proposer.propose(seq[: cut + 1]).tokens
                first[precision].append(drafts[0])
                truth = seq[cut + 1: cut + 1 + len(drafts)]
                accepted[precision] += next((k for k, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(drafts))
        same = sum(a == b for a, b in zip(first["float32"], first["int8"])) / len(first["float32"])
        assert same >= 0.85, f"{method}: int8 first drafts agree with float32 ones in only {same:.0%} of rounds"
        assert accepted["int8"] >= 0.85 * accepted["float32"], f"{method}: {accepted}"


def test_graph_safe_passes_decode_like_the_engine(target):
    """The pass `--cuda-graphs` captures (whole-capacity attention, scatter writes, device positions), run eagerly
    on the real model: the shipped drafter's speculative decoding through it gives the plain greedy tokens."""
    from dflash.models.target import TargetModel

    graphed = TargetModel(target.model, target.tokenizer, target.name, kernel_plan=target.kernel_plan, measure=False)
    graphed.use_graphs(capacity=256, capture=False)
    ids = target.encode_prompt(PROMPTS[0])
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    reference = SpeculativeDecoder(target).generate(ids, config).tokens
    result = SpeculativeDecoder(graphed, build_proposer("dflash", graphed)[0]).generate(ids, config)
    assert result.tokens == reference
    assert graphed.graphs.captures >= 2  # steps and verify passes both went through graphs


def test_an_int8_target_decodes_its_own_greedy_text_with_every_method():
    """SmolLM2 with `--dtype int8` (its real shapes through the int8 kernels where they run): the shipped drafter with
    prompt lookup, a tree, an oracle and random drafts all give the int8 model's own greedy tokens, in whole blocks
    too (verify passes of 16 tokens, bitwise their steps)."""
    from dflash.loading import load_target_cached

    from dflash.models import native

    int8 = load_target_cached("smollm2-135m", "int8")
    assert int8.precision == "int8"
    if native.int8_kernel() is not None:  # in pairs (AVX512-BF16 and VBMI) or widened (AVX2): a byte a weight
        assert int8.engine.layers[0].self_attn.qkv.native_tiles().dtype == torch.int8
    ids = int8.encode_prompt(PROMPTS[0])
    config = GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    reference = SpeculativeDecoder(int8).generate(ids, config)
    proposers = {
        "shipped dflash+ngram": build_proposer("dflash+ngram", int8)[0],
        "shipped dflash, a tree of 15": build_proposer("dflash", int8, MethodOptions(tree=15))[0],
        "oracle": OracleProposer(reference.tokens, len(ids), 15),
        "random": RandomProposer(int8.vocab_size, 15),
    }
    for name, proposer in proposers.items():
        for adaptive in (True, False):
            result = SpeculativeDecoder(int8, proposer, adaptive=adaptive).generate(ids, config)
            assert result.tokens == reference.tokens, f"{name} (adaptive {adaptive}) changed the greedy output"


def constrained_alike(target, ids, config):
    """`ar`'s output under the config's grammar, after checking the shipped drafter with prompt lookup gives the same
    tokens."""
    plain = SpeculativeDecoder(target).generate(ids, config)
    fast = SpeculativeDecoder(target, build_proposer("dflash+ngram", target)[0]).generate(ids, config)
    assert fast.tokens == plain.tokens, target.decode(ids)[-80:]
    return plain


def test_structured_output_on_the_real_tokenizer(target):
    """SmolLM2's 49,152 byte-level tokens: every mask met equals feeding each token's bytes (bounded strings and
    numbers among them), and a schema's output parses, fits the schema and is the same tokens for the shipped
    drafter with prompt lookup as for `ar`."""
    import json

    from dflash.grammar import START_STATE, compile_schema
    from dflash.structured import json_vocabulary

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "species": {"enum": ["cat", "dog"]},
                                               "age": {"type": "integer", "minimum": 1, "maximum": 30},
                                               "toys": {"type": "array", "maxItems": 3,
                                                        "items": {"type": "string", "minLength": 3}}},
              "required": ["name", "species", "age", "toys"]}
    ids = target.encode_prompt("Describe a pet.")
    config = GenerationConfig(max_new_tokens=96, response_format="json_schema", json_schema=schema)
    plain = constrained_alike(target, ids, config)
    assert plain.finish_reason == "stop"
    document = json.loads(plain.text)
    assert list(document) == ["name", "species", "age", "toys"] and document["species"] in ("cat", "dog")
    assert len(document["name"]) <= 12 and 1 <= document["age"] <= 30 and all(len(t) >= 3 for t in document["toys"])
    grammar, vocabulary = compile_schema(schema), json_vocabulary(target.tokenizer, target.vocab_size)
    state = START_STATE
    for token in plain.tokens[:-1]:  # the states the generation met, the end-of-sequence token left out
        fed = torch.tensor([vocabulary.advance(grammar, state, t) is not None for t in range(vocabulary.size)])
        assert torch.equal(vocabulary.allowed(grammar, state), fed)
        state = vocabulary.advance(grammar, state, token)


def test_tool_calls_on_the_real_model(target):
    """SmolLM2 offered two functions: a required call and a named one parse and fit the functions' schemas, the
    same tokens for the shipped drafter with prompt lookup as for `ar`; `auto` may answer in words (the mask of
    its first position takes every token but the calls' broken openings)."""
    import json

    from dflash.tools import conversation, tool_request

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}}
    clock = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                              "parameters": {"type": "object", "properties": {
                                                  "zone": {"type": "string"}}, "required": ["zone"]}}}
    question = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}, "auto"):
        request = tool_request([weather, clock], choice)
        fmt, schema = request.output_format()
        ids = target.encode_messages(conversation(question, request))
        config = GenerationConfig(max_new_tokens=96, response_format=fmt, json_schema=schema)
        plain = constrained_alike(target, ids, config)
        calls = request.calls(plain.text)
        if choice == "auto":
            continue  # words or calls: the model's choice
        assert plain.finish_reason == "stop" and calls, (choice, plain.text)
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather":
                assert list(arguments) == ["city", "unit"] and arguments["unit"] in ("celsius", "fahrenheit")
            else:
                assert list(arguments) == ["zone"] and isinstance(arguments["zone"], str)
        assert choice == "required" or [c["function"]["name"] for c in calls] == ["get_time"]


def test_custom_tool_calls_on_the_real_model(target):
    """SmolLM2 offered a custom tool whose input is SQL in a Lark grammar: the call it is told to make parses, its
    input matches the grammar (a regex of the same language), the same tokens for the shipped drafter with prompt
    lookup as for `ar`, and each mask met along it is every token fed."""
    import re

    from dflash.grammar import compile_schema
    from dflash.structured import json_vocabulary
    from dflash.tools import conversation, tool_request

    sql = {"type": "custom", "custom": {"name": "run_sql", "description": "Query the users table.", "format": {
        "type": "grammar", "grammar": {"syntax": "lark", "definition":
                                       "start: \"SELECT \" COLUMNS \" FROM users WHERE city = '\" CITY \"';\"\n"
                                       "COLUMNS: \"*\" | /[a-z]+(, [a-z]+)*/\nCITY: /[A-Za-z ]{1,20}/"}}}}
    request = tool_request([sql], {"type": "custom", "custom": {"name": "run_sql"}})
    question = [{"role": "user", "content": "Which users live in Paris?"}]
    fmt, schema = request.output_format()
    ids = target.encode_messages(conversation(question, request))
    plain = constrained_alike(target, ids, GenerationConfig(max_new_tokens=96, response_format=fmt,
                                                            json_schema=schema))
    (call,) = request.calls(plain.text)
    assert call["type"] == "custom" and call["custom"]["name"] == "run_sql", plain.text
    assert re.fullmatch(r"SELECT (\*|[a-z]+(, [a-z]+)*) FROM users WHERE city = '[A-Za-z ]{1,20}';",
                        call["custom"]["input"]), call
    grammar, vocabulary = compile_schema(schema), json_vocabulary(target.tokenizer, target.vocab_size)
    state = grammar.initial
    for token in plain.tokens[:-1]:
        fed = torch.tensor([vocabulary.advance(grammar, state, t) is not None for t in range(vocabulary.size)])
        assert torch.equal(vocabulary.allowed(grammar, state), fed)
        state = vocabulary.advance(grammar, state, token)


def test_structural_tags_on_the_real_model(target):
    """SmolLM2 shown calls written inline (`<function=NAME>{...}</function>`) goes on writing them under a structural
    tag: its calls parse as their schemas ask, the same tokens for the shipped drafter with prompt lookup as for
    `ar`, and each mask met along the output (free text, a begin, a document, an end) is every token fed."""
    import json
    import re

    from dflash.structural_tags import structural_tag_format
    from dflash.structured import json_vocabulary, output_grammar

    city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    zone = {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}
    fmt, given = structural_tag_format({"structures": [
        {"begin": "<function=get_weather>", "schema": city, "end": "</function>"},
        {"begin": "<function=get_time>", "schema": zone, "end": "</function>"}], "triggers": ["<function="]})
    prompt = ('User: What is the weather in Paris?\nAssistant: Let me check. <function=get_weather>{"city": "Paris"}'
              '</function>\nUser: What time is it in Tokyo?\nAssistant: Let me check. <function=get_time>{"zone": '
              '"Asia/Tokyo"}</function>\nUser: What is the weather in Rome?\nAssistant:')
    ids = target.encode_prompt(prompt, chat=False)
    plain = constrained_alike(target, ids, GenerationConfig(max_new_tokens=40, response_format=fmt,
                                                            json_schema=given))
    calls = re.findall(r"<function=(get_weather|get_time)>(.*?)</function>", plain.text)
    assert calls, plain.text
    for name, arguments in calls:
        assert list(json.loads(arguments)) == (["city"] if name == "get_weather" else ["zone"])
    grammar, vocabulary = output_grammar(fmt, given), json_vocabulary(target.tokenizer, target.vocab_size)
    state = grammar.initial
    for token in plain.tokens[:-1]:
        fed = torch.tensor([vocabulary.advance(grammar, state, t) is not None for t in range(vocabulary.size)])
        assert torch.equal(vocabulary.allowed(grammar, state), fed), state
        state = vocabulary.advance(grammar, state, token)


def test_hermes_tool_calls_and_thinking_on_the_real_tokenizer(target):
    """SmolLM2 under docs/templates/chatml_hermes_tools.jinja (its turns, calls in <tool_call> tags): the template
    takes the tools, a required call (one, parallel_tool_calls false) parses from its tags, the same tokens for the
    shipped drafter with prompt lookup as for `ar`; and a JSON answer after a thought, each mask met along it equal
    to feeding every token."""
    import copy
    import json
    from pathlib import Path

    from dflash.loading import chat_template_given
    from dflash.structured import json_vocabulary, output_grammar
    from dflash.tools import encode_chat, tool_request, tool_style

    templated = copy.copy(target)
    templated.tokenizer = copy.deepcopy(target.tokenizer)
    templated.tokenizer.chat_template = chat_template_given(
        str(Path(__file__).resolve().parent.parent / "docs" / "templates" / "chatml_hermes_tools.jinja"))
    assert tool_style(templated.tokenizer) == "hermes"
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Get the weather in a city.",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}
    request = tool_request([weather], "required", parallel_tool_calls=False, style="hermes")
    ids = encode_chat(templated, [{"role": "user", "content": "What is the weather in Rome?"}], request)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in templated.decode(ids)
    fmt, schema = request.output_format()
    plain = constrained_alike(templated, ids, GenerationConfig(max_new_tokens=48, response_format=fmt,
                                                               json_schema=schema))
    assert plain.finish_reason == "stop" and plain.text.startswith("<tool_call>\n{")
    calls = request.calls(plain.text)
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["city"], str)
    grammar, vocabulary = output_grammar("json_object", None, "open"), json_vocabulary(target.tokenizer,
                                                                                     target.vocab_size)
    state = grammar.initial
    for piece in ["Let me think. </th", "ink>\n\n", '{"a": 1}']:
        for token in target.tokenizer(piece)["input_ids"]:
            fed = torch.tensor([vocabulary.advance(grammar, state, t) is not None for t in range(vocabulary.size)])
            assert torch.equal(vocabulary.allowed(grammar, state), fed), state
            state = vocabulary.advance(grammar, state, token)
    assert grammar.may_end(state)


def test_formats_and_patterns_on_the_real_model(target):
    """A date, a uuid and a pattern on SmolLM2's tokens: the output fits them, the same tokens for the shipped
    drafter with prompt lookup as for `ar`."""
    import datetime
    import json
    import re
    import uuid

    schema = {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                               "id": {"type": "string", "format": "uuid"},
                                               "room": {"type": "string", "pattern": "^[A-Z]-\\d{2}$"}},
              "required": ["day", "id", "room"]}
    ids = target.encode_prompt("Book a meeting room for tomorrow.")
    config = GenerationConfig(max_new_tokens=96, response_format="json_schema", json_schema=schema)
    plain = constrained_alike(target, ids, config)
    assert plain.finish_reason == "stop"
    document = json.loads(plain.text)
    datetime.date.fromisoformat(document["day"])
    uuid.UUID(document["id"])
    assert re.fullmatch(r"[A-Z]-\d{2}", document["room"])


def test_regex_and_choice_on_the_real_model(target, monkeypatch):
    """A regex of words and a choice on SmolLM2's tokens: the output matches, the same tokens for the shipped drafter
    with prompt lookup as for `ar`; every mask met, tabled or walked, equals feeding each token's bytes."""
    import re

    import dflash.structured as structured
    from dflash.regex_grammar import PatternGrammar, choice_expression
    from dflash.structured import json_vocabulary

    vocabulary = json_vocabulary(target.tokenizer, target.vocab_size)
    ids = target.encode_prompt("Describe the sky in a short sentence.")
    for expression in (r"[A-Z][a-z]*( [a-z]+){2,8}\.", choice_expression(["blue", "grey", "black", "orange"])):
        config = GenerationConfig(max_new_tokens=32, response_format="regex", json_schema={"regex": expression})
        plain = constrained_alike(target, ids, config)
        assert plain.finish_reason == "stop" and re.fullmatch(expression, plain.text), plain.text
        grammar = PatternGrammar(expression)
        state = grammar.initial
        for token in plain.tokens[:-1]:
            fed = torch.tensor([vocabulary.advance(grammar, state, t) is not None for t in range(vocabulary.size)])
            for share in (0, 10**9):  # never tabled, tabled wherever any token goes on
                monkeypatch.setattr(structured, "TABLE_SHARE", share)
                vocabulary.masks.clear()
                assert torch.equal(vocabulary.allowed(grammar, state), fed), (share, state)
            state = vocabulary.advance(grammar, state, token)


def test_an_ebnf_grammar_and_a_prediction_on_the_real_model(target):
    """An EBNF grammar on SmolLM2's tokens: the output is a match, the same tokens for the shipped drafter with
    prompt lookup as for `ar`. A prediction of an answer with lines changed, and of the answer itself: the same
    tokens as without one."""
    from dflash.ebnf import RulesGrammar
    from dflash.prediction import prediction_ids

    grammar_text = 'root ::= "The sky is " colour "."\ncolour ::= "blue" | "grey" | "black" | [a-z]+'
    ids = target.encode_prompt("What colour is the sky? Answer in one sentence.")
    config = GenerationConfig(max_new_tokens=24, response_format="grammar", json_schema={"grammar": grammar_text})
    plain = constrained_alike(target, ids, config)
    grammar = RulesGrammar(grammar_text)
    state = grammar.feed_bytes(grammar.initial, plain.text.encode())
    assert plain.finish_reason == "stop" and state is not None and grammar.may_end(state), plain.text
    ids = target.encode_prompt(PROMPTS[1])
    free = SpeculativeDecoder(target).generate(ids, GenerationConfig(MAX_NEW))
    edited = "\n".join(line.upper() if k % 3 == 1 else line for k, line in enumerate(free.text.split("\n")))
    lookup = build_proposer("dflash+ngram", target)[0]
    for text in (free.text, edited):
        predicted = GenerationConfig(MAX_NEW, prediction=prediction_ids(target.tokenizer, text))
        assert SpeculativeDecoder(target, lookup).generate(ids, predicted).tokens == free.tokens
