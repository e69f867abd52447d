"""`dflash bench` on tiny targets: the results schema, zero greedy mismatches across methods (hf included), two-turn
records, dataset resolution and user errors."""

import json
from pathlib import Path

import pytest

from dflash.bench import MethodSpec, parse_method, parse_methods, read_prompts, resolve_dataset, run_conversation
from dflash.bench_runners import Run
from dflash.cli import main
from dflash.errors import UserError

SCHEMA_TOP = {"target", "device", "dtype", "dataset", "num_prompts", "max_new_tokens", "temperature", "methods",
              "greedy_mismatches"}
RATE_KEYS = {"tokens_per_s", "tpot_ms", "ttft_ms"}
SPECULATIVE_KEYS = RATE_KEYS | {"tau", "speedup", "per_position_acceptance", "tau_histogram"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench(tmp_path, dataset, methods, *extra, name="out"):
    out = tmp_path / name
    code = main(["bench", "--target", "tiny-llama", "--device", "cpu", "--dataset", str(dataset), "--methods", methods,
                 "--max-new-tokens", "16", "--out", str(out), "--no-progress", *extra])
    return code, out


def test_a_missing_drafter_folder_is_said_before_the_target_loads(tmp_path, capsys, monkeypatch):
    import dflash.loading

    def no_loading(*_, **__):
        raise AssertionError("the target loaded before the drafter folders were checked")

    monkeypatch.setattr(dflash.loading, "target_from_args", no_loading)
    data = write_jsonl(tmp_path / "set.jsonl", [{"id": "a", "prompt": "w5 w6"}])
    code, _ = bench(tmp_path, data, "ar,dflash:whole", "--drafter", f"dflash={tmp_path / 'absent'}")
    err = capsys.readouterr().err
    assert code == 2 and f"dflash's drafter folder not found: {tmp_path / 'absent'}" in err and "Traceback" not in err


def test_results_schema_and_lossless(tmp_path, capsys):
    data = write_jsonl(tmp_path / "set.jsonl", [
        {"id": "a", "prompt": "w5 w6 w7 w5 w6 w7"}, {"id": "b", "prompt": "w10 w11"}, {"id": "c", "prompt": "w30"}])
    code, out = bench(tmp_path, data, "ar,ngram,dflash,eagle3,hf", "--block-size", "4", "--ignore-eos")
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert SCHEMA_TOP <= set(results)
    assert results["greedy_mismatches"] == 0 and results["num_prompts"] == 3 and results["target"] == "tiny-llama"
    assert results["greedy_screen"] == "bfloat16"  # untimed tiny targets screen wherever they can
    methods = results["methods"]
    assert list(methods) == ["ar", "ngram", "dflash", "eagle3", "hf"]
    assert RATE_KEYS <= set(methods["ar"])
    for method in ("ngram", "dflash", "eagle3"):
        stats = methods[method]
        assert SPECULATIVE_KEYS <= set(stats), method
        assert 1.0 <= stats["tau"] <= stats["block_size"]
        assert sum(stats["tau_histogram"]) == stats["num_rounds"]
    assert methods["ngram"]["tau"] >= 1.0 and len(methods["ngram"]["per_position_acceptance"]) == 3
    assert len(methods["eagle3"]["per_position_acceptance"]) == 3  # --block-size 4 means a chain of 3 for EAGLE-3
    # --ignore-eos: every method produced exactly max_new_tokens per prompt
    assert all(m["new_tokens"] == 3 * 16 for m in methods.values())
    assert results["ar_vs_hf_tokens_per_s"] > 0 and "speedup" in methods["hf"]
    for method in ("ngram", "dflash", "eagle3", "hf"):
        low, high = methods[method]["speedup_ci95"]
        assert low <= high and methods[method]["e2e_speedup_ci95"][0] <= methods[method]["e2e_speedup_ci95"][1]
    low, high = methods["dflash"]["tau_ci95"]
    assert 1.0 <= low <= high <= 4 and "tau_ci95" not in methods["hf"]
    rows = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 5 and all(r["same_as_ar"] for r in rows)
    table = (out / "results.md").read_text()
    assert "| eagle3 |" in table and "greedy mismatches vs ar: 0" in table
    # what the figures ran on: the CPU by name with the instruction sets the kernels use, in the JSON and the report
    machine = results["machine"]
    assert set(machine["cpu"]["isa"]) <= {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile",
                                          "amx_bf16"}
    assert machine["native_kernels"] and f"machine: {machine['cpu']['model']}" in table
    assert "| dflash |" in capsys.readouterr().out
    for plot in ("tau_histogram.png", "per_position_acceptance.png", "speedup.png"):
        assert (out / plot).stat().st_size > 0


def prompt_totals(decode_s: float, rounds: list[int], block_size: int = 4):
    from dflash.bench import Totals
    from dflash.bench_runners import Run

    totals = Totals(block_size=block_size)
    tokens = sum(rounds) + 1
    totals.add(Run(list(range(tokens)), "", ttft_s=0.01, total_s=0.01 + decode_s, accept_lengths=rounds,
                   draft_lengths=[block_size - 1] * len(rounds)))
    return totals


def test_intervals_are_paired_bootstrap_percentiles():
    """The intervals hold the pooled figure, narrow as prompts multiply (the same spread over 4x the prompts: about
    half as wide), collapse where every prompt agrees, and are the same for the same runs."""
    from dflash.bench import intervals

    ar = [prompt_totals(d, [1] * 20) for d in (1.0, 2.0, 1.5, 1.2)]
    fast = [prompt_totals(d, r) for d, r in ((0.5, [2] * 10), (1.9, [1] * 20), (0.8, [3, 1] * 5), (1.0, [2, 1] * 7))]
    bounds = intervals({"ar": ar, "dflash": fast})["dflash"]
    speedup = sum(t.decode_s for t in ar) / sum(t.decode_s for t in fast)  # equal decode tokens per prompt
    assert bounds["speedup_ci95"][0] < speedup < bounds["speedup_ci95"][1]
    tau = sum(sum(t.accept_lengths) for t in fast) / sum(len(t.accept_lengths) for t in fast)
    assert bounds["tau_ci95"][0] < tau < bounds["tau_ci95"][1]
    wider = intervals({"ar": ar * 4, "dflash": fast * 4})["dflash"]["speedup_ci95"]
    ratio = (wider[1] - wider[0]) / (bounds["speedup_ci95"][1] - bounds["speedup_ci95"][0])
    assert 0.35 < ratio < 0.65
    same = intervals({"ar": ar, "dflash": [prompt_totals(t.decode_s / 2, [2] * 10) for t in ar]})["dflash"]
    assert same["speedup_ci95"] == pytest.approx([2.0, 2.0]) and same["tau_ci95"] == pytest.approx([2.0, 2.0])
    assert intervals({"ar": ar, "dflash": fast}) == intervals({"ar": ar, "dflash": fast})
    assert intervals({"ar": ar[:1], "dflash": fast[:1]})["dflash"]["speedup_ci95"] is None


def test_two_turn_records(tmp_path):
    data = write_jsonl(tmp_path / "mt.jsonl", [{"id": 81, "turns": ["w1 w2 w3", "w4 w5"]}, {"id": 82, "prompt": "w9"}])
    code, out = bench(tmp_path, data, "ar,ngram")
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["greedy_mismatches"] == 0 and results["num_prompts"] == 2 and results["num_generations"] == 3
    rows = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert sorted((r["id"], r["turn"]) for r in rows if r["method"] == "ngram") == [("81", 0), ("81", 1), ("82", 0)]


def test_hf_lookup_is_transformers_prompt_lookup_beside_plain_generate(tmp_path, monkeypatch):
    """hf-lookup drafts through transformers' own PromptLookupCandidateGenerator (hf never does) and, greedy,
    gives ar's tokens"""
    from transformers.generation import candidate_generator

    lookups = []
    real = candidate_generator.PromptLookupCandidateGenerator.get_candidates
    monkeypatch.setattr(candidate_generator.PromptLookupCandidateGenerator, "get_candidates",
                        lambda self, *a, **k: lookups.append(1) or real(self, *a, **k))
    data = write_jsonl(tmp_path / "set.jsonl", [{"prompt": "w1 w2 w3 w4 w1 w2 w3 w4 w1 w2"}])
    code, out = bench(tmp_path, data, "hf")
    assert code == 0 and not lookups
    code, out = bench(tmp_path, data, "hf,hf-lookup", name="lookup")
    assert code == 0 and lookups
    results = json.loads((out / "results.json").read_text())
    assert list(results["methods"]) == ["ar", "hf", "hf-lookup"] and "speedup" in results["methods"]["hf-lookup"]
    rows = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert {r["method"] for r in rows} == {"ar", "hf", "hf-lookup"} and all(r["same_as_ar"] for r in rows)


def test_a_chat_row_runs_its_user_turns_after_its_system_message(tmp_path):
    """An OpenAI `messages` row: the system message opens every turn's conversation, the row's own assistant
    answers are dropped, and each later turn follows the method's own answer."""
    data = write_jsonl(tmp_path / "chat.jsonl", [{"id": "c", "messages": [
        {"role": "system", "content": "w7"}, {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "not this"}, {"role": "user", "content": "w3"}]}])
    (prompt,) = read_prompts(data, "chat")
    assert prompt.turns == ["w1 w2", "w3"] and prompt.system == "w7"

    class Target:
        def __init__(self):
            self.encoded = []

        def encode_prompt(self, text):
            self.encoded.append([{"role": "user", "content": text}])
            return [1]

        def encode_messages(self, messages):
            self.encoded.append([dict(m) for m in messages])
            return [2]

    class Runner:
        def generate(self, ids, max_new, ignore_eos):
            return Run(tokens=[5], text=f"answer {len(ids)}", ttft_s=0.5, total_s=1.0)

    target = Target()
    run_conversation(Runner(), target, prompt, 4, False)
    system, first = {"role": "system", "content": "w7"}, {"role": "user", "content": "w1 w2"}
    assert target.encoded == [[system, first],
                              [system, first, {"role": "assistant", "content": "answer 1"},
                               {"role": "user", "content": "w3"}]]
    code, out = bench(tmp_path, data, "ar,ngram")
    assert code == 0 and json.loads((out / "results.json").read_text())["num_generations"] == 2


def test_without_out_each_run_gets_a_folder_of_its_own(tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "w1 w2"}])
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        assert main(["bench", "--target", "tiny-llama", "--device", "cpu", "--dataset", str(data), "--methods", "ar",
                     "--max-new-tokens", "4", "--no-progress"]) == 0
    folders = sorted((tmp_path / "runs" / "bench").iterdir())
    assert len(folders) == 2 and all(f.name.startswith("mine-") for f in folders)
    for folder in folders:
        results = json.loads((folder / "results.json").read_text())
        assert results["command"].endswith(f"--out {folder.relative_to(tmp_path)}")
    assert f"results: {folders[0].relative_to(tmp_path)}" in capsys.readouterr().out


