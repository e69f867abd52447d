"""A drafter extrapolated along its last training stage: weights NEW + alpha * (NEW - OLD), in NEW's dtypes (bf16 for
the shipped drafters), with NEW's config, vocabulary and training config (the docs record how it was made).

Usage: .venv/bin/python scripts/extrapolate_drafter.py NEW OLD ALPHA OUT [OLDER BETA]

NEW and OLD are two drafter folders of one lineage (OLD the warm start NEW was trained from, e.g. the shipped drafter
before and after a lease). alpha < 0 interpolates back toward OLD. OLDER and BETA add the stage before:
NEW + alpha * (NEW - OLD) + beta * (OLD - OLDER), a point of the plane of the last two stages (for stage 16 none
scored above the line's, docs/TRAINING.md). Each stage's step is short against what the
drafter still has to learn, so the loss may keep falling some way past NEW along it (docs/TRAINING.md, "Stage 16x":
it did for stage 16, not for stage 15; choose alpha by held-out surrogate tau, `scripts/eval_heldout.py`, never by a
benchmark's prompts). No training and no data: the result is any other drafter to the verification loop, so
decoding stays lossless whatever alpha is.
"""

import shutil
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

COPIED = ("config.json", "draft_vocab.json")  # must agree: one lineage


def extrapolated(new: dict[str, torch.Tensor], old: dict[str, torch.Tensor], alpha: float,
                 older: dict[str, torch.Tensor] | None = None, beta: float = 0.0) -> dict[str, torch.Tensor]:
    """new + alpha * (new - old) [+ beta * (old - older)], tensor by tensor, in float32, then in new's dtypes."""
    others = [old] if older is None else [old, older]
    for other in others:
        if new.keys() != other.keys():
            raise SystemExit(f"the drafters hold different tensors: {sorted(new.keys() ^ other.keys())[:5]}")
    out = {}
    for name, tensor in new.items():
        for other in others:
            if tensor.shape != other[name].shape:
                raise SystemExit(f"{name}: shape {tuple(tensor.shape)} against {tuple(other[name].shape)}")
        point = tensor.float() + alpha * (tensor.float() - old[name].float())
        if older is not None:
            point += beta * (old[name].float() - older[name].float())
        out[name] = point.to(tensor.dtype).contiguous()
    return out


def main() -> int:
    if len(sys.argv) not in (5, 7):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    new_dir, old_dir, out_dir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[4])
    alpha = float(sys.argv[3])
    older_dir, beta = (Path(sys.argv[5]), float(sys.argv[6])) if len(sys.argv) == 7 else (None, 0.0)
    folders = [f for f in (new_dir, old_dir, older_dir) if f is not None]
    for folder in folders:
        if not (folder / "model.safetensors").is_file():
            print(f"{folder}: no model.safetensors (a drafter folder?)", file=sys.stderr)
            return 2
    for name in COPIED:
        for other in folders[1:]:
            if (new_dir / name).is_file() and (other / name).is_file() \
                    and (new_dir / name).read_bytes() != (other / name).read_bytes():
                print(f"{name} differs between {new_dir} and {other}: not one lineage", file=sys.stderr)
                return 2
    older = load_file(older_dir / "model.safetensors") if older_dir is not None else None
    weights = extrapolated(load_file(new_dir / "model.safetensors"), load_file(old_dir / "model.safetensors"), alpha,
                           older, beta)
    with safe_open(new_dir / "model.safetensors", "pt") as f:
        metadata = f.metadata()  # {"format": "pt"}, which transformers' loader checks for
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, out_dir / "model.safetensors", metadata=metadata)
    for name in (*COPIED, "train_config.json"):
        if (new_dir / name).is_file():
            shutil.copy(new_dir / name, out_dir / name)
    beyond = f" + {beta} x ({old_dir} - {older_dir})" if older_dir is not None else ""
    print(f"{out_dir}: {new_dir} + {alpha} x ({new_dir} - {old_dir}){beyond}, {len(weights)} tensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
