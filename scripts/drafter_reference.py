"""Recompute tests/data/shipped_drafters_reference.json for retrained drafters with the code of commit 8ee6a20
(before the method registry, shared layers and position-indexed caches), which
`tests/test_real_model.py::test_shipped_drafters_compute_what_they_did_before_the_refactor` holds today's code to.

Usage (from the repo root):
    git worktree add /tmp/dflash-8ee6a20 8ee6a20
    PYTHONPATH=/tmp/dflash-8ee6a20/src .venv/bin/python scripts/drafter_reference.py \
        src/dflash/drafters/smollm2-135m-dflash src/dflash/drafters/smollm2-135m-eagle3

It keeps the stored token sequence and rewrites the DFlash and EAGLE-3 entries from the given folders. The old code
reads the same checkpoint format (it ignores draft_vocab.json: the reference scores the whole vocabulary).
"""

import json
import sys
from pathlib import Path

import torch

REFERENCE = Path(__file__).resolve().parent.parent / "tests" / "data" / "shipped_drafters_reference.json"


def main() -> None:
    import dflash

    if not Path(dflash.__file__).resolve().parent.joinpath("proposers.py").is_file():
        sys.exit("run with PYTHONPATH pointing at a worktree of commit 8ee6a20's src/ (see the docstring)")
    from dflash.drafter import DFlashDrafter
    from dflash.eagle3 import build_eagle3_proposer
    from dflash.target import load_target

    dflash_dir, eagle3_dir = sys.argv[1:3]
    reference = json.loads(REFERENCE.read_text())
    seq = reference["sequence"]
    last = len(seq) - 1
    target = load_target("smollm2-135m")
    with torch.inference_mode():
        drafter = DFlashDrafter.load(dflash_dir)
        layers = tuple(drafter.config.target_layer_ids)
        feats = target.forward(torch.tensor([seq]), None, layers).features
        block = torch.tensor([[seq[-1]] + [drafter.config.mask_token_id] * 15])
        hidden = drafter(target.embed_tokens(block), torch.arange(last, last + 16)[None], feats[:, :last],
                         torch.arange(last)[None])
        logits = (hidden[0, 1:] @ target.lm_head.weight.t()).float()
        reference["dflash"] = {"argmax": logits.argmax(-1).tolist(), "max": logits.max(-1).values.tolist(),
                               "mean": logits.mean(-1).tolist()}

        proposer, _ = build_eagle3_proposer(target, eagle3_dir, dtype=torch.float32)
        feats = target.forward(torch.tensor([seq]), None, proposer.feature_layers).features
        proposer.start(seq[:last], feats[:, :last])
        drafts = proposer.propose(seq)
        head_logits = proposer.head.logits(proposer.head.fuse(feats[:, :last])).float()[0]
        reference["eagle3"] = {"drafts": drafts, "fuse_logits_max": head_logits.max(-1).values[-5:].tolist(),
                               "fuse_logits_argmax": head_logits.argmax(-1)[-5:].tolist()}
    REFERENCE.write_text(json.dumps(reference) + "\n")
    print(f"wrote {REFERENCE}: dflash argmax {reference['dflash']['argmax']}, eagle3 drafts {drafts}")


if __name__ == "__main__":
    main()