def test_limit_and_sampling(tmp_path):
    data = write_jsonl(tmp_path / "set.jsonl", [{"prompt": f"w{i} w{i + 1}"} for i in range(5, 12)])
    code, out = bench(tmp_path, data, "ngram", "--limit", "2", "--temperature", "0.8")
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["num_prompts"] == 2 and list(results["methods"]) == ["ar", "ngram"]
    assert results["greedy_mismatches"] is None  # sampled outputs are not compared
    memory = results["memory"]  # the process's, after loading and at its peak
    if Path("/proc/self/status").exists():
        assert 0 < memory["resident_mb_after_loading"] <= memory["peak_resident_mb"]
        assert f"memory: {memory['resident_mb_after_loading']} MB resident after loading" in (
            out / "results.md").read_text()


def test_builtin_names_and_templates(tmp_path, monkeypatch):
    write_jsonl(tmp_path / "gsm8k_test.jsonl", [{"id": "g0", "prompt": "What is 2+2?"}])
    write_jsonl(tmp_path / "humaneval.jsonl", [{"id": "h0", "prompt": "def f(x):\n    "}])
    monkeypatch.setenv("DFLASH_DATA_DIR", str(tmp_path))
    path, template = resolve_dataset("gsm8k")
    assert path == tmp_path / "gsm8k_test.jsonl" and template == "math"
    (prompt,) = read_prompts(path, template)
    assert prompt.turns[0].startswith("What is 2+2?") and "\\boxed{}" in prompt.turns[0]
    (code,) = read_prompts(*resolve_dataset("humaneval"))
    assert "```python\ndef f(x):" in code.turns[0]
    assert resolve_dataset(str(tmp_path / "gsm8k_test.jsonl"))[1] == "math"  # a path to a known file: same template
    assert resolve_dataset(str(tmp_path / "gsm8k_test.jsonl"), "chat")[1] == "chat"
    with pytest.raises(UserError, match="not found"):
        resolve_dataset("math500")


