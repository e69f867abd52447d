"""`dflash batch`: a JSONL of prompts answered as one continuous batch, each answer the target's own, appended as it
finishes and resumed by the same command."""

import json

import pytest

from dflash.cli import main
from dflash.engine import GenerationConfig, SpeculativeDecoder
from dflash.testing import tiny_target

ROWS = [{"id": "a", "prompt": "w1 w2 w3"}, {"id": "b", "question": "w4 w5"},
        {"id": "c", "messages": [{"role": "system", "content": "w9"}, {"role": "user", "content": "w6"},
                                 {"role": "assistant", "content": "w7"}, {"role": "user", "content": "w8"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "w2 w2"}, {"from": "gpt", "value": "w3"}]},
        {"id": "e", "prompt": "w1"}]


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def batch(tmp_path, *extra, rows=ROWS):
    source = write(tmp_path / "in.jsonl", rows)
    return main(["batch", str(source), "--output", str(tmp_path / "out.jsonl"), "--target", "tiny-qwen2",
                 "--max-new-tokens", "8", "--max-batch", "2", "--no-progress", *extra])


def answers(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]


def plain_greedy(messages):
    target = tiny_target("qwen2", logit_scale=4.0)  # the CLI's tiny-qwen2
    ids = target.encode_messages(messages)
    return SpeculativeDecoder(target).generate(ids, GenerationConfig(max_new_tokens=8)).text


@pytest.mark.parametrize("method", ["ngram", "dflash+ngram"])
def test_every_row_gets_the_targets_own_answer_once(tmp_path, method):
    assert batch(tmp_path, "--method", method) == 0
    got = {row["id"]: row for row in answers(tmp_path)}
    assert sorted(got) == ["a", "b", "c", "d", "e"]
    assert got["a"]["text"] == plain_greedy([{"role": "user", "content": "w1 w2 w3"}])
    assert got["b"]["text"] == plain_greedy([{"role": "user", "content": "w4 w5"}])
    assert got["c"]["text"] == plain_greedy(ROWS[2]["messages"])  # the chat as it stands, its answer included
    assert got["d"]["text"] == plain_greedy([{"role": "user", "content": "w2 w2"}])  # a finished chat's last turn
    assert all(row["new_tokens"] >= 1 and row["prompt_tokens"] > 1 for row in got.values())


def test_the_same_command_resumes_and_a_cut_line_is_written_again(tmp_path, capsys):
    assert batch(tmp_path, "--method", "ngram") == 0
    whole = {row["id"]: row["text"] for row in answers(tmp_path)}
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    (tmp_path / "out.jsonl").write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # killed mid-line
    assert batch(tmp_path, "--method", "ngram") == 0
    assert "1 of 5 answers already in" in capsys.readouterr().err
    rows = answers(tmp_path)  # every line whole again
    assert sorted(row["id"] for row in rows) == sorted(whole) and {r["id"]: r["text"] for r in rows} == whole


def test_a_rows_own_settings_take_the_command_lines_place(tmp_path):
    """A row's max_tokens, stop, temperature and seed (OpenAI's names) hold its answer alone."""
    from dflash.sampling import SamplingConfig

    target = tiny_target("qwen2", logit_scale=4.0)
    ids = target.encode_messages([{"role": "user", "content": "w1 w2 w3"}])

    def plain(max_new, **sampling):
        config = GenerationConfig(max_new_tokens=max_new, sampling=SamplingConfig(**sampling))
        return SpeculativeDecoder(target).generate(ids, config).text

    free = plain(8)
    word = free.split()[4]
    rows = [{"id": "short", "prompt": "w1 w2 w3", "max_tokens": 3},
            {"id": "stopped", "prompt": "w1 w2 w3", "stop": word},
            {"id": "sampled", "prompt": "w1 w2 w3", "temperature": 1.0, "seed": 4, "top_k": 20},
            {"id": "plain", "prompt": "w1 w2 w3"}]
    assert batch(tmp_path, "--method", "ngram", rows=rows) == 0
    got = {row["id"]: row for row in answers(tmp_path)}
    assert got["short"]["text"] == plain(3) and got["short"]["new_tokens"] == 3
    assert got["stopped"]["text"] == free[: free.index(word)] and got["stopped"]["finish_reason"] == "stop"
    assert got["sampled"]["text"] == plain(8, temperature=1.0, seed=4, top_k=20) != free
    assert got["plain"]["text"] == free


@pytest.mark.parametrize("rows, message", [
    ([{"id": "a", "prompt": "w1", "max_tokens": "many"}], "in.jsonl:1: max_tokens must be an integer"),
    ([{"id": "a", "prompt": "w1", "temperature": -1}], "in.jsonl:1: temperature must be >= 0"),
    ([{"id": "a", "prompt": "w1", "stop": [1]}], "stop must be a string or a list of strings"),
    ([{"id": "a", "prompt": "w1"}, {"id": "a", "prompt": "w2"}], "repeats the id 'a'"),
    ([{"id": "a", "text": "w1"}], "in.jsonl:1 needs a prompt"),
    ([{"id": "a", "turns": ["w1", "w2"]}], "`turns` one turn"),
    ([{"id": "a", "prompt": "w1 " * 5000}], "row 'a': prompt of"),
])
def test_bad_rows_are_one_line_errors(tmp_path, capsys, rows, message):
    assert batch(tmp_path, rows=rows) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "out.jsonl").exists()


