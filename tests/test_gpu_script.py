"""scripts/train_gpu.sh, run on the CPU at tiny scale: data (with several samples per prompt), packing, training
with time-based checkpoints, and a second run that resumes instead of starting over."""

import json
import time
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_gpu.sh"


def run_script(tmp_path: Path, out: Path) -> subprocess.CompletedProcess:
    prompts = tmp_path / "mine.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 2} w{i + 5}"}) + "\n" for i in range(6)))
    env = dict(os.environ, DFLASH_DATA_DIR=str(tmp_path), DEVICE="cpu", DTYPE="float32", PY=sys.executable,
               INPUTS="mine.jsonl", SHAREGPT="0", SAMPLES="2", MAX_NEW="8", BATCH="4", LAYERS="1", EPOCHS="1",
               ANCHORS="8", GRAD_ACCUM="2", SAVE_MINUTES="0.001", LOSS="kl", KV_HEADS="4")
    return subprocess.run(["bash", str(SCRIPT), "tiny-qwen3", str(out)], env=env, capture_output=True, text=True,
                          timeout=600)


def test_the_gpu_script_runs_end_to_end_and_resumes(tmp_path):
    out = tmp_path / "run"
    first = run_script(tmp_path, out)
    assert first.returncode == 0, first.stderr[-2000:]
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["inputs"] == 12  # 6 prompts x 2 samples
    assert manifest["settings"]["samples"] == 2
    assert json.loads((out / "corpus" / "corpus.json").read_text())["records"] == manifest["counts"]["ok"]
    assert (out / "train" / "final" / "model.safetensors").is_file()
    assert (out / "train" / "final" / "draft_vocab.json").is_file()
    config = json.loads((out / "train" / "train_config.json").read_text())
    assert (config["num_layers"], config["loss"], config["save_minutes"], config["kv_heads"]) == (1, "kl", 0.001, 4)
    second = run_script(tmp_path, out)  # everything done: data skips every row, training resumes at its end
    assert second.returncode == 0, second.stderr[-2000:]
    assert "resumed from" in second.stderr and "0 to regenerate" in second.stderr


def run_lease_script(tmp_path, name: str, prompts: int, **env) -> tuple[Path, str]:
    """scripts/lease/NAME at tiny scale on the CPU (tiny-llama, ar and ngram, `prompts` GSM8K-shaped prompts);
    returns the folder that would come back ($OUT) and the script's stdout."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "gsm8k_test.jsonl").write_text(
        "".join(json.dumps({"id": f"g{i}", "prompt": f"w{i} w{i + 2} w{i + 5}"}) + "\n" for i in range(prompts)))
    out = tmp_path / "out"
    env = dict(os.environ, PY=sys.executable, DEVICE="cpu", DTYPE="float32", TARGET="tiny-llama", METHODS="ar,ngram",
               NEW="8", DFLASH_DATA_DIR=str(data), ROOT=str(tmp_path / "root"), OUT=str(out), **env)
    done = subprocess.run(["bash", str(SCRIPT.parent / "lease" / name)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, done.stdout


def test_the_lease_bench_script_runs_on_the_cpu_and_sends_its_tables_back(tmp_path):
    """scripts/lease/bench.sh, the GPU lease's bench call, at tiny scale on the CPU (no graphs there): the tables
    and logs land in $OUT, and the methods' outputs agree."""
    out, stdout = run_lease_script(tmp_path, "bench.sh", prompts=2, LIMIT="2")
    assert "eager: rc=0" in stdout
    results = json.loads((out / "eager.results.json").read_text())
    assert results["greedy_mismatches"] == 0 and set(results["methods"]) == {"ar", "ngram"}
    assert (out / "eager.results.md").is_file() and (out / "env-and-tests.txt").is_file()
    assert "== eager" in (out / "logs.txt").read_text()
    assert not (out / "graphs.results.json").exists()  # CUDA graphs only where CUDA is


def test_the_lease_profile_script_prints_where_the_time_went(tmp_path):
    """scripts/lease/profile.sh at tiny scale on the CPU: the profiler's table of ops by host time, also in $OUT."""
    out, _ = run_lease_script(tmp_path, "profile.sh", prompts=1, FLAGS="")
    profile = (out / "profile.txt").read_text()
    assert "Self CPU time total" in profile and "aten::" in profile and "| ngram |" in profile


