"""`dflash train`'s options as one dataclass (`TrainConfig`): each field's default and --help text together, read
from a JSON file or the command line with every value checked (unknown keys and wrong types are user errors), and
written beside each checkpoint so that a resumed run knows what it was."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import get_type_hints

from .errors import UserError


def option(default, help_text: str):
    """A training option: its default and its --help text (which shows the default)."""
    return field(default=default, metadata={"help": help_text})


@dataclass
class TrainConfig:
    method: str = option("dflash", "what to train: a method with a training recipe (dflash, eagle3)")
    # drafter shape: a new drafter takes these (or its method's own defaults); --init-from and --resume take the
    # shape from the checkpoint
    num_layers: int = option(3, "draft layers of a new drafter (dflash 3; an EAGLE-3 head has 1); dflash with "
                                "--init-from: more than the drafter's own appends layers that start silent")
    block_size: int = option(16, "tokens per block: dflash's block, EAGLE-3's chain steps + 1 (dflash 16, eagle3 8)")
    num_features: int = option(5, "target layers fused as features (dflash 5; an EAGLE-3 head fuses 3)")
    draft_vocab: int | None = option(None, "draft vocabulary = the N most frequent response tokens of the training "
                                           "data (8192, capped at the target's): the tokens a new drafter proposes")
    # data
    max_length: int = option(3072, "truncate sequences to this many tokens")
    anchors_per_seq: int = option(512, "dflash: blocks per sequence, re-sampled each epoch")
    anchors: str = option("uniform", "dflash: where blocks start: uniform (anchors_per_seq positions at random) or "
                                     "decoded (where greedy decoding with the drafter as it is would start them in "
                                     "a random window of anchors_per_seq positions: after its rejected drafts)")
    eval_fraction: float = option(0.02, "fraction of sequences held out for the surrogate tau")
    # optimisation
    epochs: int = option(6, "passes over the training data")
    lr: float = option(6e-4, "peak AdamW learning rate")
    weight_decay: float = option(0.01, "AdamW weight decay")
    warmup_ratio: float = option(0.04, "linear warmup, as a fraction of all steps, before the cosine decay")
    grad_clip: float = option(1.0, "max gradient norm")
    grad_accum: int = option(1, "sequences per optimizer step")
    seqs_per_pass: int = option(0, "dflash: sequences run through the target and the drafter together (0: auto: "
                                   "1 on a CPU; on a GPU, 1 or a step's share, whichever its first step times "
                                   "faster)")
    attention: str = option("auto", "dflash: the training attention's kernel: blocks (torch operations, any "
                                    "device), flex (FlexAttention over a block mask, compiled; CUDA only), "
                                    "compiled (blocks, the drafter's layers around it compiled by torch.compile) or "
                                    "auto (on a GPU, whichever its first step times fastest; blocks elsewhere)")
    gamma: float | None = option(None, "dflash: loss decay over block positions (7 for B=16, 5 for B=10, 4 for B=8, "
                                       "interpolated)")
    loss: str = option("ce", "dflash: ce (cross-entropy on the target's regenerated tokens) or kl (self-distillation: "
                             "KL to the target's own distribution at every block position)")
    loss_vocab: str = option("draft", "dflash: the loss scores the drafter's draft vocabulary plus the sequence's "
                                      "prompt tokens, the rows drafting scores (draft; 3x cheaper at 16K of 49K "
                                      "rows), or every row (full)")
    kv_heads: int | None = option(None, "dflash: key/value heads of the drafter's attention (default: the target's); "
                                        "the context reaches the block only through their values. With --init-from, "
                                        "a multiple of the drafter's own widens it without changing its outputs")
    init: str = option("random", "dflash: a new drafter's layers: random, or target (copied from the target's last "
                                 "layers, same width)")
    schedule_steps: int | None = option(None, "length of the warmup + cosine schedule in optimizer steps (default: "
                                              "all epochs); with max_steps, a run of fixed compute")
    seed: int = option(0, "seed of the data order, anchors, held-out split and a new drafter's weights")
    # bookkeeping
    log_every: int = option(10, "steps between log records")
    eval_every: int = option(500, "steps between held-out evaluations")
    save_every: int = option(1000, "steps between checkpoints")
    save_minutes: float | None = option(None, "also checkpoint when this many minutes passed since the last one")
    keep_checkpoints: int = option(3, "keep only the newest N checkpoints, 0 = all")
    max_steps: int | None = option(None, "stop after this global step; the schedule still spans all epochs "
                                         "(for chunked runs)")

    def validate(self) -> "TrainConfig":
        from .methods import registry
        from .methods.dflash.attention import KERNELS as ATTENTION_KERNELS

        if self.method not in registry.trainable():
            raise not_trainable(self.method)
        for name in ("draft_vocab", "kv_heads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        positive = ("num_layers", "num_features", "max_length", "anchors_per_seq", "epochs", "grad_accum",
                    "log_every", "eval_every", "save_every")
        for name in positive:
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise UserError(f"block_size must be >= 2, got {self.block_size}")
        if not self.lr > 0:
            raise UserError(f"lr must be > 0, got {self.lr}")
        if self.gamma is not None and not self.gamma > 0:
            raise UserError(f"gamma must be > 0, got {self.gamma}")
        for name in ("eval_fraction", "warmup_ratio"):
            if not 0 <= getattr(self, name) < 1:
                raise UserError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.weight_decay < 0 or self.grad_clip <= 0 or self.keep_checkpoints < 0:
            raise UserError("weight_decay and keep_checkpoints must be >= 0 and grad_clip > 0")
        if self.seqs_per_pass < 0:
            raise UserError(f"seqs_per_pass must be >= 0 (0: auto), got {self.seqs_per_pass}")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.save_minutes is not None and not self.save_minutes > 0:
            raise UserError(f"save_minutes must be > 0, got {self.save_minutes}")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise UserError(f"schedule_steps must be >= 1, got {self.schedule_steps}")
        if self.loss not in ("ce", "kl"):
            raise UserError(f"loss must be ce or kl, got {self.loss!r}")
        if self.anchors not in ("uniform", "decoded"):
            raise UserError(f"anchors must be uniform or decoded, got {self.anchors!r}")
        if self.loss_vocab not in ("draft", "full"):
            raise UserError(f"loss_vocab must be draft or full, got {self.loss_vocab!r}")
        if self.attention not in ("auto", *ATTENTION_KERNELS):
            raise UserError(f"attention must be auto, {', '.join(ATTENTION_KERNELS)}, got {self.attention!r}")
        if self.init not in ("random", "target"):
            raise UserError(f"init must be random or target, got {self.init!r}")
        return self

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_dict(cls, values: dict, source: str = "config") -> "TrainConfig":
        hints = get_type_hints(cls)
        unknown = sorted(set(values) - set(hints))
        if unknown:
            raise UserError(f"{source}: unknown training option(s) {', '.join(unknown)}")
        checked = {name: _checked_value(name, value, hints[name], source) for name, value in values.items()}
        return cls(**checked).validate()

    @classmethod
    def from_file(cls, path: str | Path) -> "TrainConfig":
        return cls.from_dict(read_config_values(path), str(path))

    def replace(self, overrides: dict, source: str = "command line") -> "TrainConfig":
        return TrainConfig.from_dict({**asdict(self), **overrides}, source)


def read_config_values(path: str | Path) -> dict:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"cannot read training config {path}: {exc}") from exc
    if not isinstance(values, dict):
        raise UserError(f"{path}: a training config is a JSON object")
    return values


# Options a resumed run may change: they do not affect the weights it computes (seqs_per_pass only their rounding).
RESUMABLE = ("log_every", "eval_every", "save_every", "save_minutes", "keep_checkpoints", "max_steps", "seqs_per_pass",
             "attention")
def _checked_value(name: str, value, hint, source: str):
    optional = "None" in str(hint)
    if value is None:
        if optional:
            return None
        raise UserError(f"{source}: {name} may not be null")
    if hint is str:
        if not isinstance(value, str):
            raise UserError(f"{source}: {name} must be a string, got {value!r}")
        return value
    base = float if "float" in str(hint) else int
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not is_number or (base is int and not float(value).is_integer()):
        raise UserError(f"{source}: {name} must be a number ({base.__name__}), got {value!r}")
    return base(value)


def not_trainable(method: str) -> UserError:
    from .methods import registry

    drafter = registry.drafter_of(method)
    if drafter != method and drafter in registry.trainable():
        return UserError(f"--method {method} uses {drafter}'s drafter: train it with --method {drafter}")
    return UserError(f"--method {method} needs no training: `dflash train` trains "
                     f"{' or '.join(registry.trainable())} drafters")