def test_methods_parsing():
    assert parse_methods("dflash,ngram,dflash") == ["ar", "dflash", "ngram"]
    assert parse_methods("dflash@8,dflash@16:whole,eagle3@3") == ["ar", "dflash@8", "dflash@16:whole", "eagle3@3"]
    assert parse_method("dflash@16:whole") == MethodSpec("dflash", 16, True)
    assert parse_method("eagle3:whole") == MethodSpec("eagle3", None, True)
    assert parse_method("eagle3@2") == MethodSpec("eagle3", 2)
    assert parse_method("dflash+ngram@8") == MethodSpec("dflash+ngram", 8)
    assert parse_method("dflash:tree15") == MethodSpec("dflash", None, False, 15)
    assert parse_method("eagle3@5:tree31:whole") == MethodSpec("eagle3", 5, True, 31)
    for bad in ("dflash@x", "dflash@1", "eagle3@1", "ngram@4:0.1", "dflash@8:half", "hf@4", "ar@2", "ar:whole",
                "dflash:treex", "dflash:tree", "dflash:whole:whole", "dflash:tree7:tree8", "ar:tree7"):
        with pytest.raises(UserError):
            parse_method(bad)


def test_settings_side_by_side(tmp_path):
    """One method at several settings in one run: each is its own row, with its own block size, all lossless."""
    dataset = tmp_path / "set.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 3} w9"}) + "\n" for i in range(2)))
    code, out = bench(tmp_path, dataset, "dflash,dflash@4,dflash@8:whole,eagle3@3,ngram@3")
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and results["greedy_mismatches"] == 0
    methods = results["methods"]
    assert list(methods) == ["ar", "dflash", "dflash@4", "dflash@8:whole", "eagle3@3", "ngram@3"]
    assert set(methods["dflash@8:whole"]["draft_length_histogram"][:-1]) == {0}  # whole blocks: always 7 drafts
    assert len(methods["dflash@4"]["per_position_acceptance"]) == 3
    assert len(methods["eagle3@3"]["per_position_acceptance"]) == 2  # block size 3: a chain of 2
    assert len(methods["ngram@3"]["per_position_acceptance"]) == 2
    with pytest.raises(UserError, match="unknown method"):
        parse_methods("ar,medusa")


