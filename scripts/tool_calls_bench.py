"""Tool calls on SmolLM2-135M-Instruct: speed and acceptance of each method against `ar`, side by side in one process,
outputs checked identical, and how many replies were calls that parse.

Usage: .venv/bin/python scripts/tool_calls_bench.py [--methods ar,ngram,dflash,dflash+ngram] [--choices required,auto]
       [--repeats 2] [--max-new-tokens 96] [--chat-template FILE] [--no-parallel] [--toolset functions|custom]
       [--out FILE.json]
Four functions (described in the system message: tools.py's json format, or, with a --chat-template that writes
<tool_call> tags, such as docs/templates/chatml_hermes_tools.jinja, by the template in the hermes format), ten
questions that one of them answers; or (--toolset custom) four custom tools, whose input is text in a Lark grammar
(SQL, arithmetic), a regex (a shell command) or free (a note), and ten questions for them; float32,
greedy; each method keeps a prefix cache, as `dflash serve` does, so the system message that describes the tools is
read once. An untimed pass first computes the grammar's masks, as a server that has met these tools keeps them. Each
repeat runs every question with every method in turn, the order of the methods reversed on odd repeats.
"""

import argparse
import json
import time
from pathlib import Path

from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, chat_template_given, load_target_cached, settle_heap
from dflash.tools import encode_chat, tool_request, tool_style


def custom(name: str, description: str, syntax: str | None = None, definition: str = "") -> dict:
    grammar = {"format": {"type": "grammar", "grammar": {"syntax": syntax, "definition": definition}}} if syntax else {}
    return {"type": "custom", "custom": {"name": name, "description": description, **grammar}}


SQL = """start: "SELECT " columns " FROM " TABLE where? ";"
columns: "*" | column (", " column)*
column: NAME | "COUNT(*)" | "SUM(" NAME ")"
where: " WHERE " NAME " " OP " " value
value: NUMBER | STRING
TABLE: "users" | "orders"
OP: "=" | ">" | "<"
NAME: /[a-z_]+/
NUMBER: /[0-9]+/
STRING: /'[^']*'/
"""
ARITHMETIC = """start: expr
expr: term (" " ("+" | "-") " " term)*
term: factor (" " ("*" | "/") " " factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+(\\.[0-9]+)?/
"""
CUSTOM_TOOLS = [
    custom("run_sql", "Run a read-only SQL query on the shop's database. Tables: users(id, name, city, "
           "signup_year), orders(id, user_id, total).", "lark", SQL),
    custom("calculate", "Evaluate an arithmetic expression.", "lark", ARITHMETIC),
    custom("run_shell", "Run a shell command that lists or reads files.", "regex",
           r"(ls|cat|head|wc) [A-Za-z0-9_./-]+"),
    custom("write_note", "Save a note for the user."),
]
CUSTOM_QUESTIONS = [
    "How many users live in Paris?",
    "What is the total of all orders by the user with id 7?",
    "List the names of the users who signed up after 2020.",
    "What is 1234 times 5678?",
    "Compute (17.5 + 3) * 4 / 2.",
    "Add 19, 23 and 57.",
    "Show me the files in the docs folder.",
    "Print the first lines of README.md.",
    "Remind me to buy milk tomorrow.",
    "Write down that the meeting is on Friday at 3pm.",
]


