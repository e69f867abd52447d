"""Outputs held to a context-free grammar in EBNF (ebnf.py: vLLM's structured outputs `grammar`, SGLang's `ebnf`):
the recogniser against reference recognisers (Python's re for regular grammars, hand-written ones for nested and
left-recursive grammars), byte by byte through multi-byte characters; grammars that cannot be enforced refused in one
line; masks against feeding every token; constrained decoding against the plain constrained loop for every proposer;
and the server, LLM, CLI and batch surfaces."""

import itertools
import json
import random
import re

import pytest

from conftest import ARCHS
from dflash.ebnf import RulesGrammar, compile_rules, grammar_format
from dflash.errors import UserError
from dflash.methods.ngram import NgramProposer
from test_structured import assert_held_like_the_plain_loop, assert_masks_are_fed

# each grammar beside a regular expression for the same strings
REGULAR = [
    (r'root ::= "\"" char* "\""' "\n" r'char ::= [^"\\\x00-\x1f] | "\\" escape' "\n"
     r'escape ::= ["\\/bfnrt] | "u" [0-9A-Fa-f]{4}',
     r'"(?:[^"\\\x00-\x1f]|\\(?:["\\/bfnrt]|u[0-9A-Fa-f]{4}))*"'),
    ('root ::= identifier ("," " "? identifier){0,2}  # a comment\nidentifier ::= [a-zA-Z_] [a-zA-Z0-9_]*',
     r"[a-zA-Z_][a-zA-Z0-9_]*(?:, ?[a-zA-Z_][a-zA-Z0-9_]*){0,2}"),
    ('root ::= ("yes" | "no" | "maybe") "."? \n', r"(?:yes|no|maybe)\.?"),
    ('root ::= [é-ü]+ "中"? x{2,}\nx ::= "x" | ""', r"[é-ü]+中?x*"),
    ('root ::= ( ) "a" . [^]? [^a-c]', r"a(?s:.)(?s:.)?[^a-c]"),
    ('root::="\\x41\\u00e9\\U0001F600" "\\n"{1,3}', "A\u00e9\U0001F600\n{1,3}"),
]
ARITHMETIC = 'root ::= expr ("=" expr)*\nexpr ::= expr [-+*/] term | term\nterm ::= num | "(" expr ")"\nnum ::= [0-9]+'
BRACKETS = 'root ::= ("(" root ")" | "[" root "]")*'
ALPHABET = 'abcxyz09_-, .é\u00fc\u4e2d"\\/u\n\tA\U0001F600'


def matches(grammar: RulesGrammar, text: str) -> bool:
    state = grammar.feed_bytes(grammar.initial, text.encode())
    return state is not None and grammar.may_end(state)


def arithmetic(text: str) -> bool:
    """ARITHMETIC's strings, by recursive descent."""
    at = 0

    def expr() -> bool:
        nonlocal at
        if not term():
            return False
        while at < len(text) and text[at] in "-+*/":
            at += 1
            if not term():
                return False
        return True

    def term() -> bool:
        nonlocal at
        if at < len(text) and text[at] == "(":
            at += 1
            if not expr() or at >= len(text) or text[at] != ")":
                return False
            at += 1
            return True
        start = at
        while at < len(text) and text[at].isdigit():
            at += 1
        return at > start

    if not expr():
        return False
    while at < len(text) and text[at] == "=":
        at += 1
        if not expr():
            return False
    return at == len(text)


def brackets(text: str) -> bool:
    stack = []
    for char in text:
        if char in "([":
            stack.append(char)
        elif not stack or stack.pop() + char not in ("()", "[]"):
            return False
    return not stack


def texts_near(examples: list[str], alphabet: str, rng: random.Random, count=1500) -> list[str]:
    """Random texts, and the examples with a character changed, added or dropped."""
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(count)]
    for example in examples * 30:
        at = rng.randint(0, len(example))
        texts.append(example[:at] + rng.choice(["", rng.choice(alphabet)]) + example[at + rng.randint(0, 1):])
    return texts + examples