# ---- a file in OpenAI's batch format ------------------------------------------------------------------------------
HELLO = [{"role": "user", "content": "w1 w2 w3"}]
BATCH_LINES = [
    {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "gpt-4o-mini", "messages": HELLO, "max_tokens": 8, "temperature": 0}},
    {"custom_id": "plain", "method": "POST", "url": "/v1/completions",
     "body": {"model": "tiny-qwen2", "prompt": "w1 w2", "max_tokens": 8, "temperature": 0}},
    {"custom_id": "responses", "method": "POST", "url": "/v1/responses",
     "body": {"input": "w1 w2 w3", "max_output_tokens": 8, "temperature": 0}},
    {"custom_id": "messages", "method": "POST", "url": "/v1/messages",
     "body": {"messages": HELLO, "max_tokens": 8, "temperature": 0}},
    {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": HELLO, "temperature": -1}},
]


def test_a_batch_file_in_openais_format_gets_the_servers_answers(tmp_path, capsys):
    """Each line's body is answered as `dflash serve` answers it (greedy: the target's own text), in OpenAI's batch
    output format; a bad body is that line's 400; the same command resumes by custom_id."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")  # noqa: F841 - the server's handlers are reached through it
    assert batch(tmp_path, rows=BATCH_LINES[:3]) == 0
    assert batch(tmp_path, rows=BATCH_LINES) == 0
    assert "3 of 5 answers already in" in capsys.readouterr().err
    lines = {line["custom_id"]: line for line in answers(tmp_path)}
    assert sorted(lines) == sorted(line["custom_id"] for line in BATCH_LINES)
    expected = plain_greedy(HELLO)
    chat = lines["chat"]["response"]
    assert chat["status_code"] == 200 and chat["body"]["choices"][0]["message"]["content"] == expected
    assert chat["body"]["model"] == "gpt-4o-mini"  # the model its body named, served for this file
    assert lines["responses"]["response"]["body"]["output"][0]["content"][0]["text"] == expected
    assert lines["messages"]["response"]["body"]["content"][0]["text"] == expected
    target = tiny_target("qwen2", logit_scale=4.0)
    plain = SpeculativeDecoder(target).generate(target.encode_prompt("w1 w2", chat=False),
                                                GenerationConfig(max_new_tokens=8)).text
    assert lines["plain"]["response"]["body"]["choices"][0]["text"] == plain
    bad = lines["bad"]["response"]
    assert bad["status_code"] == 400 and "temperature" in bad["body"]["error"]["message"]
    assert all(line["id"].startswith("batch_req_") and line["error"] is None for line in lines.values())


@pytest.mark.parametrize("line, message", [
    ({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {}}, "method must be POST"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}, "url must be one of"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"stream": True}}, "leave out stream"),
    ({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": "w1"}, "body must be an object"),
])
def test_bad_batch_lines_are_one_line_errors(tmp_path, capsys, line, message):
    assert batch(tmp_path, rows=[line]) == 2
    assert message in capsys.readouterr().err
    twice = [{**BATCH_LINES[0]}, {**BATCH_LINES[0]}]
    assert batch(tmp_path, rows=twice) == 2
    assert "repeats the custom_id 'chat'" in capsys.readouterr().err


def test_vllms_run_batch_command_line(tmp_path, capsys):
    """`-i INPUT -o OUTPUT` as vLLM's run-batch takes them (and --output-file): the same answers as the positional
    input and --output; the input given twice, or not at all, is a one-line error."""
    source = write(tmp_path / "in.jsonl", ROWS[:2])
    common = ["--target", "tiny-qwen2", "--method", "ngram", "--max-new-tokens", "8", "--no-progress"]
    assert main(["batch", str(source), "--output", str(tmp_path / "ours.jsonl"), *common]) == 0
    assert main(["batch", "-i", str(source), "-o", str(tmp_path / "theirs.jsonl"), *common]) == 0
    assert main(["batch", "--input-file", str(source), "--output-file", str(tmp_path / "long.jsonl"), *common]) == 0
    texts = [[json.loads(line)["text"] for line in (tmp_path / name).read_text().splitlines()]
             for name in ("ours.jsonl", "theirs.jsonl", "long.jsonl")]
    assert texts[0] == texts[1] == texts[2] and len(texts[0]) == 2
    for argv in (["batch", str(source), "-i", str(source)], ["batch"]):
        assert main([*argv, "-o", str(tmp_path / "x.jsonl"), *common]) == 2
        assert "give the input file once" in capsys.readouterr().err
