"""Drafter folders on disk: config.json + model.safetensors, read and written with errors a user can act on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from .errors import UserError


def write_folder(folder: str | Path, state: dict[str, torch.Tensor], config: dict,
                 dtype: torch.dtype | None = None) -> None:
    """Float tensors are cast to `dtype` when given; integer tensors (index maps) never are."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cast = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
            for k, v in state.items()}
    save_file(cast, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def folder_not_found(path: str | Path, kind: str) -> UserError:
    """The error for a `kind` folder that does not exist. A name shaped like a hub id (org/name: what a vLLM or SGLang
    config names) is told that drafters load from a local folder only: nothing is fetched from a hub at run time."""
    text = str(path)
    hint = ""
    if re.fullmatch(r"[\w.-]+/[\w.-]+", text) and not text.startswith("."):
        hint = (f" ({text} looks like a hub id; drafters load from a local folder only: download it first, e.g. "
                f"`huggingface-cli download {text} --local-dir DIR`, and give DIR)")
    return UserError(f"{kind} folder not found: {text}{hint}")


def check_folder(folder: str | Path, kind: str) -> None:
    """A UserError unless `folder` holds a `kind` folder's two files (the CLI asks before it loads the target)."""
    missing = [name for name in ("config.json", "model.safetensors") if not (Path(folder) / name).is_file()]
    if missing:
        raise UserError(f"{folder} is not a {kind} folder (needs config.json and model.safetensors; it has no "
                        f"{' or '.join(missing)})")


def read_folder(folder: str | Path, kind: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a `kind` folder ("drafter", "EAGLE-3 head"), or a UserError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    check_folder(folder, kind)
    try:
        config = json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{folder / 'config.json'} is not valid JSON: {exc}") from exc
    try:
        state = load_file(str(folder / "model.safetensors"))
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{folder / 'model.safetensors'} is unreadable or corrupt: {exc}") from exc
    return config, state


def load_weights(module: torch.nn.Module, state: dict[str, torch.Tensor], kind: str, folder) -> None:
    """Load `state` into `module`; any missing, unexpected or mis-shaped weight is a UserError."""
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as exc:  # shape mismatches raise even with strict=False
        raise UserError(f"{kind} weights in {folder} do not match its config.json: {str(exc)[:300]}") from exc
    if missing or unexpected:
        raise UserError(f"{kind} weights in {folder} do not match its config.json: "
                        f"missing {missing[:3]}, unexpected {unexpected[:3]}")