def assert_recognises(grammar_text: str, expected, examples: list[str], alphabet: str) -> None:
    """Whole matches as `expected` says; every prefix of a match, byte by byte, is a live state."""
    grammar, rng = RulesGrammar(grammar_text), random.Random(0)
    found = 0
    for text in texts_near(examples, alphabet, rng):
        assert matches(grammar, text) == expected(text), (grammar_text, text)
        if expected(text):
            found += 1
            data = text.encode()
            assert all(grammar.feed_bytes(grammar.initial, data[:n]) is not None for n in range(len(data)))
    assert found >= len(examples) // 2


@pytest.mark.parametrize("grammar_text, expression", REGULAR)
def test_regular_grammars_match_as_their_expressions(grammar_text, expression):
    examples = ['"a\\u00e9\\n"', "ab, c_1,d", "maybe.", "éüxx", "a\nxd", "A\u00e9\U0001F600\n\n", '""', "yes"]
    assert_recognises(grammar_text, lambda t: re.fullmatch(expression, t) is not None, examples, ALPHABET)


def test_nested_and_left_recursive_grammars_match_as_their_parsers():
    assert_recognises(ARITHMETIC, arithmetic, ["1+2", "(3*4)-5=7", "2=2=2", "((1))", "12/(3-1)"], "0129+-*/()= ")
    assert_recognises(BRACKETS, brackets, ["", "()", "[()]()", "(([]))[]"], "()[]x")
    both = RulesGrammar('root ::= root "a" | root "b" | "c"')  # xgrammar's left recursion, two tails
    assert all(matches(both, t) for t in ["c", "ca", "cab", "cbba"])
    assert not any(matches(both, t) for t in ["", "a", "cc", "acb"])
    state = both.feed_bytes(both.initial, b"ca")
    assert both.may_end(state) and not both.finished(state)
    short = RulesGrammar('root ::= "ab" | "a"')
    assert short.finished(short.feed_bytes(short.initial, b"ab"))


LARK_NUMBERS = "start: SIGNED_NUMBER (\",\" SIGNED_NUMBER)*\n%import common.SIGNED_NUMBER  // Lark's library"
NUMBER = r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?"
LARK_REGULAR = [  # Lark grammars beside regular expressions for the same strings
    (LARK_NUMBERS, rf"{NUMBER}(,{NUMBER})*"),
    ('start: "select"i " " NAME\nNAME: /[a-z_][a-z0-9_]*/', r"[sS][eE][lL][eE][cC][tT] [a-z_][a-z0-9_]*"),
    ('start: ("a".."c")+ "!" | "ab" ~ 2..3 | x\n?x: "q" ["r"] -> alias', r"[a-c]+!|(ab){2,3}|qr?"),
]


@pytest.mark.parametrize("grammar_text, expression", LARK_REGULAR)
def test_lark_grammars_match_as_their_expressions(grammar_text, expression):
    examples = ["1,-2.5e3,.5", "+7", "SeLeCt a_1", "select x", "abca!", "ababab", "qr", "q"]
    alphabet = "0123456789+-.eE,sSeElLcCtT _ax!bqr"
    assert_recognises(grammar_text, lambda t: re.fullmatch(expression, t) is not None, examples, alphabet)


def test_lark_ignores_between_terminals_and_around_the_output():
    spaced = 'start: item*\nitem: "(" start ")" | "[" start "]"\n%ignore " "'
    assert_recognises(spaced, lambda t: brackets(t.replace(" ", "")), [" ( [ ] ) ", "()[]", "([ ])"], "()[] ")
    plain = BRACKETS.replace("root ::=", "start:").replace("root", "start")
    assert_recognises(plain, brackets, ["()", "[()]"], "()[]x")
    words = RulesGrammar('start: WORD+\n%import common (WORD, WS)\n%ignore WS')  # no space inside a terminal
    assert matches(words, " ab \n cd ") and not matches(words, "a1")