def tiny_lease(tmp_path) -> dict:
    """The environment of a lease's training call at tiny scale on the CPU: a corpus the tiny Llama regenerated, no
    warm start, 8 anchors, one sequence a step."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "mine.jsonl").write_text(
        "".join(json.dumps({"id": i, "prompt": f"w{i} w{i + 2} w{i + 5}"}) + "\n" for i in range(12)))
    env = {name: value for name, value in os.environ.items() if name != "OMP_NUM_THREADS"}  # train.sh shares cores
    env.update(DFLASH_DATA_DIR=str(data))
    for command in (["data", "--target", "tiny-llama", "--device", "cpu", "--input", "mine.jsonl", "--max-new-tokens",
                     "8", "--batch-size", "6", "--out", str(tmp_path / "regenerated")],
                    ["data", "--out", str(tmp_path / "regenerated"), "--pack", str(tmp_path / "corpus")]):
        made = subprocess.run([sys.executable, "-m", "dflash", *command], env=env, capture_output=True, text=True,
                              timeout=300)
        assert made.returncode == 0, made.stderr[-2000:]
    env.update(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", DEVICE="cpu", DTYPE="float32",
               TARGET="tiny-llama", DATA=str(tmp_path / "corpus"), INIT="", ANCHORS="8", ACCUM="1")
    return env


def test_the_lease_training_calls_launch_outlast_a_call_and_send_the_drafters_back(tmp_path):
    """scripts/lease/train.sh, the lease's training call (launch.sh for each run), with a window longer than the
    call (CALL), then scripts/lease/collect.sh in the next call, at tiny scale on the CPU with two runs side by side
    (RUNS, the second with its own flags and two processes: an A/B at equal time): each sizes itself to the window
    (`--minutes`), the first call sends each run's newest checkpoint back (insurance), and the second waits for the
    runs to end inside the window and sends each back as one tar in parts that join into the files it saved.
    TESTS=1 runs the (here CPU) device tests beside them, their log sent back at the end."""
    import tarfile

    env = tiny_lease(tmp_path)
    root, first, out = tmp_path / "root", tmp_path / "first", tmp_path / "out"
    env.update(WINDOW="50", CALL="36", SAVE_MINUTES="0.05", ROOT=str(root), OUT=str(first), RUNS="ce kl",
               FLAGS_kl="--loss kl --grad-accum 2",
               NPROC_kl="2",  # kl: one drafter trained by two processes (torchrun, gloo)
               TESTS="1", TEST_FILES="tests/test_devices.py")  # beside the runs: on a GPU the CUDA tests
    started = time.time()
    done = subprocess.run(["bash", str(SCRIPT.parent / "lease" / "train.sh")], env=env, capture_output=True,
                          text=True, timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    for run, flags in (("ce", ""), ("kl", ", flags: --loss kl --grad-accum 2")):  # each sized to the 50 s left
        launched = re.search(rf"launching a run of ([\d.]+) minutes \(seed 7{flags}\) into .*/{run}\n", done.stdout)
        assert launched and 0.55 < float(launched.group(1)) <= 47 / 60 + 0.001, done.stdout[:500]  # 50 s less a few
    assert 14 < time.time() - started < 36 + 10 and "the very next call: OUT=$OUT bash" in done.stdout
    for run in ("ce", "kl"):  # the insurance: a checkpoint (float32) of each run, in case the next call is late
        assert f"{run}: no final drafter yet" in done.stdout and f"{run}: sending {root / run}/checkpoints/step-" in \
            done.stdout, done.stdout[-1500:]
        assert sorted(first.glob(f"{run}.tar.part*")), run
    assert not (first / "cuda-tests.txt").exists()  # the tests go on beside the runs
    done = subprocess.run(["bash", str(SCRIPT.parent / "lease" / "collect.sh")], env={**env, "OUT": str(out)},
                          capture_output=True, text=True, timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no final drafter yet" not in done.stdout and time.time() - started < 50 + 25
    assert len(list(out.iterdir())) <= 8  # what $OUT can bring back
    tests = (out / "cuda-tests.txt").read_text()
    assert "test_devices.py::test_the_target_is_on_the_case_device[cpu-llama] PASSED" in tests
    assert re.search(r"CUDA tests rc=0: [1-9]\d* passed, 0 failed or errors", done.stdout), done.stdout[-1500:]
    for run, loss in (("ce", "ce"), ("kl", "kl")):
        parts = sorted(out.glob(f"{run}.tar.part*"))
        assert parts, run
        (tmp_path / "joined.tar").write_bytes(b"".join(p.read_bytes() for p in parts))
        folder = tmp_path / f"back-{run}"
        with tarfile.open(tmp_path / "joined.tar") as tar:
            tar.extractall(folder, filter="data")
        saved = (root / run / "final" / "model.safetensors").read_bytes()
        assert (folder / "model.safetensors").read_bytes() == saved
        for name in ("config.json", "draft_vocab.json", "train_config.json", "log.jsonl", "profile.txt",
                     "stderr.log"):
            assert (folder / name).is_file(), (run, name)
        log = (folder / "stderr.log").read_text()
        assert ("(10 epochs, 2 processes)" in log) == (run == "kl")
        sized = re.search(r"steps/s: the schedule ends at step (\d+)", log)
        steps = int(sized.group(1))
        config = json.loads((folder / "train_config.json").read_text())
        assert config["max_steps"] == config["schedule_steps"] == steps > 48 and config["init"] == "random"
        assert config["seed"] == 7 and config["loss"] == loss  # from scratch (INIT=""): no warm start's seed
        last = json.loads((folder / "log.jsonl").read_text().splitlines()[-1])["step"]  # the last evaluation's
        # on schedule, or stopped early because this shared CPU slowed down after the pace was timed (keep_time)
        assert last == steps or 48 < last < steps and "out of time" in (folder / "stderr.log").read_text()


def test_a_world_that_ends_before_its_first_step_trains_again_as_one_process(tmp_path):
    """A run on several processes (NPROC_<name>) whose world ends before its first step (here: a global batch of
    one for two processes, which the trainer refuses) is launched again as one process in the same window, and comes
    back; the world's log is kept beside it."""
    env = tiny_lease(tmp_path)
    root, out = tmp_path / "root", tmp_path / "out"
    env.update(WINDOW="35", ROOT=str(root), OUT=str(out), RUNS="solo", NPROC_solo="2")
    done = subprocess.run(["bash", str(SCRIPT.parent / "lease" / "train.sh")], env=env, capture_output=True,
                          text=True, timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "solo: its world ended before its first step; launching it again as one process" in done.stdout
    assert "grad-accum" in (root / "solo.world.log").read_text()
    assert "no final drafter yet" not in done.stdout and sorted(out.glob("solo.tar.part*"))
    assert "2 processes" not in (root / "solo.log").read_text()


def test_the_lease_training_call_stops_waiting_when_its_run_dies(tmp_path):
    """A run that dies (here: no corpus where it looks) ends the call at once, saying so, not at the end of its
    window: on a lent GPU the rest of the window is the lease's time. Its seed is its warm start's plus one, so
    each stage reads the corpus in an order of its own."""
    import time

    warm_start = tmp_path / "stage"
    warm_start.mkdir()
    (warm_start / "train_config.json").write_text(json.dumps({"method": "dflash", "seed": 11}))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", DEVICE="cpu",
               DTYPE="float32", TARGET="tiny-llama", DATA=str(tmp_path / "no-corpus"), INIT=str(warm_start),
               WINDOW="300", ROOT=str(tmp_path / "root"), OUT=str(tmp_path / "out"))
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT.parent / "lease" / "train.sh")], env=env, capture_output=True,
                          text=True, timeout=300, cwd=SCRIPT.parent.parent)
    assert done.returncode == 1 and time.monotonic() - started < 120
    assert "the run ended without its final drafter" in done.stdout and "no drafter to send" in done.stdout
    assert "(seed 12)" in done.stdout