def function(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    function("get_weather", "Get the current weather in a city.",
             {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    function("get_time", "Get the current time in a time zone.", {"zone": {"type": "string"}}, ["zone"]),
    function("search_web", "Search the web and return the top results.",
             {"query": {"type": "string"}, "results": {"type": "integer"}}, ["query"]),
    function("send_email", "Send an email.", {"to": {"type": "string"}, "subject": {"type": "string"},
                                               "body": {"type": "string"}}, ["to", "subject", "body"]),
]
QUESTIONS = [
    "What is the weather like in Paris today?",
    "Is it raining in Tokyo right now? Give me the temperature in fahrenheit.",
    "What time is it in New York?",
    "Tell me the current time in Europe/Berlin.",
    "Search the web for the best pasta recipes.",
    "Find me the latest news about the James Webb telescope, five results please.",
    "Email alice@example.com to tell her the meeting moved to 3pm.",
    "Send an email to bob@example.com with the subject 'Lunch' asking if he is free on Friday.",
    "How cold is it in Oslo?",
    "Look up who won the last football world cup.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--methods", default="ar,ngram,dflash,dflash+ngram")
    p.add_argument("--choices", default="required,auto")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--chat-template", default=None, help="a Jinja chat template in place of SmolLM2's")
    p.add_argument("--no-parallel", action="store_true", help="parallel_tool_calls false: one call at most")
    p.add_argument("--toolset", choices=["functions", "custom"], default="functions")
    p.add_argument("--show", action="store_true", help="print each reply")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    methods, choices = args.methods.split(","), args.choices.split(",")
    tools, questions = (TOOLS, QUESTIONS) if args.toolset == "functions" else (CUSTOM_TOOLS, CUSTOM_QUESTIONS)
    target = load_target_cached("smollm2-135m", release_plain=True)
    if args.chat_template:
        target.tokenizer.chat_template = chat_template_given(args.chat_template)
    style = tool_style(target.tokenizer)
    # a prefix cache per method, as `dflash serve` keeps one: every request opens with the same system message
    decoders = {m: SpeculativeDecoder(target, build_proposer(m, target)[0], prefix_cache_bytes=256 << 20)
                for m in methods}
    settle_heap()
    rows = []
    for choice in choices:
        request = tool_request(tools, choice, not args.no_parallel, style)
        fmt, schema = request.output_format()
        config = GenerationConfig(args.max_new_tokens, response_format=fmt, json_schema=schema)
        prompts = [encode_chat(target, [{"role": "user", "content": q}], request) for q in questions]
        reference = [decoders[methods[0]].generate(ids, config) for ids in prompts]  # untimed: the masks
        for method in methods[1:]:  # untimed: each method's prefix cache holds the system message
            decoders[method].generate(prompts[0], config)
        totals = {m: {"tokens": 0, "seconds": 0.0, "rounds": 0} for m in methods}
        for repeat in range(args.repeats):
            for ids, expected in zip(prompts, reference):
                for method in methods if repeat % 2 == 0 else methods[::-1]:
                    start = time.perf_counter()
                    result = decoders[method].generate(ids, config)
                    elapsed = time.perf_counter() - start
                    assert result.tokens == expected.tokens, (choice, method)
                    total = totals[method]
                    total["tokens"] += len(result.tokens)
                    total["seconds"] += elapsed
                    total["rounds"] += result.stats.num_rounds
        called = sum(request.calls(r.text) is not None for r in reference)
        for question, r in zip(questions, reference) if args.show else ():
            print(f"{question}\n  {r.text!r}")
        base = totals[methods[0]]
        for method in methods:
            total = totals[method]
            rows.append({"tool_choice": choice, "format": style, "method": method,
                         "tok_s": total["tokens"] / total["seconds"],
                         "tau": total["tokens"] / total["rounds"],
                         "speedup": (base["seconds"] / base["tokens"]) / (total["seconds"] / total["tokens"]),
                         "replies_that_call": called, "questions": len(questions), "tokens": total["tokens"],
                         "toolset": args.toolset})
    print(f"| tool_choice | method | tok/s | tau | vs {methods[0]} | replies that call |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['tool_choice']} | {row['method']} | {row['tok_s']:.1f} | {row['tau']:.2f} | "
              f"{row['speedup']:.2f}x | {row['replies_that_call']}/{row['questions']} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
                 if k != "out" and v not in (None, False)]
        Path(args.out).write_text(json.dumps({"command": " ".join(["scripts/tool_calls_bench.py", *flags]),
                                              "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