def test_lark_ignores_whitespace_in_runs_of_at_most_max_spaces():
    """A small model under a mask pads with newlines where nothing bounds them: %ignore's whitespace comes at most
    MAX_SPACES characters at a place (the other ignored terminals between such runs, unbounded), always inside the
    grammar's own language."""
    from dflash.lark_grammar import MAX_SPACES

    words = RulesGrammar('start: WORD+\n%import common (WORD, WS)\n%ignore WS')
    most = " \n\t" * (MAX_SPACES // 3) + " " * (MAX_SPACES % 3)
    assert matches(words, f"{most}ab{most}cd{most}") and not matches(words, f"ab{most} cd")
    assert words.feed_bytes(words.initial, f"ab{most} ".encode()) is None  # refused at the first one too many
    commented = RulesGrammar('start: WORD+\nCOMMENT: /#[^\\n]*/\n%import common (WORD, WS_INLINE)\n'
                             '%ignore WS_INLINE\n%ignore COMMENT\n%ignore " "')
    long_comment = "#" + "x" * 100
    assert matches(commented, f"ab{' ' * MAX_SPACES}{long_comment}{' ' * MAX_SPACES}cd")
    assert matches(commented, f"ab {long_comment}{long_comment} cd") and not matches(commented, "ab\ncd")
    assert not matches(commented, f"ab{' ' * (MAX_SPACES + 1)}cd")
    underscores = RulesGrammar('start: "a" "b"\n%ignore "_"')  # not whitespace: as Lark reads it
    assert matches(underscores, "a" + "_" * 100 + "b")


def test_long_chains_of_rules_compile_and_match():
    """What compiling finds by fixpoints and components, over chains of 500 rules: each rule can finish only
    through the next, each may be empty only through the next, each starts with the next (left recursion through
    all of them is refused, naming them)."""
    n = 500
    through = "root ::= r0\n" + "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(n)) + f'\nr{n} ::= "z"'
    assert matches(RulesGrammar(through), "a" * n + "z") and not matches(RulesGrammar(through), "a" * (n - 1) + "z")
    empty = 'root ::= r0 "q"\n' + "\n".join(f"r{i} ::= r{i + 1}" for i in range(n)) + f'\nr{n} ::= "" | "x"'
    assert matches(RulesGrammar(empty), "q") and matches(RulesGrammar(empty), "xq")
    looping = "root ::= r0\n" + "\n".join(f'r{i} ::= r{i + 1} "x" | "y"' for i in range(n)) + '\nr500 ::= r0 "w"'
    with pytest.raises(UserError, match="left recursion through r0 -> r1 -> r2 -> "):
        grammar_format(looping)


def test_nesting_is_bounded_in_the_grammar_and_in_the_output(monkeypatch):
    import dflash.ebnf as ebnf

    with pytest.raises(UserError, match="nests its groups too deeply"):
        grammar_format("root ::= " + "(" * 2000 + '"a"' + ")" * 2000)
    monkeypatch.setattr(ebnf, "MAX_DEPTH", 40)  # an output nested past it is not taken, short of it is
    grammar = RulesGrammar('root ::= "(" root ")" | "x"')
    assert matches(grammar, "(" * 30 + "x" + ")" * 30)
    assert grammar.feed_bytes(grammar.initial, b"(" * 45) is None


@pytest.mark.parametrize("text, fragment", [
    ('root: "a"\nx ::= "b"', "mixes Lark's"), ('x ::= "a"', "no rule `root`"),
    ("root ::= a", "rule 'a' is not defined"),
    ("start: a", "rule 'a' is not defined"), ('start: "a"\n%declare X', "%declare is not supported"),
    ("start: x{1}", "templates"), ("start: /a/i", "flags (i)"), ('a: "x"', "no rule `start`"),
    ("%import foo.BAR\nstart: BAR", "only Lark's common library"), ('start: "a" (', "line 1: expected )"),
    ('start: "a"\n%import common.NOPE', "line 2: common.NOPE is not in"), ("start: /^a/", "anchored"),
    ('root ::= "a" root', "can never finish"), ("root ::= []", "can never finish"),
    ('root ::= a\na ::= b "x"\nb ::= a "y" | "z"', "left recursion through a -> b -> a"),
    ('root ::= a\na ::= "z"? a "x" | "y"', "left recursion through a -> a"),
    ('root ::= TagDispatch(("<a>", x))', "TagDispatch (xgrammar's) is not supported"),
    ('root ::= "a"++', "two repetitions"), ('root ::= "a"{3,1}', "the wrong way round"),
    ("root ::= 'a'", "double quotes"), ('root[temperature=0.5] ::= "a"', "rule options"),
    ('root ::= (="a") "a"', "lookahead"), ('root ::= "\\d"', "the escape \\d"),
    ('root ::= "a\nroot ::= "b"', "line 1 column 12: an unclosed string"), ('root ::= "a"\nroot ::= "b"', "twice"),
    ('root ::= "a" ("b"', "unclosed group"), ('root ::= "a"{1000}{2}', "two repetitions"),
    ('root ::= ("a"{1000}){1000}', "too large"), ("", "EBNF text"), (3, "EBNF text"),
])
def test_grammars_that_cannot_be_enforced_are_refused_in_one_line(text, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)):
        grammar_format(text)


