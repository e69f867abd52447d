"""DFlash: block-diffusion drafting (drafter.py: the model; objective.py: its training; proposer.py: drafting)."""

from ..base import Method
from .objective import DFlashTraining
from .proposer import build

METHOD = Method(
    name="dflash",
    summary="block diffusion: a drafter reading target features proposes a whole block in one pass",
    build_proposer=build,
    uses_drafter=True,
    training=DFlashTraining(),
    block_size_help="the drafter's block size (at most the one it was trained with)",
)
