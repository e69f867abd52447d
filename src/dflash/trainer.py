"""`dflash train`: train a drafter on target-regenerated data, with exact resume.

The loop is method-agnostic: it trains `objective.model` with `objective.loss(example, rng) -> (loss, metrics)` (or,
where the objective has it, `objective.losses(examples, rngs)`: several sequences in one pass), and
each trainable method's recipe (`Method.training` in methods/, e.g. methods/dflash/objective.py) builds, loads and
checks its model. So DFlash and the EAGLE-3 head share data loading, the schedule, logging, checkpoints and exact
resume. An EAGLE-3 run's --block-size B trains B - 1 chain steps (training-time test) and sets the head's draft depth,
as `--block-size` does for `dflash generate --method eagle3`; its draft vocabulary is the --draft-vocab most frequent
response tokens of the training sequences.

Determinism, which exact resume rests on: the example order of epoch e is a permutation seeded by (seed, e) and the
anchors of example i in epoch e come from a generator seeded by (seed, e, i). A checkpoint therefore only needs the
weights, the optimizer and scheduler state and the position (step, epoch, index into the epoch's order).

Output folder:
  OUT/log.jsonl                      one JSON record per log interval and per evaluation
  OUT/checkpoints/step-XXXXXX/       drafter (float32, public format) + trainer_state.pt + train_config.json
  OUT/final/                         the drafter in bfloat16, ready for `dflash generate --drafter OUT/final`
                                     (eagle3: `dflash generate --method eagle3 --drafter OUT/final`,
                                     `dflash bench --methods eagle3 --drafter eagle3=OUT/final`)
  OUT/curves.png                     with --plot
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
import time
import zlib
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Protocol, get_type_hints

import numpy as np
import torch
from torch import nn

from .distributed import SINGLE, World, init_world
from .errors import UserError
from .options import add_target_arguments
from .train_config import RESUMABLE, TrainConfig, not_trainable, read_config_values

ORDER_STREAM, ANCHOR_STREAM, EVAL_STREAM = 1, 2, 3  # separate seeded random streams
CHECKPOINT_RE = re.compile(r"^step-(\d{6,})$")
STATE_FILE, CONFIG_FILE = "trainer_state.pt", "train_config.json"
STATE_VERSION = 1
# a run with a time limit (--minutes) times its pace between these steps of its invocation (the first steps pay for
# warm-up: on a GPU they ran ~2x slower than the rest), then sizes itself to the time left
PACE_FROM, PACE_TO = 16, 48
TIME_MARGIN = 0.92  # of the time left, the share a sized run plans to fill (its pace wanders; a run that falls
# behind anyway stops early, `keep_time`)
FINAL_SECONDS = 15.0  # kept back for the last evaluation, checkpoint and export
PROFILED = (4, 7)  # --profile records steps 5-7 of an invocation: after the first steps' warm-up, before the pace
PROFILE_FILE = "profile.txt"


# How far apart two attention kernels' loss and gradient norm may be on the first step's sequences (relative) before
# the second is taken for wrong (`timed_attention`): bfloat16 rounds the scores of `blocks` but not flex's
ATTENTION_AGREEMENT = 0.02
# The most an automatic --seqs-per-pass packs on a GPU: numbers in one hidden state of all of a pass's blocks (the
# drafter keeps a few dozen such tensors per layer for its backward pass). 8 SmolLM2 sequences at 512 anchors: 38M.
PASS_ACTIVATIONS = 1 << 26


# ---- data ------------------------------------------------------------------------------------------------------------
@dataclass
class Example:
    id: str
    input_ids: torch.Tensor  # int32 [seq]: prompt + target-regenerated response
    loss_start: int  # index of the first response token


def load_examples(path: str | Path) -> list[Example]:
    """Training records from a packed corpus, a `dflash data` folder or one JSONL file (see corpus.py)."""
    from .corpus import read_records

    examples = [example_of(record) for record in read_records(path)]
    if not examples:
        raise UserError(f"no training records in {path}")
    return examples


def example_of(record: dict) -> Example:
    where = record.get("_where", "a record")
    if "input_ids" not in record and any(key in record for key in ("prompt", "turns", "conversations", "messages")):
        raise UserError(f"{where}: a prompt, not a training record (input_ids, loss_start): a drafter learns the "
                        "target's own responses, so regenerate them first: dflash data --input FILE --out DIR, "
                        "then dflash train --data DIR")
    try:
        ids, start = record["input_ids"], record["loss_start"]
        example = Example(str(record.get("id", where)), torch.tensor(ids, dtype=torch.int32), int(start))
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise UserError(f"{where}: not a training record ({exc.__class__.__name__}: {exc})") from exc
    if example.input_ids.dim() != 1 or not 0 <= example.loss_start <= len(example.input_ids):
        raise UserError(f"{where}: loss_start {example.loss_start} outside a sequence of {len(example.input_ids)}")
    return example


def split_heldout(examples: list[Example], fraction: float) -> tuple[list[Example], list[Example]]:
    """Hold out the examples whose id hashes lowest: the split does not depend on file order or the seed."""
    count = min(len(examples) - 1, max(1, round(fraction * len(examples)))) if fraction > 0 else 0
    ranked = sorted(range(len(examples)), key=lambda i: (zlib.crc32(examples[i].id.encode()), i))
    heldout = set(ranked[:count])
    train = [e for i, e in enumerate(examples) if i not in heldout]
    return train, [examples[i] for i in sorted(heldout)]


def data_fingerprint(examples: list[Example]) -> str:
    digest = hashlib.sha256()
    for e in examples:
        digest.update(f"{e.id}:{len(e.input_ids)}:{e.loss_start}\n".encode())
    return digest.hexdigest()[:16]


# ---- the objective interface -----------------------------------------------------------------------------------------
class Objective(Protocol):
    name: str
    model: nn.Module  # the trainable module; checkpoints save it with `save`

    def usable(self, example: Example) -> bool: ...

    def loss(self, example: Example, rng: np.random.Generator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...

    def evaluate(self, examples: list[Example], rngs: list[np.random.Generator]) -> dict: ...
    # (an objective with a batched `losses` also takes per_pass=N: N sequences a pass, as its training steps run)

    def save(self, folder: Path, dtype: torch.dtype | None) -> None: ...


# ---- checkpoints -----------------------------------------------------------------------------------------------------
@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    position: int = 0  # examples of this epoch's order already consumed


def checkpoint_dirs(out: Path) -> list[Path]:
    """Complete checkpoints, oldest first (an interrupted save leaves only a hidden temp folder)."""
    root = out / "checkpoints"
    found = [p for p in root.iterdir() if p.is_dir() and CHECKPOINT_RE.match(p.name)] if root.is_dir() else []
    return sorted(found, key=lambda p: int(CHECKPOINT_RE.match(p.name).group(1)))


def resolve_checkpoint(resume: str, out: Path) -> Path:
    """`--resume` alone means OUT's newest checkpoint; a path may be a checkpoint or another run's OUT."""
    path = out if resume == "latest" else Path(resume)
    if (path / STATE_FILE).is_file():
        return path
    found = checkpoint_dirs(path)
    if not found:
        raise UserError(f"no checkpoint to resume from in {path} (looked for {path}/checkpoints/step-*/{STATE_FILE})")
    return found[-1]


def write_atomically(final: Path, write) -> None:
    """Fill a hidden temp folder with `write(folder)`, then rename it into place: a crash leaves no half folder."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write(tmp)
    if final.exists():  # re-saving a step after a resume
        shutil.rmtree(final)
    os.replace(tmp, final)