def test_a_grammar_too_ambiguous_keeps_its_first_readings():
    """Readings that merge stay few; where they multiply past MAX_STACKS the first ones are kept, the same every
    time, and what they take is still in the language (here: n x's, then n y-or-z's)."""
    import dflash.ebnf as ebnf

    grammar = compile_rules('root ::= a*\na ::= "x" | "x" | b\nb ::= "x"')  # three readings of each x, merged
    state = grammar.start
    for _ in range(50):
        state = grammar.step(state, ord("x"))
    assert len(state) <= 6
    text = 'root ::= "x" a\na ::= "" | "x" a "y" | "x" a "z"'
    exploding = RulesGrammar(text)
    state = exploding.feed_bytes(exploding.initial, b"x" * 16)  # 2 ** 15 readings, beyond MAX_STACKS
    assert state is not None and len(exploding.state_set(state[1])) <= ebnf.MAX_STACKS
    assert state == RulesGrammar(text).feed_bytes(exploding.initial, b"x" * 16)
    kept = 0
    for ending in itertools.product("yz", repeat=15):
        after = exploding.feed_bytes(state, "".join(ending).encode())
        kept += after is not None and exploding.may_end(after)
    assert 0 < kept < 2 ** 15


@pytest.mark.parametrize("grammar_text", [ARITHMETIC, BRACKETS, REGULAR[0][0], REGULAR[3][0],
                                          'start: item*\nitem: "(" start ")" | "[" start "]"\n%ignore " "'])
def test_masks_are_every_token_fed(grammar_text):
    grammar, rng = RulesGrammar(grammar_text), random.Random(1)
    examples = ["1+(2*3)=4", "[()]", "(([]))[[()]]", '"a\\n\\u00e9b"', "éüx"]
    texts = [t for t in texts_near(examples, ALPHABET + "()[]+*=", rng) if matches(grammar, t)]
    assert assert_masks_are_fed(grammar, [t.encode() for t in texts if t]) > 3


@pytest.mark.parametrize("arch", ARCHS)
def test_constrained_outputs_are_the_plain_loops_for_every_proposer(byte_targets, arch):
    target = byte_targets[arch]
    prompt_ids = target.encode_prompt("What is it?")
    for grammar_text in (ARITHMETIC, 'root ::= "It is " [0-9]{1,3} (" kg" | " g") "."'):
        grammar = RulesGrammar(grammar_text)
        for result in assert_held_like_the_plain_loop(target, prompt_ids, grammar, "grammar",
                                                      {"grammar": grammar_text}):
            if result.finish_reason == "stop":
                assert matches(grammar, result.text), result.text


@pytest.mark.parametrize("thinking", ["open", "optional"])
def test_a_grammar_after_thinking_takes_any_thought_then_a_match(thinking):
    grammar = RulesGrammar('root ::= ("yes" | "no") "."').thinking_first(thinking)
    prefix = "" if thinking == "open" else "<think>"
    for text, whole in [(prefix + "Hmm </thin {x</think>\n\nyes.", True), (prefix + "Hmm", False),
                        (prefix + "x</think>maybe", None), (prefix + "x</think>yes", False)]:
        state = grammar.feed_bytes(grammar.initial, text.encode())
        assert (None if state is None else grammar.may_end(state)) == whole, text
    assert matches(grammar, "no.") == (thinking == "optional")


