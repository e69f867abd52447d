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


@pytest.mark.parametrize("rows, message", [
    ([{"id": "a", "prompt": "w1"}, {"id": "a", "prompt": "w2"}], "repeats the id 'a'"),
    ([{"id": "a", "text": "w1"}], "in.jsonl:1 needs a prompt"),
    ([{"id": "a", "turns": ["w1", "w2"]}], "`turns` one turn"),
    ([{"id": "a", "prompt": "w1 " * 5000}], "row 'a': prompt of"),
])
def test_bad_rows_are_one_line_errors(tmp_path, capsys, rows, message):
    assert batch(tmp_path, rows=rows) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and not (tmp_path / "out.jsonl").exists()