@pytest.mark.parametrize("case", ["missing", "bad_json", "no_prompt", "unknown_method", "empty"])
def test_bad_input_exits_2(tmp_path, capsys, case):
    dataset, methods = tmp_path / "set.jsonl", "ar"
    if case == "bad_json":
        dataset.write_text('{"prompt": "w1"}\n{"prompt": \n')
    elif case == "no_prompt":
        write_jsonl(dataset, [{"text": "w1"}])
    elif case == "empty":
        dataset.write_text("\n")
    elif case == "unknown_method":
        write_jsonl(dataset, [{"prompt": "w1"}])
        methods = "ar,medusa"
    code, _ = bench(tmp_path, dataset, methods)
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash: error:") and "Traceback" not in err
    if case == "bad_json":
        assert "set.jsonl:2" in err


def test_gguf_weight_type_comes_from_the_last_name_suffix():
    from pathlib import Path

    from dflash.bench_runners import quantization_of

    assert quantization_of(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "Q4_1"
    assert quantization_of(Path("SmolLM2-135M-Instruct.Q4_1.F32.gguf")) == "F32"  # our F32 copy of it
    assert quantization_of(Path("gemma-3-270m-q4_k_m.gguf")) == "Q4_K_M"
    assert quantization_of(Path("model.gguf")) == "unknown"


@pytest.mark.real_model
@pytest.mark.parametrize("kind", ["f32", "bf16", "q8_0"])
def test_float_copies_of_the_registry_gguf(tmp_path, kind):
    """`--llamacpp-gguf f32` / `bf16` / `q8_0`: llama.cpp's converter writes the copy once, with the float32
    target's weights (bf16: rounded to bfloat16, the bfloat16 target's; q8_0: llama.cpp's int8 of them)."""
    pytest.importorskip("llama_cpp")
    import shutil

    import gguf

    from dflash.bench_runners import converted_gguf
    from dflash.hub import fetch_gguf

    source = tmp_path / fetch_gguf("smollm2-135m").name
    shutil.copy(fetch_gguf("smollm2-135m"), source)
    copy = converted_gguf(source, kind)
    assert copy.name.endswith(f".{kind.upper()}.gguf") and converted_gguf(source, kind) == copy  # made once
    tensors = {t.name: t for t in gguf.GGUFReader(copy).tensors}
    expected = getattr(gguf.GGMLQuantizationType, kind.upper())
    assert tensors["blk.0.ffn_up.weight"].tensor_type == expected


def test_a_mismatch_reports_the_targets_logit_gap_where_the_outputs_part():
    import torch

    from dflash.bench import logit_gap
    from dflash.bench_report import mismatch_summary
    from dflash.bench_runners import Run
    from dflash.testing import tiny_target

    target = tiny_target("llama", logit_scale=4.0)
    prompt = [1, 5, 9]
    with torch.inference_mode():
        logits = target.forward(torch.tensor([prompt + [7, 3]]), logits_at="last").logits[0, -1]
    ranked = logits.argsort(descending=True).tolist()
    reference = Run([7, 3, ranked[0], 4], "", 0.0, 0.0, prompt_ids=prompt)
    gap = logit_gap(target, reference, [7, 3, ranked[2]], at=2)
    assert gap == pytest.approx(float(logits[ranked[0]] - logits[ranked[2]]), abs=1e-3) and gap > 0
    assert logit_gap(target, reference, [7, 3], at=2) is None  # the method merely stopped first
    assert mismatch_summary([]) == "0"
    assert mismatch_summary([{"logit_gap": 0.0}, {"logit_gap": -0.125}, {"logit_gap": None}]) == (
        "3 (largest logit gap at the first difference: 0.125)")


def test_the_command_and_report_say_how_the_target_ran(tmp_path):
    """CUDA graphs as asked (or not asked: the device decides) and the measured attention backend."""
    from dflash.bench_report import attention_note

    data = write_jsonl(tmp_path / "set.jsonl", [{"id": "a", "prompt": "w5 w6 w7"}])
    code, out = bench(tmp_path, data, "ar", "--no-cuda-graphs")
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and results["cuda_graphs"] is False and "--no-cuda-graphs" in results["command"]
    code, out = bench(tmp_path, data, "ar", name="default")
    results = json.loads((out / "results.json").read_text())
    assert "cuda-graphs" not in results["command"] and "CUDA graphs" not in (out / "results.md").read_text()
    assert attention_note({"kernels": "auto"}) == ""
    note = attention_note({"attention": {"sdpa": "flash", "measured": True,
                                         "ms_per_call": {"default": 1.512, "flash": 0.0412}}})
    assert note == ", attention: flash (ms per call: default 1.51, flash 0.0412)"


def test_a_method_that_changes_the_output_is_caught_with_its_logit_gap(tmp_path, monkeypatch):
    """A (deliberately broken) method whose third token differs from ar's: counted, located, its gap reported, and
    the bench exits 1."""
    from dflash import bench as bench_module

    build = bench_module.build_runners

    def broken_ngram(methods, target, args, sampling):
        runners = build(methods, target, args, sampling)
        generate = runners["ngram"].generate

        def wrong_third_token(ids, max_new, ignore_eos):
            run = generate(ids, max_new, ignore_eos)
            run.tokens = run.tokens[:2] + [(run.tokens[2] + 1) % 64] + run.tokens[3:]
            return run

        runners["ngram"].generate = wrong_third_token
        return runners

    monkeypatch.setattr(bench_module, "build_runners", broken_ngram)
    data = write_jsonl(tmp_path / "set.jsonl", [{"id": "a", "prompt": "w5 w6 w7"}, {"id": "b", "prompt": "w9"}])
    code, out = bench(tmp_path, data, "ar,ngram", "--ignore-eos")
    results = json.loads((out / "results.json").read_text())
    assert code == 1 and results["greedy_mismatches"] == 2
    assert {m["method"] for m in results["mismatches"]} == {"ngram"}
    assert all(m["first_difference"] == 2 and m["logit_gap"] > 0 for m in results["mismatches"])
    assert "largest logit gap at the first difference" in (out / "results.md").read_text()


def interrupt_at(monkeypatch, prompt_id: str, signal_name: str | None = None):
    """The bench's generations raise Ctrl-C's KeyboardInterrupt (or deliver a real signal to this process) at the
    first run of the prompt `prompt_id`."""
    import os
    import signal

    from dflash import bench as bench_module

    run_conversation = bench_module.run_conversation

    def interrupted(runner, target, prompt, *args):
        if prompt.id == prompt_id:
            if signal_name is None:
                raise KeyboardInterrupt
            os.kill(os.getpid(), getattr(signal, signal_name))
        return run_conversation(runner, target, prompt, *args)

    monkeypatch.setattr(bench_module, "run_conversation", interrupted)


@pytest.mark.parametrize("how", [None, "SIGTERM"])
def test_an_interrupted_bench_writes_the_prompts_every_method_finished(tmp_path, monkeypatch, how):
    """Ctrl-C or `kill` (as `timeout` sends) during the third prompt: the first two are written, marked as an
    interrupted run, and the command exits 130."""
    import signal

    data = write_jsonl(tmp_path / "set.jsonl", [{"id": i, "prompt": p} for i, p in
                                                (("a", "w5 w6 w7"), ("b", "w9"), ("c", "w11 w12"))])
    interrupt_at(monkeypatch, "c", how)
    handler = signal.getsignal(signal.SIGTERM)
    code, out = bench(tmp_path, data, "ar,ngram", "--ignore-eos")
    assert code == 130 and signal.getsignal(signal.SIGTERM) == handler  # the bench's own handler is gone again
    results = json.loads((out / "results.json").read_text())
    assert results["num_prompts"] == 2 and results["interrupted"] == {"prompts_done": 2, "prompts_asked": 3}
    assert all(m["new_tokens"] == 2 * 16 for m in results["methods"].values())
    assert results["greedy_mismatches"] == 0 and results["methods"]["ngram"]["tau"] >= 1.0
    rows = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == ["a", "a", "b", "b"]
    assert "2 prompts (interrupted: 2 of the 3 asked)" in (out / "results.md").read_text()


def test_a_bench_interrupted_before_its_first_prompt_finished_writes_nothing(tmp_path, monkeypatch, capsys):
    data = write_jsonl(tmp_path / "set.jsonl", [{"id": "a", "prompt": "w5 w6 w7"}, {"id": "b", "prompt": "w9"}])
    interrupt_at(monkeypatch, "a")
    code, out = bench(tmp_path, data, "ar,ngram", "--ignore-eos")
    assert code == 130 and not (out / "results.json").exists()
    assert "interrupted" in capsys.readouterr().err


def test_a_run_that_made_graphs_is_timed_again_on_their_replays(tmp_path, monkeypatch):
    """With graphs on (their bookkeeping run eagerly here, as the CPU tests run it), a timed run that meets a graph
    width the short warm-up did not is run again and its repeat kept: the same tokens, and a repeat that made no
    graph of its own. The warm-up's 8 tokens of `ar` need only width 1, `dflash:whole`'s rounds wider ones."""
    from dflash import bench as bench_module
    from dflash.models.target import TargetModel

    use_graphs = TargetModel.use_graphs
    monkeypatch.setattr(TargetModel, "use_graphs", lambda self, capacity=2048, capture=None:
                        use_graphs(self, capacity, capture=False))
    run_conversation, calls = bench_module.run_conversation, []

    def counted(runner, target, prompt, *args):
        made = bench_module.graphs_made(target, {"r": runner})
        runs = run_conversation(runner, target, prompt, *args)
        calls.append((prompt.id, runner.method, bench_module.graphs_made(target, {"r": runner}) - made, runs))
        return runs

    monkeypatch.setattr(bench_module, "run_conversation", counted)
    data = write_jsonl(tmp_path / "set.jsonl", [{"id": "a", "prompt": "w5 w6 w7 w5 w6 w7"}, {"id": "b", "prompt": "w9"}])
    code, out = bench(tmp_path, data, "ar,dflash:whole", "--cuda-graphs", "--block-size", "8", "--ignore-eos")
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and results["cuda_graphs"] is True and results["greedy_mismatches"] == 0
    timed = calls[2:]  # after the two warm-ups
    again = [(i, c) for i, c in enumerate(timed) if c[2] > 0]
    assert again, "no timed run met a new graph width: the test no longer tests anything"
    for i, (prompt_id, method, made, runs) in again:
        repeat = timed[i + 1]
        assert repeat[:2] == (prompt_id, method) and repeat[2] == 0
        assert [r.tokens for r in repeat[3]] == [r.tokens for r in runs]
    retimed = {}
    for _, (_, method, _, _) in again:
        retimed[method] = retimed.get(method, 0) + 1
    assert results["retimed_runs"] == retimed
    assert "timed again on replays: " in (out / "results.md").read_text()


STUB_LLAMA_CPP = '''
import os, signal

class Llama:
    def __init__(self, model_path, **kwargs):
        if os.environ.get("STUB_LOAD_ERROR"):
            raise ValueError("not a GGUF file")
        self.calls = 0

    def reset(self):
        pass

    def generate(self, prompt, **kwargs):
        self.calls += 1
        if self.calls > int(os.environ.get("STUB_CRASH_AFTER", "1000000")):
            os.kill(os.getpid(), signal.SIGILL)  # as llama.cpp's AMX path died on a Xeon
        token = sum(prompt) % 40 + 3
        while True:
            yield token
            token = token % 40 + 4
'''


@pytest.fixture
def stub_llama_cpp(tmp_path, monkeypatch):
    """A stand-in llama_cpp package, seen by this process and by the worker's (its tokens: a fixed walk from the
    prompt), and a GGUF path for it; STUB_CRASH_AFTER=N kills the worker by SIGILL at its (N+1)-th generation."""
    import os

    package = tmp_path / "stub" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(STUB_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(tmp_path / "stub"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "stub"), os.environ.get("PYTHONPATH", "")]))
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    return gguf


