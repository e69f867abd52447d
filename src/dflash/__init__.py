"""dflash: lossless block-diffusion speculative decoding (DFlash) for Hugging Face causal LMs."""

from .drafter import DFlashConfig, DFlashDrafter
from .engine import GenerationConfig, GenerationResult, SpeculativeDecoder
from .errors import UserError
from .proposers import DFlashProposer, NgramProposer, Proposer
from .sampling import SamplingConfig
from .target import TargetModel, load_target

__all__ = [
    "DFlashConfig", "DFlashDrafter", "DFlashProposer", "GenerationConfig", "GenerationResult", "NgramProposer",
    "Proposer", "SamplingConfig", "SpeculativeDecoder", "TargetModel", "UserError", "load_target",
]
__version__ = "0.1.0"
