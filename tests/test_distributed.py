"""Data-parallel training: `torchrun --nproc-per-node 2 -m dflash train` (gloo, CPU) follows the one-process curve
with the same global batch, and resumes exactly."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dflash import trainer
from dflash.train_config import TrainConfig
from test_trainer import checkpoint_weights, counting_records, train_args, train_argv, write_shards

# 7 training sequences, a global batch of 3: steps of 3, 3 and 1 sequences per epoch, so the two processes take
# unequal shares (2 + 1), and in the last step of an epoch the second has none (its pass counts for nothing)
EXTRA = ("--grad-accum", "3", "--save-every", "100", "--threads", "1")


def torchrun(*argv: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TOKENIZERS_PARALLELISM="false")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "dflash", *argv]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def losses(out) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records if "loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    data = write_shards(root / "data", counting_records(9, seed=1))  # 2 of them held out
    assert trainer.run(train_args(data, root / "one", *EXTRA)) == 0
    torchrun(*train_argv(data, root / "two", *EXTRA))
    torchrun(*train_argv(data, root / "two-split", *EXTRA, "--max-steps", "4"))
    torchrun(*train_argv(data, root / "two-split", *EXTRA, "--resume"))
    return root


def test_two_processes_follow_the_one_process_curve(runs):
    one, two = losses(runs / "one"), losses(runs / "two")
    assert [s for s, _ in one] == [s for s, _ in two] == list(range(1, 7))
    assert [loss for _, loss in two] == pytest.approx([loss for _, loss in one], rel=1e-4)
    a, b = checkpoint_weights(runs / "one", 6), checkpoint_weights(runs / "two", 6)
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=2e-5, rtol=1e-4)
    assert (runs / "two" / "final" / "model.safetensors").is_file()


def test_two_processes_resume_exactly(runs):
    straight, split = checkpoint_weights(runs / "two", 6), checkpoint_weights(runs / "two-split", 6)
    for name in straight:
        torch.testing.assert_close(split[name], straight[name], atol=1e-6, rtol=1e-5)
    assert [s for s, _ in losses(runs / "two-split")] == list(range(1, 7))  # the log has no repeated steps


class OneWeight:
    """Just enough of an objective for the Trainer's checks."""

    model = torch.nn.Linear(1, 1)


def test_a_global_batch_smaller_than_the_world_is_refused(tmp_path):
    from dflash.distributed import World
    from dflash.errors import UserError

    config = TrainConfig(grad_accum=1)
    with pytest.raises(UserError, match="grad-accum"):
        trainer.Trainer(OneWeight(), config, tmp_path, train=["a sequence"], heldout=[], world=World(rank=0, size=2))


# ---- dflash data across processes ------------------------------------------------------------------------------------
def test_two_processes_split_the_prompts_and_resume_a_one_process_folder(tmp_path):
    import shutil

    from test_data import read_out, random_prompts, run_data, write_jsonl

    inputs = str(write_jsonl(tmp_path / "p.jsonl", random_prompts(14, seed=7)))
    assert run_data(tmp_path / "one", inputs) == 0
    one, *_ = read_out(tmp_path / "one")
    argv = ["data", "--target", "tiny-qwen3", "--device", "cpu", "--max-new-tokens", "6", "--batch-size", "4",
            "--shard-size", "5", "--input", inputs, "--threads", "1"]

    torchrun(*argv, "--out", str(tmp_path / "two"))
    two, errors, skipped, manifest = read_out(tmp_path / "two")
    assert {p.name for p in (tmp_path / "two").glob("shard-*")} >= {"shard-r0-00000.jsonl", "shard-r1-00000.jsonl"}
    assert manifest["complete"] and manifest["counts"]["ok"] == 14 and not errors and not skipped
    assert {r["id"]: r["input_ids"] for r in two} == {r["id"]: r["input_ids"] for r in one}

    # a folder one process began (its first shard of 5 rows): two processes regenerate only the other 9
    part = tmp_path / "part"
    part.mkdir()
    shutil.copy(tmp_path / "one" / "shard-00000.jsonl", part)
    shutil.copy(tmp_path / "one" / "manifest.json", part)
    torchrun(*argv, "--out", str(part))
    resumed, _, _, manifest = read_out(part)
    assert manifest["complete"] and manifest["counts"]["ok"] == 14
    assert sorted(r["id"] for r in resumed) == sorted(r["id"] for r in one)  # no duplicates, no losses
    assert {r["id"]: r["input_ids"] for r in resumed} == {r["id"]: r["input_ids"] for r in one}
    assert len([json.loads(line) for line in (part / "shard-00000.jsonl").open()]) == 5  # untouched


def test_more_processes_than_gpus_share_them_round_robin_over_gloo():
    from dflash.distributed import placement
    from dflash.errors import UserError

    assert [placement(r, 2, 2) for r in range(2)] == [(0, "nccl"), (1, "nccl")]  # one process per GPU
    assert [placement(r, 3, 1) for r in range(3)] == [(0, "gloo")] * 3  # three on one GPU: NCCL would refuse
    assert [placement(r, 4, 2)[0] for r in range(4)] == [0, 1, 0, 1]
    with pytest.raises(UserError):
        placement(0, 2, 0)


def test_two_processes_keep_one_time_limit(tmp_path):
    """`--minutes` under torchrun: process 0's clock sizes the schedule and decides when time is up, for both (a
    disagreement would leave one process waiting in a collective until the timeout). Its clock also says when a
    checkpoint is due (--save-minutes), at log steps only: agreeing reads a device tensor."""
    data = write_shards(tmp_path / "data", counting_records(10, seed=1))
    torchrun(*train_argv(data, tmp_path / "two", *EXTRA, "--epochs", "40", "--log-every", "4", "--minutes", "0.5",
                         "--save-minutes", "0.0001"))
    config = json.loads((tmp_path / "two" / trainer.CONFIG_FILE).read_text())
    assert config["schedule_steps"] == config["max_steps"] > 48
    last = losses(tmp_path / "two")[-1][0]
    assert 48 < last <= config["schedule_steps"] and (tmp_path / "two" / "final" / "model.safetensors").is_file()
    saved = [int(folder.name.split("-")[1]) for folder in trainer.checkpoint_dirs(tmp_path / "two")]
    assert saved and all(step % 4 == 0 or step == last for step in saved) and saved[-1] == last