def test_llama_cpp_runs_in_a_process_of_its_own(tmp_path, stub_llama_cpp):
    data = write_jsonl(tmp_path / "set.jsonl", [{"id": str(i), "prompt": f"w{i} w{i + 1}"} for i in range(3)])
    code, out = bench(tmp_path, data, "ar,llamacpp", "--llamacpp-gguf", str(stub_llama_cpp))
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and "failed" not in results
    assert results["llamacpp"]["llamacpp"]["quantization"] == "Q4_1"
    assert results["methods"]["llamacpp"]["tokens_per_s"] > 0
    rows = [json.loads(line) for line in (out / "per_prompt.jsonl").read_text().splitlines()]
    assert len([r for r in rows if r["method"] == "llamacpp"]) == 3


def test_a_llama_cpp_crash_drops_it_and_the_benchmark_goes_on(tmp_path, stub_llama_cpp, monkeypatch, capsys):
    """llama.cpp's native code can die (SIGILL in its AMX path on an Intel Xeon): the other methods' results are
    kept and written, and the user is told which baseline went and why."""
    monkeypatch.setenv("STUB_CRASH_AFTER", "2")  # the warm-up and one prompt, then SIGILL
    data = write_jsonl(tmp_path / "set.jsonl", [{"id": str(i), "prompt": f"w{i} w{i + 1}"} for i in range(3)])
    code, out = bench(tmp_path, data, "ar,dflash:whole,llamacpp", "--llamacpp-gguf", str(stub_llama_cpp))
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and results["num_prompts"] == 3
    assert set(results["methods"]) == {"ar", "dflash:whole"}
    assert "signal SIGILL" in results["failed"]["llamacpp"] and "GGML_AMX" in results["failed"]["llamacpp"]
    assert "llamacpp dropped from this run" in capsys.readouterr().err