def test_the_server_takes_a_grammar_by_each_name(byte_targets):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from dflash.serving import BackgroundServer, create_app

    grammar_text = 'root ::= "It is " [0-9]{1,3} (" kg" | " g") "."'
    with BackgroundServer(create_app(byte_targets["llama"], NgramProposer(max_draft=7), "tiny")) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def ask(extra, endpoint="chat"):
            if endpoint == "chat":
                return client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Hi?"}], max_tokens=30, temperature=0,
                    extra_body=extra).choices[0].message.content
            if endpoint == "responses":
                return client.responses.create(model="tiny", input="Hi?", max_output_tokens=30, temperature=0,
                                               extra_body=extra).output_text
            return client.completions.create(model="tiny", prompt="Hi?", max_tokens=30, temperature=0,
                                             extra_body=extra).choices[0].text

        lark = 'start: "It is " INT ("kg" | "g") "."\n%import common.INT\n%ignore " "'
        held = RulesGrammar(lark)  # this target pads with what %ignore skips (up to MAX_SPACES at a place)
        assert held.feed_bytes(held.initial, ask({"structured_outputs": {"grammar": lark}}).encode()) is not None
        for endpoint in ("chat", "completions", "responses"):
            answer = ask({"structured_outputs": {"grammar": grammar_text}}, endpoint)
            assert re.fullmatch(r"It is \d{1,3} k?g\.", answer), answer
            assert ask({"guided_grammar": grammar_text}, endpoint) == ask({"ebnf": grammar_text}, endpoint) == answer
        for extra, fragment in [({"guided_grammar": "root ::= x"}, "rule 'x' is not defined"),
                                ({"ebnf": 'root ::= "a"', "guided_regex": "a"}, "one constraint")]:
            with pytest.raises(openai.BadRequestError, match=fragment):
                ask(extra)


def test_llm_generate_and_batch_take_a_grammar(tmp_path, capsys):
    from dflash.cli import main
    from dflash.llm import LLM

    grammar_text = 'root ::= [ab]{2} ("!" | "?")'
    llm = LLM("tiny-qwen2-bytes", method="ngram")
    assert all(re.fullmatch(r"[ab]{2}[!?]", r.text) for r in llm.generate(["Hi?", "Ho?"], 20, grammar=grammar_text))
    assert re.fullmatch(r"[ab]{2}[!?]", llm.chat([{"role": "user", "content": "Hi?"}], 20, grammar=grammar_text).text)
    with pytest.raises(UserError, match="one of them"):
        llm.generate("Hi?", 8, regex="a", grammar=grammar_text)
    argv = ["generate", "--target", "tiny-qwen2-bytes", "--method", "ngram", "--max-new-tokens", "20", "--json"]
    source = tmp_path / "answer.ebnf"
    source.write_text(f"# a grammar in a file\n{grammar_text}\n")
    for given in (grammar_text, str(source), 'start: /[ab]{2}/ ("!" | "?")'):  # a Lark one inline too
        assert main(argv + ["--grammar", given, "Hi?"]) == 0
        assert re.fullmatch(r"[ab]{2}[!?]", json.loads(capsys.readouterr().out)["text"])
    for extra, message in [(["--grammar", "nothing.ebnf"], "neither"), (["--grammar", "root ::= a"], "not defined"),
                           (["--grammar", grammar_text, "--regex", "a"], "--regex and --grammar each constrain")]:
        assert main(argv + extra + ["Hi?"]) == 2
        assert message in capsys.readouterr().err
    rows = [{"id": "g", "prompt": "Hi?", "guided_grammar": grammar_text}, {"id": "e", "prompt": "Hi?",
                                                                             "ebnf": grammar_text}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["batch", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--target",
                 "tiny-qwen2-bytes", "--max-new-tokens", "12", "--no-progress"]) == 0
    texts = [json.loads(line)["text"] for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(texts) == 2 and all(re.fullmatch(r"[ab]{2}[!?]", t) for t in texts)