def test_extrapolating_a_drafter_along_its_last_stage(tmp_path):
    """scripts/extrapolate_drafter.py: NEW + alpha * (NEW - OLD) tensor by tensor in NEW's dtype, NEW's config and
    vocabulary beside it; drafters of two lineages (another vocabulary) are refused."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    new, old, out = tmp_path / "new", tmp_path / "old", tmp_path / "out"
    torch.manual_seed(0)
    tensors = {"fc.weight": torch.randn(4, 6), "norm.weight": torch.randn(6)}
    for folder, shift in ((old, 0.0), (new, 0.5)):
        folder.mkdir()
        save_file({k: (v + shift * (i + 1)).to(torch.bfloat16) for i, (k, v) in enumerate(tensors.items())},
                  folder / "model.safetensors", metadata={"format": "pt"})
        (folder / "config.json").write_text('{"block_size": 16}')
        (folder / "draft_vocab.json").write_text("[1, 2, 3]")
        (folder / "train_config.json").write_text(json.dumps({"seed": 8 if folder == new else 7}))
    script = SCRIPT.parent / "extrapolate_drafter.py"
    done = subprocess.run([sys.executable, str(script), str(new), str(old), "0.6", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made, a, b = (load_file(f / "model.safetensors") for f in (out, new, old))
    for name in tensors:
        expected = (a[name].float() + 0.6 * (a[name].float() - b[name].float())).to(torch.bfloat16)
        assert made[name].dtype == torch.bfloat16 and torch.equal(made[name], expected)
    assert not torch.equal(made["fc.weight"], a["fc.weight"])
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # kept: transformers' loader checks it
    assert json.loads((out / "train_config.json").read_text())["seed"] == 8
    assert (out / "draft_vocab.json").read_text() == "[1, 2, 3]"
    # with the stage before: NEW + alpha * (NEW - OLD) + beta * (OLD - OLDER)
    older, plane = tmp_path / "older", tmp_path / "plane"
    shutil.copytree(old, older)
    save_file({k: (v - 0.25).to(torch.bfloat16) for k, v in tensors.items()}, older / "model.safetensors",
              metadata={"format": "pt"})
    done = subprocess.run([sys.executable, str(script), str(new), str(old), "0.6", str(plane), str(older), "-0.15"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    made, c = load_file(plane / "model.safetensors"), load_file(older / "model.safetensors")
    for name in tensors:
        expected = (a[name].float() + 0.6 * (a[name].float() - b[name].float())
                    - 0.15 * (b[name].float() - c[name].float())).to(torch.bfloat16)
        assert torch.equal(made[name], expected)
    (older / "draft_vocab.json").write_text("[1, 2, 5]")
    refused = subprocess.run([sys.executable, str(script), str(new), str(old), "0.6", str(tmp_path / "no"), str(older),
                              "0.3"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not one lineage" in refused.stderr and not (tmp_path / "no").exists()
    (old / "draft_vocab.json").write_text("[1, 2, 4]")
    refused = subprocess.run([sys.executable, str(script), str(new), str(old), "0.6", str(tmp_path / "no")],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "not one lineage" in refused.stderr and not (tmp_path / "no").exists()


def test_after_a_lease_one_call_scores_every_candidate_and_resumes(tmp_path, capsys):
    """scripts/after_lease.py: each run's tar parts joined and unpacked, the shipped drafter, each run, the runs'
    mean and the best run's extrapolations scored (here by a stand-in for the held-out protocol), and nothing scored
    twice."""
    import importlib.util
    import threading

    import torch
    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("after_lease", SCRIPT.parent / "after_lease.py")
    after = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(after)

    def drafter(folder, value):
        folder.mkdir(parents=True)
        save_file({"fc.weight": torch.full((2, 3), value, dtype=torch.bfloat16)}, folder / "model.safetensors",
                  metadata={"format": "pt"})
        (folder / "config.json").write_text("{}")
        return folder

    shipped, files = drafter(tmp_path / "shipped", 1.0), tmp_path / "files"
    files.mkdir()
    for run, value in (("ce", 1.5), ("kl", 2.0)):  # the stand-in scores a drafter by its weight: kl leads
        pack = drafter(tmp_path / f"pack-{run}", value)
        (pack / "log.jsonl").write_text(json.dumps({"step": 40, "eval_tau": 2.5, "eval_decode_tau": 1.9}) + "\n")
        tar = subprocess.run(["tar", "-C", str(pack), "-cf", "-", "."], capture_output=True, check=True).stdout
        half = len(tar) // 2  # two parts, as fetch.sh splits them
        (files / f"{run}.tar.part00").write_bytes(tar[:half])
        (files / f"{run}.tar.part01").write_bytes(tar[half:])
    scored, together = [], threading.Barrier(2, timeout=30)

    def stand_in(folder):
        if len(scored) < 2:  # --jobs 2: the first two score at once (one at a time, the first would wait in vain)
            scored.append(folder.name)
            together.wait()
        else:
            scored.append(folder.name)
        w = load_file(folder / "model.safetensors")["fc.weight"].float().mean().item()
        return f"dflash {folder}: 93 held-out sequences, eval_tau {w:.3f}, eval_decode_tau {w / 2:.3f}, eval_loss 3.0"

    work = tmp_path / "work"
    assert after.main(["--jobs", "2", str(files), str(work)], evaluate=stand_in, shipped=shipped) == 0
    assert sorted(scored[:3]) == ["base", "ce", "kl"]  # the runs first, then what their scores choose
    assert sorted(scored[3:]) == ["kl-x0.3", "kl-x0.6", "kl-x1.0", "mean"]
    rows = json.loads((work / "summary.json").read_text())
    expected = [1.0, 1.5, 2.0, 1.75, 2.3, 2.6, 3.0]  # the runs' mean; kl + alpha x (kl - base), to bf16's precision
    assert [row["tau"] for row in rows] == pytest.approx(expected, abs=0.01)
    assert rows[2]["gpu_eval"] == {"step": 40, "eval_tau": 2.5, "eval_decode_tau": 1.9}
    assert "| kl + 0.6 x (kl - base) | 2.594 | 1.297 | 3.000 |  |" in (work / "summary.md").read_text()
    assert "| mean of ce, kl | 1.750 | 0.875 | 3.000 |  |" in (work / "summary.md").read_text()
    assert load_file(work / "mean" / "model.safetensors")["fc.weight"].dtype == torch.bfloat16
    scored.clear()  # a second call (after a crash, or in the next session) scores nothing again
    assert after.main([str(files), str(work)], evaluate=stand_in, shipped=shipped) == 0 and scored == []
    assert after.main([str(tmp_path / "shipped"), str(work)], evaluate=stand_in, shipped=shipped) == 2
    assert after.main(["--jobs", "x", str(files), str(work)], evaluate=stand_in, shipped=shipped) == 2
    # the shipped drafter's own heldout.txt spares its scoring, as long as it is about these weights
    (shipped / "heldout.txt").write_text((work / "base" / "heldout.txt").read_text())
    scored.clear()
    assert after.main(["--jobs", "2", str(files), str(tmp_path / "work2")], evaluate=stand_in, shipped=shipped) == 0
    assert sorted(scored) == ["ce", "kl", "kl-x0.3", "kl-x0.6", "kl-x1.0", "mean"]
    retrained = drafter(tmp_path / "retrained", 1.25)  # shipped later, with the old drafter's heldout.txt copied
    (retrained / "heldout.txt").write_text((shipped / "heldout.txt").read_text())
    scored.clear()
    assert after.main(["--jobs", "2", str(files), str(tmp_path / "work3")], evaluate=stand_in, shipped=retrained) == 0
    assert "base" in scored
    # a WORK left by an earlier lease (its base another drafter) would extrapolate from the wrong start: refused
    assert after.main([str(files), str(work)], evaluate=stand_in, shipped=retrained) == 2
    other = drafter(tmp_path / "other", 1.0)  # runs of two shapes have no mean: one line, no stack trace
    (other / "config.json").write_text('{"num_hidden_layers": 3}')
    with pytest.raises(SystemExit, match="different configs"):
        after.averaged([work / "ce", other], tmp_path / "no-mean")