def rng_states() -> dict:
    states = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def restore_rng_states(states: dict) -> None:
    random.setstate(_as_tuple(states["python"]))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _as_tuple(value):
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


def read_checkpoint_config(folder: Path) -> TrainConfig:
    if not (folder / CONFIG_FILE).is_file() or not (folder / STATE_FILE).is_file():
        raise UserError(f"{folder} is not a training checkpoint (needs {CONFIG_FILE} and {STATE_FILE})")
    values = read_config_values(folder / CONFIG_FILE)
    values.setdefault("loss_vocab", "full")  # checkpoints from before the option trained on the whole vocabulary
    return TrainConfig.from_dict(values, str(folder / CONFIG_FILE))


def read_trainer_state(folder: Path) -> dict:
    try:
        state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    except Exception as exc:  # truncated zip, bad pickle, ...: all mean the same thing to the user
        raise UserError(f"{folder / STATE_FILE} is unreadable or corrupt ({exc.__class__.__name__})") from exc
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
        raise UserError(f"{folder / STATE_FILE} is not a dflash trainer state (version {STATE_VERSION})")
    return state


# ---- the loop --------------------------------------------------------------------------------------------------------
def gradient_norm(params) -> float:
    """The L2 norm of all the parameters' gradients together (read from the device)."""
    return torch.nn.utils.get_total_norm([p.grad.detach() for p in params if p.grad is not None]).item()


