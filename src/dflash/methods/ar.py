"""`ar`: plain autoregressive decoding through the same engine, the baseline every speedup is measured against."""

from .base import Method, MethodOptions, Proposer


def build(target, options: MethodOptions) -> tuple[Proposer, None]:
    return Proposer(), None


METHOD = Method(name="ar", summary="plain autoregressive decoding (the baseline)", build_proposer=build)