def test_a_gguf_llama_cpp_cannot_load_is_a_user_error(tmp_path, stub_llama_cpp, monkeypatch, capsys):
    monkeypatch.setenv("STUB_LOAD_ERROR", "1")
    data = write_jsonl(tmp_path / "set.jsonl", [{"id": "a", "prompt": "w5 w6"}])
    code, _ = bench(tmp_path, data, "ar,llamacpp", "--llamacpp-gguf", str(stub_llama_cpp))
    err = capsys.readouterr().err
    assert code == 2 and "llama.cpp could not load" in err and "not a GGUF file" in err and "Traceback" not in err


def test_a_bench_folders_plots_are_drawn_again_from_its_json(tmp_path):
    """scripts/replot_bench.py: the bench folders under docs/data keep results.json, not their PNGs."""
    import importlib.util
    import shutil

    pytest.importorskip("matplotlib")
    script = Path(__file__).resolve().parent.parent / "scripts/replot_bench.py"
    spec = importlib.util.spec_from_file_location("replot_bench", script)
    replot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replot)
    kept = script.parent.parent / "docs/data/session48/bench_bf16_gsm8k/results.json"
    shutil.copy(kept, tmp_path / "results.json")
    assert replot.main([str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["per_position_acceptance.png", "speedup.png",
                                                              "tau_histogram.png"]
    assert replot.main([str(tmp_path / "missing")]) == 2


def test_batch_throughput_runs_every_method_as_continuous_batches(tmp_path, capsys, monkeypatch):
    """--batch N: each method answers every prompt, up to N rows at a time, its outputs the plain greedy ones (the
    same as the single-sequence bench gives); a table and results.json; baselines, which cannot batch in our engine,
    are refused; a method that changes an output makes the run exit 1."""
    from dflash.bench_batch import batch_run

    rows = [{"id": str(i), "prompt": p} for i, p in enumerate(["w1 w2 w3", "w4 w5", "w6 w1 w6 w1", "w9 w2", "w3 w7"])]
    data = write_jsonl(tmp_path / "set.jsonl", rows)
    code, out = bench(tmp_path, data, "ar,ngram,dflash+ngram,dflash:whole", "--batch", "2", "--batch-runs", "2")
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert code == 0 and "outputs identical" in printed and "x ar" in printed
    assert list(results["methods"]) == ["ar", "ngram", "dflash+ngram", "dflash:whole"] and not results["mismatched"]
    assert results["methods"]["ar"]["tau"] == 1.0 and results["methods"]["ar"]["speedup"] == 1.0
    assert len({m["tokens"] for m in results["methods"].values()}) == 1
    assert all(len(m["seconds_by_run"]) == 2 for m in results["methods"].values())
    single_code, single = bench(tmp_path, data, "ar", name="single")
    single_tokens = [r["new_tokens"] for r in map(json.loads, (single / "per_prompt.jsonl").read_text().splitlines())]
    assert single_code == 0 and results["methods"]["ar"]["tokens"] == sum(single_tokens)
    assert bench(tmp_path, data, "ar,hf", "--batch", "2", name="hf")[0] == 2
    assert "cannot run in it" in capsys.readouterr().err
    long = write_jsonl(tmp_path / "long.jsonl", rows[:1] + [{"id": "long", "prompt": "w1 " * 600}])
    assert bench(tmp_path, long, "ar,ngram", "--batch", "2", name="long")[0] == 2  # refused before anything runs
    assert "does not fit" in capsys.readouterr().err

    def wrong_second_row(*args):
        timed = batch_run(*args)
        if args[1].name == "ngram":
            timed["outputs"][1] = timed["outputs"][1][:-1]
        return timed

    monkeypatch.setattr("dflash.bench_batch.batch_run", wrong_second_row)
    assert bench(tmp_path, data, "ar,ngram", "--batch", "2", "--batch-runs", "1", name="broken")[0] == 1
    assert "ngram gave other outputs than ar" in capsys.readouterr().err