def cosine_with_warmup(step: int, total_steps: int, warmup_steps: int) -> float:
    """LR multiplier: linear warmup to 1 over `warmup_steps`, then cosine decay to 0 at `total_steps`."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class Trainer:
    def __init__(self, objective: Objective, config: TrainConfig, out: str | Path, train: list[Example],
                 heldout: list[Example], progress: bool = True, world: World = SINGLE,
                 finish_by: float | None = None, fit_schedule: bool = False, profile: bool = False):
        """`finish_by`: a time.monotonic() by which the run must have ended (`keep_time`); `fit_schedule`: also fit
        the warmup and cosine schedule to the steps that fit before it; `profile`: write OUT/profile.txt
        (`Profile`)."""
        if not train:
            raise UserError("no training sequences left (all too short or held out)")
        if config.grad_accum < world.size:
            raise UserError(f"--grad-accum {config.grad_accum} is smaller than the {world.size} processes: every "
                            "process needs at least one sequence per step (--grad-accum is the global batch)")
        self.objective, self.config, self.out = objective, config, Path(out)
        self.train, self.heldout, self.progress, self.world = train, heldout, progress and world.main, world
        self.model = objective.model
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.steps_per_epoch = math.ceil(len(train) / config.grad_accum)
        self.set_schedule(config.schedule_steps or config.epochs * self.steps_per_epoch)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: cosine_with_warmup(step, self.total_steps, self.warmup_steps)
        )
        self.finish_by, self.fit_schedule, self.clock = finish_by, fit_schedule, time.monotonic
        # keep_time's clocks: time aside from training (evaluations, a profile's tables) never counts in its pace
        self.aside_seconds = 0.0  # this invocation's evaluations and profile
        self.evaluation_cost = 0.0  # the last evaluation's seconds
        self.pace_mark: tuple[float, float] | None = None  # (clock, aside_seconds) at step PACE_FROM
        self.last_look: tuple[int, float, float] | None = None  # (steps done, clock, aside_seconds) at the last look
        self.evaluated_at: int | None = None  # the step of the last evaluation
        self.profile = Profile(self.out / PROFILE_FILE, self.say) if profile and world.main else None
        self.state = TrainState()
        self.fingerprint = data_fingerprint(train)
        self.log_path = self.out / "log.jsonl"
        self.per_pass = self.sequences_per_pass()
        self.attention_untimed = len(getattr(objective, "attention_choices", list)()) > 1  # `timed_attention`

    def set_schedule(self, total_steps: int) -> None:
        self.total_steps = total_steps
        ratio = self.config.warmup_ratio
        self.warmup_steps = max(1, round(ratio * total_steps)) if ratio > 0 else 0

    # ---- precision ---------------------------------------------------------------------------------------------------
    def autocast(self):
        device = next(self.model.parameters()).device
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if self.objective.target.dtype == torch.bfloat16:
            # a bf16 target on the CPU means the user chose bf16 (fast where the CPU has AVX512-BF16/AMX);
            # weights and optimizer state stay float32
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return nullcontext()

    # ---- data order --------------------------------------------------------------------------------------------------
    def epoch_order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.config.seed, ORDER_STREAM, epoch]).permutation(len(self.train))

    def sequences_per_pass(self) -> int | None:
        """How many of a step's sequences share a target and a drafter pass: --seqs-per-pass; one for an objective
        without a batched `losses`, and on a CPU (one sequence's products already fill the cores, and padding
        sequences to the longest costs arithmetic: 8 real sequences took 2.2x as long in one pass as in 8 on 2 cores,
        docs/TRAINING.md); on a GPU None: `timed_per_pass` measures it at the first step."""
        if not hasattr(self.objective, "losses"):
            return 1
        if self.config.seqs_per_pass:
            return self.config.seqs_per_pass
        return None if self.params[0].device.type == "cuda" else 1

    def pass_choices(self) -> list[int]:
        """What `timed_per_pass` compares: one, and a step's share of sequences capped by PASS_ACTIVATIONS."""
        share = math.ceil(self.config.grad_accum / self.world.size)
        most = max(1, min(share, PASS_ACTIVATIONS // self.objective.activations_per_sequence))
        return sorted({1, most})

    def timed_per_pass(self, indices: list[int]) -> int:
        """The fastest of `pass_choices` on this GPU: each runs forward and backward over this step's sequences
        twice (the first warms the kernels up), timed the second time; the gradients are thrown away, so the run
        computes what it would have."""
        choices = self.pass_choices()
        if len(choices) == 1:
            return choices[0]
        seconds = {}
        for per_pass in choices:
            try:
                self.timed_accumulate(indices, per_pass)  # warms the kernels up
                seconds[per_pass] = self.timed_accumulate(indices, per_pass)[0]
            except torch.OutOfMemoryError:  # a GPU shared with other runs: the wider pass may not fit
                if per_pass == choices[0]:
                    raise  # one sequence a pass is the floor: nothing narrower would fit either
                seconds[per_pass] = math.inf
                self.say(f"[dflash] {per_pass} sequences a pass ran out of GPU memory here, left out")
                self.optimizer.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
        self.optimizer.zero_grad(set_to_none=True)
        best = self.agreed_choice(min(seconds, key=seconds.get), math.inf in seconds.values(), choices[0])
        timing = ", ".join(f"{k}: left out" if v == math.inf else f"{k}: {v:.2f} s" for k, v in seconds.items())
        self.say(f"[dflash] sequences per pass: {best} ({timing} for one step's sequences)")
        return best

    def timed_accumulate(self, indices: list[int], per_pass: int) -> tuple[float, dict[str, torch.Tensor]]:
        """(seconds, metrics) of one `accumulate` on a GPU, from an idle queue to an idle queue."""
        torch.cuda.synchronize()
        started = time.perf_counter()
        totals = self.accumulate(indices, per_pass)
        torch.cuda.synchronize()
        return time.perf_counter() - started, totals

    def timed_attention(self, indices: list[int]) -> None:
        """Sets the objective's attention kernel to the fastest of its `attention_choices` on this GPU, timed like
        `timed_per_pass` (the second of two runs of this step's sequences; the first compiles). A kernel that fails
        here (a compile error, say), or whose loss or gradient differs from the first kernel's (blocks, the
        definition) by more than ATTENTION_AGREEMENT, is reported and left out: the run goes on with the others."""
        choices = self.objective.attention_choices()
        seconds, first, figures = {}, {}, {}  # the timed run's seconds, the first run's (a compile's), results
        for kernel in choices:
            self.objective.attention = kernel
            self.optimizer.zero_grad(set_to_none=True)
            try:
                first[kernel] = self.timed_accumulate(indices, self.per_pass)[0]
                seconds[kernel], totals = self.timed_accumulate(indices, self.per_pass)
                figures[kernel] = (totals["loss"].item(), gradient_norm(self.params))
            except Exception as exc:  # noqa: BLE001 - any failure of a candidate only rules it out
                seconds[kernel] = math.inf
                self.say(f"[dflash] attention {kernel} failed here, left out: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}")
                torch.cuda.empty_cache()
        self.optimizer.zero_grad(set_to_none=True)
        reference = figures.get(choices[0])
        for kernel, (loss, norm) in figures.items():
            if reference is not None and not all(math.isclose(a, b, rel_tol=ATTENTION_AGREEMENT)
                                                 for a, b in zip((loss, norm), reference)):
                seconds[kernel] = math.inf
                self.say(f"[dflash] attention {kernel} disagrees with {choices[0]}, left out: loss {loss:.5f} "
                         f"against {reference[0]:.5f}, gradient norm {norm:.5f} against {reference[1]:.5f}")
        best = min(choices, key=lambda kernel: seconds[kernel])
        best = choices[int(self.main_value(choices.index(best)))]  # one kernel for every process: process 0's
        self.objective.attention = best
        timing = ", ".join(f"{k}: left out" if v == math.inf else f"{k}: {v:.2f} s (first run {first[k]:.1f} s)"
                           for k, v in seconds.items())
        self.say(f"[dflash] training attention: {best} ({timing} for one step's sequences)")

    def next_batch(self, order: np.ndarray) -> list[int]:
        start = self.state.position
        return order[start : start + self.config.grad_accum].tolist()

    # ---- one step ----------------------------------------------------------------------------------------------------
    def train_step(self, indices: list[int]) -> dict[str, torch.Tensor]:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        if self.per_pass is None:
            self.per_pass = self.timed_per_pass(indices)
        if self.attention_untimed:
            self.attention_untimed = False
            self.timed_attention(indices)
        totals = self.accumulate(indices, self.per_pass)
        if self.world.size > 1:
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.world.sum_([p.grad for p in self.params] + [totals[name] for name in sorted(totals)])
        totals["grad_norm"] = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        totals["lr"] = torch.tensor(self.scheduler.get_last_lr()[0])
        self.optimizer.step()
        self.scheduler.step()
        return totals

    def accumulate(self, indices: list[int], per_pass: int) -> dict[str, torch.Tensor]:
        """Gradients of this process's share of the step's sequences, `per_pass` sequences a pass (of similar
        lengths, so that little is padding); returns the step's mean metrics."""
        totals: dict[str, torch.Tensor] = {}
        mine, weight = self.world.share(indices), 1.0
        if not mine:  # fewer sequences than processes (an epoch's last step): a pass that counts for nothing, so
            mine, weight = indices[:1], 0.0  # that every process brings the same metrics to the step's sum
        if per_pass > 1:
            mine = sorted(mine, key=lambda i: len(self.train[i].input_ids))
        for start in range(0, len(mine), per_pass):
            group = mine[start: start + per_pass]
            rngs = [np.random.default_rng([self.config.seed, ANCHOR_STREAM, self.state.epoch, i]) for i in group]
            examples = [self.train[i] for i in group]
            with self.autocast():
                results = (self.objective.losses(examples, rngs) if len(group) > 1
                           else [self.objective.loss(examples[0], rngs[0])])
            # each sequence counts equally, however many anchors it has
            (sum(loss for loss, _ in results) * (weight / len(indices))).backward()
            for _, metrics in results:
                for name, value in metrics.items():
                    totals[name] = totals.get(name, 0) + value.detach().float() * (weight / len(indices))
        return totals

    def advance(self, consumed: int) -> None:
        self.state.step += 1
        self.state.position += consumed
        if self.state.position >= len(self.train):
            self.state.epoch, self.state.position = self.state.epoch + 1, 0

    def stop_step(self) -> int:
        return min(self.total_steps, self.config.max_steps or self.total_steps)

    def fit(self) -> TrainState:
        """Train until the last epoch ends or `max_steps`; checkpoint, evaluate and export along the way."""
        from tqdm.auto import tqdm

        self.out.mkdir(parents=True, exist_ok=True)
        self.world.broadcast_(self.params)
        stop = self.stop_step()
        bar = tqdm(total=self.total_steps, initial=self.state.step, unit="step", disable=not self.progress,
                   dynamic_ncols=True)
        window: list[dict[str, torch.Tensor]] = []
        window_seconds = 0.0  # training time only: evaluations and checkpoints would distort steps/s
        order, order_epoch = None, None
        last_save = self.clock()
        first = self.state.step
        while self.state.step < stop:
            if order_epoch != self.state.epoch:
                order, order_epoch = self.epoch_order(self.state.epoch), self.state.epoch
            indices = self.next_batch(order)
            if self.profile is not None and self.state.step - first == PROFILED[0]:
                self.profile.start(self.params[0].device, self.state.step)
            started = time.perf_counter()
            window.append(self.train_step(indices))
            self.advance(len(indices))
            if self.profile is not None and self.state.step - first == PROFILED[1]:
                aside = self.clock()
                self.profile.finish(self.state.step)  # its tables take a while: not training's time
                self.aside_seconds += self.clock() - aside
            bar.update(1)
            step = self.state.step
            if self.finish_by is not None and step < stop:
                stop = self.keep_time(step - first, stop)
                bar.total = max(stop, step)
            if step % self.config.log_every == 0 or step == stop:
                record = self.log_window(window, window_seconds + time.perf_counter() - started)
                shown = {k: f"{record[k]:.3f}" for k in ("loss", "tau", "steps_per_s") if k in record}
                bar.set_postfix(shown)
                window, window_seconds = [], 0.0
            else:
                window_seconds += time.perf_counter() - started
            if self.heldout and self.world.main and (step % self.config.eval_every == 0 or step == stop) \
                    and self.evaluated_at != step:
                self.evaluate()
            overdue = self.config.save_minutes and self.clock() - last_save >= 60 * self.config.save_minutes
            if self.world.size > 1 and self.config.save_minutes:
                # process 0's clock decides for everyone, at log steps only: agreeing reads a device tensor, and a
                # log step reads the metrics anyway (every step, it stalled each process until its GPU caught up)
                overdue = step % self.config.log_every == 0 and bool(self.main_value(float(bool(overdue))))
            if step % self.config.save_every == 0 or step == stop or overdue:
                if self.world.main:
                    self.save_checkpoint()
                last_save = self.clock()
        bar.close()
        if self.profile is not None:  # a run that ended inside the profiled steps
            self.profile.finish(self.state.step)
        if self.world.main:
            self.export_final()
        self.world.barrier()  # nobody leaves before the final drafter is written
        return self.state

    def keep_time(self, done: int, stop: int) -> int:
        """The step at which a run that must end by `finish_by` stops, after `done` steps of this invocation. Between
        steps PACE_FROM and PACE_TO it times its pace, and at PACE_TO an evaluation, then plans the steps that fit
        the time left (evaluations and the final save included; with `fit_schedule` its warmup and cosine end there
        too, so the learning rate anneals to zero as time runs out). Every log_every steps it stops early if the
        time left would not hold the steps until its next look, at the pace since its last one."""
        now = self.clock()
        if done == PACE_FROM:
            self.pace_mark = (now, self.aside_seconds)
        if self.last_look is None:  # from the end of the first step (a GPU's first step warms kernels up)
            self.last_look = (done, now, self.aside_seconds)
        if done == PACE_TO and self.pace_mark is not None:
            # training's pace: evaluations between the marks (eval_every < 32) have their own share below
            seconds = (now - self.pace_mark[0] - (self.aside_seconds - self.pace_mark[1])) / (PACE_TO - PACE_FROM)
            if self.heldout and self.world.main:  # timed on one (which also puts an early point on the curve)
                self.evaluate()
                now = self.clock()
            fits = int(self.main_value(self.steps_in_time(seconds, self.evaluation_cost, now)))
            if self.fit_schedule:
                self.set_schedule(fits)
                self.config = self.config.replace({"schedule_steps": fits, "max_steps": fits})
                if self.world.main:
                    (self.out / CONFIG_FILE).write_text(self.config.to_json())
            stop = fits if self.fit_schedule else min(stop, fits)
            self.say(f"[dflash] {1 / seconds:.2f} steps/s: {'the schedule ends' if self.fit_schedule else 'stopping'}"
                     f" at step {stop}, {(self.finish_by - now) / 60:.1f} min from now")
            return stop
        if done % self.config.log_every == 0 and done > self.last_look[0]:
            # the pace since the last look, checkpoints included (errs long), evaluations counted apart: the next
            # look comes after steps_ahead more steps, and after an evaluation if one falls before the last step
            looked, then, aside = self.last_look
            seconds = (now - then - (self.aside_seconds - aside)) / (done - looked)
            self.last_look = (done, now, self.aside_seconds)
            step, steps_ahead = self.state.step, min(self.config.log_every, stop - self.state.step)
            next_evaluation = (step // self.config.eval_every + 1) * self.config.eval_every  # the one at stop: FINAL
            evaluating = bool(self.heldout) and next_evaluation <= step + steps_ahead and next_evaluation < stop
            ahead = steps_ahead * seconds + (self.evaluation_cost if evaluating else 0.0)
            late = now + ahead + FINAL_SECONDS > self.finish_by
            if self.main_value(float(late)):
                self.say(f"[dflash] out of time: stopping at step {self.state.step}")
                return self.state.step
        return stop

    def steps_in_time(self, seconds_per_step: float, evaluation: float, now: float) -> int:
        """The last step that fits before `finish_by` at this pace, with an evaluation of `evaluation` seconds every
        eval_every steps and the final save."""
        per_step = seconds_per_step + evaluation / self.config.eval_every
        left = self.finish_by - now - FINAL_SECONDS
        return self.state.step + max(1, int(TIME_MARGIN * left / per_step))

    def say(self, text: str) -> None:
        if self.world.main:
            print(text, file=sys.stderr)

    def agreed_choice(self, choice: int, left_out: bool, floor: int) -> int:
        """One choice of sequences per pass for every process (each timed its own share): process 0's, or `floor`
        where any process had to leave a choice out (on a GPU the world's processes share, one may find memory
        short that another has just taken)."""
        if self.world.size == 1:
            return choice
        votes = torch.tensor([float(choice) if self.world.main else 0.0, float(left_out)],
                             device=self.params[0].device)
        self.world.sum_([votes])
        return floor if votes[1].item() > 0 else int(votes[0].item())

    def main_value(self, value: float) -> float:
        """Process 0's `value` in every process (one clock decides for all)."""
        if self.world.size == 1:
            return value
        flag = torch.tensor([float(value) if self.world.main else 0.0], device=self.params[0].device)
        self.world.sum_([flag])
        return flag.item()

    # ---- logging and evaluation --------------------------------------------------------------------------------------
    def log_window(self, window: list[dict[str, torch.Tensor]], seconds: float) -> dict:
        record = {"step": self.state.step, "epoch": self.state.epoch}
        for name in window[0]:
            mean = torch.stack([m[name].float().cpu() for m in window]).mean(0)
            record[name] = mean.tolist()
        record["steps_per_s"] = len(window) / max(seconds, 1e-9)
        self.append_log(record)
        return record

    def evaluate(self) -> dict:
        self.evaluated_at, started = self.state.step, self.clock()
        self.model.eval()
        rngs = [np.random.default_rng([self.config.seed, EVAL_STREAM, i]) for i in range(len(self.heldout))]
        with self.autocast():
            # as many sequences a pass as training's (always one for an objective without `losses`)
            shared = {"per_pass": self.per_pass} if (self.per_pass or 1) > 1 else {}
            record = {"step": self.state.step, **self.objective.evaluate(self.heldout, rngs, **shared)}
        self.append_log(record)
        self.evaluation_cost = self.clock() - started
        self.aside_seconds += self.evaluation_cost
        return record

    def append_log(self, record: dict) -> None:
        if not self.world.main:
            return
        with open(self.log_path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def truncate_log(self, step: int) -> None:
        """Drop log records written after `step` by a run that stopped before its next checkpoint."""
        if not self.world.main or not self.log_path.is_file():
            return
        keep = [line for line in self.log_path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.log_path.write_text("".join(line + "\n" for line in keep))

    # ---- checkpoints -------------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        final = self.out / "checkpoints" / f"step-{self.state.step:06d}"
        state = {
            "version": STATE_VERSION,
            "objective": self.objective.name,
            **asdict(self.state),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_states(),
            "data_fingerprint": self.fingerprint,
            "num_train": len(self.train),
        }

        def write(folder: Path) -> None:
            self.objective.save(folder, torch.float32)  # float32: resuming must not round the weights
            torch.save(state, folder / STATE_FILE)
            (folder / CONFIG_FILE).write_text(self.config.to_json())

        write_atomically(final, write)
        if self.config.keep_checkpoints:
            for old in checkpoint_dirs(self.out)[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, folder: Path) -> None:
        """Restore optimizer, scheduler, RNGs and position (the weights were loaded with the model)."""
        state = read_trainer_state(folder)
        if state.get("objective") != self.objective.name:
            raise UserError(f"{folder} was trained with {state.get('objective')!r}, not {self.objective.name!r}")
        if state.get("data_fingerprint") != self.fingerprint:
            raise UserError(
                f"the training data differs from the data of {folder} ({state.get('num_train')} sequences then, "
                f"{len(self.train)} now): resuming would not continue the same run"
            )
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            restore_rng_states(state["rng"])
            self.state = TrainState(int(state["step"]), int(state["epoch"]), int(state["position"]))
        except (KeyError, ValueError, RuntimeError, TypeError) as exc:
            raise UserError(f"{folder / STATE_FILE} does not match this drafter ({exc})") from exc
        self.truncate_log(self.state.step)

    def export_final(self) -> Path:
        final = self.out / "final"
        write_atomically(final, lambda folder: self.objective.save(folder, torch.bfloat16))
        return final


class Profile:
    """`dflash train --profile`: torch.profiler over a few steps (PROFILED), written to a file as two tables of
    operations, by the device's time (a GPU's kernels) and by the host's (Python and launches). Profiling never stops
    a run: a profiler that fails says so and the run goes on."""

    def __init__(self, path: Path, say):
        self.path, self.say, self.profiler, self.device, self.started, self.first = path, say, None, None, 0.0, 0

    def start(self, device: torch.device, step: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        self.device, self.first = device, step
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        try:
            self.profiler = profile(activities=activities)
            self.profiler.__enter__()
        except Exception as exc:  # noqa: BLE001 - a profile is a by-product: the run matters more
            self.say(f"[dflash] --profile: the profiler did not start ({exc}); training goes on")
            self.profiler = None
        self.started = time.perf_counter()

    def finish(self, step: int) -> None:
        if self.profiler is None:
            return
        steps = max(1, step - self.first)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - self.started
        try:
            self.profiler.__exit__(None, None, None)
            averages = self.profiler.key_averages()
            parts = [f"steps {self.first + 1}-{step}: {seconds:.3f} s ({seconds / steps * 1000:.1f} ms a step, "
                     "profiled)\n"]
            if self.device.type != "cpu":
                by_device = averages.table(sort_by="self_device_time_total", row_limit=30)
                parts += ["\nby the device's own time\n", by_device]
            parts += ["\nby the host's own time\n", averages.table(sort_by="self_cpu_time_total", row_limit=30)]
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(parts))
            self.say(f"[dflash] --profile: {steps} steps in {seconds:.2f} s, tables in {self.path}")
        except Exception as exc:  # noqa: BLE001
            self.say(f"[dflash] --profile: no tables ({exc}); training goes on")
        self.profiler = None


# ---- plots -----------------------------------------------------------------------------------------------------------
def write_plot(log_path: Path, png_path: Path) -> bool:
    """Loss, mean accuracy and surrogate tau against step. Skipped (False) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[dflash] matplotlib is not installed: skipping --plot (pip install 'dflash[plot]')", file=sys.stderr)
        return False
    records = [json.loads(line) for line in log_path.read_text().splitlines() if line]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_tau" in r]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    axes[0].plot([r["step"] for r in train], [r["loss"] for r in train], label="train")
    axes[0].plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], label="held-out")
    axes[1].plot([r["step"] for r in train], [float(np.mean(r["accuracy"])) for r in train], label="train")
    axes[1].plot([r["step"] for r in evals], [float(np.mean(r["eval_accuracy"])) for r in evals], label="held-out")
    axes[2].plot([r["step"] for r in train], [r["tau"] for r in train], label="train")
    axes[2].plot([r["step"] for r in evals], [r["eval_tau"] for r in evals], label="held-out")
    decoded = [r for r in evals if "eval_decode_tau" in r]
    if decoded:  # what greedy whole-block decoding of the held-out responses gets (DFlash)
        axes[2].plot([r["step"] for r in decoded], [r["eval_decode_tau"] for r in decoded], label="held-out, decoded")
    for ax, title in zip(axes, ("weighted loss", "mean block accuracy", "surrogate tau")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return True


# ---- command line ----------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    from .methods import registry

    add_target_arguments(p)
    # every method is a choice, so that `--method dflash+ngram` is told which drafter to train, not "invalid choice";
    # the usage names the trainable ones
    p.add_argument("--method", default=None, choices=registry.names(),
                   metavar="{" + ",".join(registry.trainable()) + "}",
                   help="what to train: dflash (default) or eagle3; --resume continues the checkpoint's method")
    p.add_argument("--data", required=True, help="folder of shard-*.jsonl files from `dflash data`, or one JSONL file")
    p.add_argument("--out", required=True, help="output folder (checkpoints, log.jsonl, final/)")
    p.add_argument("--config", default=None, help="JSON file of training options; flags override it")
    p.add_argument("--init-from", default=None, help="start from this drafter folder instead of a new drafter")
    p.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue exactly from OUT's newest checkpoint, or from the given checkpoint / run folder")
    p.add_argument("--plot", action="store_true", help="write OUT/curves.png (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--profile", action="store_true",
                   help=f"profile steps {PROFILED[0] + 1}-{PROFILED[1]} (torch.profiler) into OUT/{PROFILE_FILE}: "
                        "operations by the device's time and by the host's")
    p.add_argument("--minutes", type=float, default=None,
                   help="end within this many minutes of the command's start: the run times its pace over its first "
                        "steps and stops at the last step that fits (evaluations and the final save included). A new "
                        "run without --schedule-steps or --max-steps also fits its warmup and cosine to those steps, "
                        "so its learning rate anneals to zero as the time runs out")
    options = p.add_argument_group("training options (also the keys of --config)")
    hints = get_type_hints(TrainConfig)
    for f in fields(TrainConfig):
        if f.name == "method":
            continue
        hint = str(hints[f.name])
        kind = str if hint == str(str) else float if "float" in hint else int
        default = "none" if f.default is None else f.default
        options.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                             help=f"{f.metadata['help']} (default: {default})")


def cli_overrides(args) -> dict:
    return {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name, None) is not None}


def resumed_config(saved: TrainConfig, overrides: dict, folder: Path) -> TrainConfig:
    """The checkpoint's config; only options that cannot change the computed weights may be overridden."""
    if overrides.get("method", saved.method) != saved.method:
        raise UserError(f"{folder} was trained with --method {saved.method}: it cannot be resumed with --method "
                        f"{overrides['method']} (drop --method, or start a new run in another --out)")
    changed = {k: v for k, v in overrides.items() if getattr(saved, k) != v and k not in RESUMABLE}
    if changed:
        detail = ", ".join(f"{k}={v} (checkpoint: {getattr(saved, k)})" for k, v in changed.items())
        raise UserError(f"cannot change {detail} when resuming from {folder}; start a new run instead")
    # max_steps belongs to one invocation (a chunk of a longer run), so it is not inherited from the checkpoint
    return saved.replace({"max_steps": None, **{k: v for k, v in overrides.items() if k in RESUMABLE}})


def recipe_of(config: TrainConfig):
    from .methods import registry

    return registry.get(config.method).training


def method_config(config: TrainConfig, explicit: set[str]) -> TrainConfig:
    """A new run's config with its method's shape defaults filled in; options another method owns, or shape
    options this method fixes, are errors. `explicit`: the options given on the command line or in --config."""
    from .methods import registry

    recipe = recipe_of(config)
    others = {option: name for name in registry.trainable() if name != config.method
              for option in registry.get(name).training.own_options if option not in recipe.own_options}
    stray = sorted(k for k in explicit if k in others)
    if stray:
        owner = others[stray[0]]
        raise UserError(f"{_flags(stray)} applies to --method {owner} only")
    clash = {k: getattr(config, k) for k in recipe.fixed_shape
             if k in explicit and getattr(config, k) != recipe.shape_defaults[k]}
    if clash:
        raise UserError(f"{recipe.fixed_shape_note}; it cannot be trained with {clash}")
    return config.replace({k: v for k, v in recipe.shape_defaults.items() if k not in explicit})


def _flags(names) -> str:
    return ", ".join("--" + name.replace("_", "-") for name in names)


def checked_shape(model, config: TrainConfig, folder: Path) -> None:
    """A checkpoint's model must have the shape its training config says (a mismatched folder is a user error)."""
    found = recipe_of(config).shape_of(model)
    # an option a checkpoint's config predates (None) says nothing about the shape
    found = {k: v for k, v in found.items() if getattr(config, k) is not None}
    expected = {k: getattr(config, k) for k in found}
    if found != expected:
        raise UserError(f"{folder}: the model has {found}, but its training config says {expected} "
                        "(mismatched checkpoint)")


def initial_model(args, target, config: TrainConfig, explicit: set[str]):
    """(model, config) for a fresh run: a new model, or --init-from whose weight shapes win over the defaults."""
    recipe = recipe_of(config)
    if not args.init_from:
        model = recipe.new_model(target, config)
        return model, config.replace(recipe.shape_of(model))
    model = recipe.load_model(Path(args.init_from), target)
    shape = recipe.shape_of(model)
    clash = {k: getattr(config, k) for k, v in shape.items() if k in explicit and getattr(config, k) != v
             and k not in recipe.free_on_init}
    if clash:
        raise UserError(f"--init-from {args.init_from} has {shape}; it cannot be trained with {clash}")
    keep = {k: v for k, v in shape.items() if not (k in recipe.free_on_init and k in explicit)}
    return model, config.replace(keep)


# ---- building a run ----------------------------------------------------------------------------------------------
def build_run(args, overrides: dict, out: Path):
    """Objective, config and the checkpoint to resume (or None)."""
    from .loading import settle_heap, target_from_args

    resume_from = resolve_checkpoint(args.resume, out) if args.resume else None
    if resume_from is not None:
        config = resumed_config(read_checkpoint_config(resume_from), overrides, resume_from)
        explicit: set[str] = set()
    else:
        values = read_config_values(args.config) if args.config else {}
        base = TrainConfig.from_dict(values, str(args.config)) if args.config else TrainConfig()
        config = base.replace(overrides)
        explicit = set(values) | set(overrides)
        config = method_config(config, explicit)
    target = target_from_args(args, many_rows=True)
    settle_heap()  # hours of training after one load
    recipe = recipe_of(config)
    if resume_from is not None:
        model = recipe.load_model(resume_from, target)
        checked_shape(model, config, resume_from)
    else:
        model, config = initial_model(args, target, config, explicit)
    return recipe.objective(model, target, config), config, resume_from


def start_fresh(out: Path) -> None:
    """A new run must not mix its checkpoints and log with an earlier run's."""
    if checkpoint_dirs(out):
        raise UserError(f"{out} already holds checkpoints: pass --resume to continue that run, or pick another --out")
    (out / "log.jsonl").unlink(missing_ok=True)


def run(args) -> int:
    from .methods import registry

    started = time.monotonic()  # --minutes counts from here: loading the data and the target is part of the time
    if args.minutes is not None and not args.minutes > 0:
        raise UserError(f"--minutes must be > 0, got {args.minutes}")

    if args.method is not None and args.method not in registry.trainable():
        raise not_trainable(args.method)
    overrides = cli_overrides(args)
    if args.method is not None:
        overrides["method"] = args.method
    out = Path(args.out)
    examples = load_examples(args.data)
    world = init_world(args.device)
    finish_by = started + 60 * args.minutes if args.minutes is not None else None
    result = train_in(world, args, overrides, out, examples, finish_by)  # on an exception no teardown (World.close)
    world.close()
    return result


def train_in(world: World, args, overrides: dict, out: Path, examples: list[Example],
             finish_by: float | None = None) -> int:
    """One process's part of `dflash train` (the only one without torchrun); `finish_by`: --minutes' end, a
    time.monotonic()."""
    say = (lambda text: print(text, file=sys.stderr)) if world.main else (lambda text: None)
    objective, config, resume_from = build_run(args, overrides, out)
    usable = [e for e in examples if objective.usable(e)]
    if len(usable) < len(examples):
        say(f"[dflash] skipping {len(examples) - len(usable)} sequences with no response token to train on")
    train, heldout = split_heldout(usable, config.eval_fraction)
    if resume_from is None and not args.init_from:
        recipe_of(config).prepare_new(objective, train, config)
    # --minutes fits the schedule of a new run whose length was not given, and only stops any other run in time
    fit_schedule = resume_from is None and config.schedule_steps is None and config.max_steps is None
    trainer = Trainer(objective, config, out, train, heldout, progress=not args.no_progress, world=world,
                      finish_by=finish_by, fit_schedule=fit_schedule, profile=args.profile)
    if resume_from is not None:
        trainer.load_checkpoint(resume_from)
        say(f"[dflash] resumed from {resume_from} at step {trainer.state.step}")
    elif world.main:
        start_fresh(out)
    world.barrier()  # process 0 has checked and cleared OUT before anyone trains
    if world.main:
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(config.to_json())
    processes = f", {world.size} processes" if world.size > 1 else ""
    processes += f", {trainer.per_pass} sequences per pass" if (trainer.per_pass or 1) > 1 else ""
    say(f"[dflash] {config.method}: {len(train)} training / {len(heldout)} held-out sequences, "
        f"{trainer.total_steps} steps ({config.epochs} epochs{processes}), drafter "
        f"{sum(p.numel() for p in trainer.params) / 1e6:.1f}M params")
    trainer.fit()
    if args.plot and world.main:
        write_plot(trainer.log_path, out / "curves.png")
    say(f"[dflash] step {trainer.state.step}/{trainer.total_steps}; drafter saved to {out / 'final'}")
    return 0
