"""From user-facing names to ready objects: targets (incl. tiny random ones) and proposers by method name."""

from __future__ import annotations

from pathlib import Path

import torch

from .drafter import DFlashConfig, DFlashDrafter, default_mask_token_id
from .errors import UserError
from .packed import pack_linears
from .proposers import DFlashProposer, NgramProposer, Proposer
from .target import TargetModel, load_target

SHIPPED_DRAFTERS = Path(__file__).parent / "drafters"
METHODS = ("ar", "ngram", "dflash", "eagle3")


def load_target_cached(spec: str, dtype: str = "float32", device: str = "cpu") -> TargetModel:
    """`tiny-llama` / `tiny-qwen3` / `tiny-gemma3` give tiny random targets; anything else goes to load_target."""
    if spec.startswith("tiny-"):
        from .testing import tiny_target

        arch = spec.removeprefix("tiny-")
        if arch not in ("llama", "qwen3", "gemma3"):
            raise UserError(f"unknown tiny target {spec!r}; use tiny-llama, tiny-qwen3 or tiny-gemma3")
        from .target import DTYPES

        target = tiny_target(arch, logit_scale=4.0)
        target.model.to(DTYPES.get(dtype, torch.float32))
        target.pack_linears()
        return target
    return load_target(spec, dtype, device)


def shipped_drafter_dir(target: TargetModel, method: str = "dflash") -> Path | None:
    folder = SHIPPED_DRAFTERS / f"{target.name}-{method}"
    return folder if (folder / "config.json").is_file() else None


def untrained_drafter(target: TargetModel, num_layers: int = 3, block_size: int = 16) -> DFlashDrafter:
    cfg = DFlashConfig.for_target(
        target.config, target.vocab_size, default_mask_token_id(target.tokenizer, target.vocab_size),
        num_layers=num_layers, block_size=block_size,
    )
    torch.manual_seed(0)
    return DFlashDrafter(cfg).to(device=target.device, dtype=target.dtype)


def load_drafter(
    path: str | Path | None, target: TargetModel, dtype: torch.dtype | None = None
) -> tuple[DFlashDrafter, str | None]:
    """The drafter at `path`, else the shipped one for this target, else an untrained one (with a note saying so).
    It runs in `dtype` (default: the target's)."""
    dtype = dtype or target.dtype
    note = None
    if path is None:
        path = shipped_drafter_dir(target)
        if path is None:
            note = f"no trained drafter ships for {target.name}: using an UNTRAINED drafter (expect tau ~1, no speedup)"
            drafter = untrained_drafter(target).to(dtype)
            pack_linears(drafter)
            return drafter, note
    elif not Path(path).exists():
        raise UserError(f"drafter folder not found: {path}")
    drafter = DFlashDrafter.load(path, dtype=dtype, device=str(target.device))
    drafter.check_fits(target)
    pack_linears(drafter)  # loaded for drafting only: its weights no longer change
    return drafter, note


def default_min_confidence(device: torch.device) -> float:
    """On CPU a float32 verify pass is compute-bound (about 0.8 ms more per verified token for SmolLM2 on 2 cores), so
    drafts the drafter itself doubts cost more than they bring: on GSM8K, block 16 went from 1.00x to 1.25x of `ar`
    with 0.05 (docs/RESULTS.md). On GPUs verifying 16 tokens costs about what 1 does, so whole blocks are kept."""
    return 0.05 if device.type == "cpu" else 0.0


def build_proposer(
    method: str, target: TargetModel, drafter_path: str | None = None, block_size: int | None = None,
    draft_dtype: str | None = None, min_confidence: float | None = None,
) -> tuple[Proposer, str | None]:
    """A proposer by method name; `draft_dtype` (e.g. "bfloat16") runs a drafter cheaper than the target;
    `min_confidence` > 0 trims DFlash blocks to the drafts the drafter is sure enough of (None: the device's
    default, see default_min_confidence)."""
    from .target import DTYPES

    if draft_dtype is not None and draft_dtype not in DTYPES:
        raise UserError(f"unknown draft dtype {draft_dtype!r}; choose one of {', '.join(DTYPES)}")
    dtype = DTYPES[draft_dtype] if draft_dtype else None
    if method == "ar":
        return Proposer(), None
    if method == "ngram":
        return NgramProposer(max_draft=(block_size or 8) - 1), None
    if method == "dflash":
        drafter, note = load_drafter(drafter_path, target, dtype)
        if min_confidence is None:
            min_confidence = default_min_confidence(target.device)
        return DFlashProposer(drafter, target, block_size, min_confidence), note
    if method == "eagle3":
        try:
            from .eagle3 import build_eagle3_proposer
        except ModuleNotFoundError as exc:
            raise UserError("the eagle3 method is not available in this build") from exc
        return build_eagle3_proposer(target, drafter_path, depth=block_size - 1 if block_size else None, dtype=dtype)
    raise UserError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
