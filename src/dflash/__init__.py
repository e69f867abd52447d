"""dflash: lossless block-diffusion speculative decoding (DFlash) for Hugging Face causal LMs."""

from .engine import GenerationConfig, GenerationResult, SpeculativeDecoder
from .errors import UserError
from .llm import LLM, SamplingParams, StructuredOutputsParams
from .methods.base import Draft, MethodOptions, Proposer
from .methods.dflash.drafter import DFlashConfig, DFlashDrafter
from .methods.dflash.proposer import DFlashProposer
from .methods.ngram import NgramProposer
from .models.target import TargetModel, load_target, wrap_target
from .sampling import SamplingConfig

__all__ = [
    "DFlashConfig", "DFlashDrafter", "DFlashProposer", "Draft", "GenerationConfig", "GenerationResult", "LLM",
    "MethodOptions", "NgramProposer", "Proposer", "SamplingConfig", "SamplingParams", "SpeculativeDecoder",
    "StructuredOutputsParams", "TargetModel", "UserError", "load_target", "wrap_target",
]
__version__ = "0.1.0"
