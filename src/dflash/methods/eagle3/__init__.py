"""EAGLE-3, the baseline: a one-layer head drafting a chain (head.py: the model; objective.py: its training-time-test
training; proposer.py: chain drafting)."""

from ..base import Method
from .objective import Eagle3Training
from .proposer import build

METHOD = Method(
    name="eagle3",
    summary="EAGLE-3 chain drafting with a one-layer head on low/middle/high target features",
    build_proposer=build,
    uses_drafter=True,
    training=Eagle3Training(),
    block_size_help="the chain depth + 1",
)
