"""Every drafting method by name. Adding a method: one new module or package exporting METHOD, one line here.

Each method that loads a drafter also comes as NAME+ngram: the same drafter with prompt lookup beside it, a free
second source of drafts that a round verifies instead of running the drafter where it expects them to be worth more
(control.py). It loads the same drafter (`--drafter NAME=PATH` applies to both)."""

from __future__ import annotations

import sys

from ..errors import UserError
from . import ar, dflash, eagle3, ngram
from .base import Method, MethodOptions

LOOKUP_SUFFIX = "+ngram"


def with_lookup(method: Method) -> Method:
    """`method` with prompt lookup beside its drafter (see the module docstring)."""
    def build(target, options: MethodOptions):
        proposer, note = method.build_proposer(target, options)
        proposer.lookup = ngram.lookup_for(target, proposer.max_draft, options)
        proposer.report = {**proposer.report, **proposer.lookup.report}
        proposer.name = method.name + LOOKUP_SUFFIX  # what the server reports
        return proposer, note

    return Method(name=method.name + LOOKUP_SUFFIX, build_proposer=build, uses_drafter=method.uses_drafter,
                  summary=f"{method.name}, or prompt lookup (ngram) in the rounds where its drafts are worth more",
                  block_size_help=method.block_size_help)


_SINGLE = (
    ar.METHOD,
    ngram.METHOD,
    dflash.METHOD,
    eagle3.METHOD,
)
METHODS: dict[str, Method] = {m.name: m for m in (
    *_SINGLE,
    *(with_lookup(m) for m in _SINGLE if m.uses_drafter),
)}
# the shipped DFlash drafter with prompt lookup (and the target's continuation table) beside it: on the four datasets
# of the twenty-first session's benches it ran 1.36x-1.73x ar (float32 and bfloat16), where dflash alone ran
# 0.93x-1.09x and ngram alone 1.38x-1.72x (docs/RESULTS.md)
DEFAULT_METHOD = "dflash+ngram"


def get(name: str) -> Method:
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def drafter_of(name: str) -> str:
    """The method whose drafter `name` loads: NAME for NAME+ngram, else itself."""
    return name.removesuffix(LOOKUP_SUFFIX)


def uses_lookup(name: str) -> bool:
    """Whether method `name` drafts by prompt lookup (and so reads a continuation table): ngram and NAME+ngram."""
    return name == ngram.METHOD.name or name.endswith(LOOKUP_SUFFIX)


# vLLM's speculative_config methods that are ones of ours, by the same names (its "eagle" is EAGLE-1's head)
VLLM_METHODS = ("dflash", "eagle3", "ngram")
SPECULATIVE_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def from_speculative_config(config) -> tuple[str, dict]:
    """The method of vLLM's speculative_config and the MethodOptions fields it sets: {"method": "dflash", "model":
    FOLDER, "num_speculative_tokens": K} verifies K drafts and the bonus a round (block K + 1); an ngram's
    prompt_lookup_max / _min are prompt lookup's longest and shortest match. dflash's own method names (NAME+ngram)
    are taken too; vLLM's other keys tune its engine and are reported as not used."""
    if not isinstance(config, dict):
        raise UserError(f"speculative_config must be a JSON object, got {config!r}")
    name = config.get("method")
    method = name if name in METHODS and name != "ar" else None
    if method is None:
        raise UserError(f"speculative_config method {name!r}: give one of {', '.join(VLLM_METHODS)} (vLLM's names) "
                        f"or {', '.join(m for m in METHODS if m.endswith(LOOKUP_SUFFIX))}")
    drafter = config.get("model")
    if drafter is not None and not get(method).uses_drafter:
        raise UserError(f"speculative_config model {drafter!r}: {method} loads no drafter")
    if drafter is not None and not isinstance(drafter, str):
        raise UserError(f"speculative_config model must be a drafter folder, got {drafter!r}")
    drafts = config.get("num_speculative_tokens")
    if drafts is not None and (isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1):
        raise UserError(f"speculative_config num_speculative_tokens must be a whole number >= 1, got {drafts!r}")
    lookup = {key: config[key] for key in ("prompt_lookup_max", "prompt_lookup_min") if key in config}
    if lookup and not uses_lookup(method):
        raise UserError(f"speculative_config {', '.join(lookup)}: {method} does no prompt lookup (ngram, NAME+ngram)")
    unused = [key for key in config if key not in SPECULATIVE_KEYS]
    if unused:
        print(f"[dflash] speculative_config: {', '.join(unused)} not used here", file=sys.stderr)
    return method, {"drafter": drafter, "block_size": None if drafts is None else drafts + 1, **lookup}


def names() -> list[str]:
    return list(METHODS)


def trainable() -> list[str]:
    return [name for name, method in METHODS.items() if method.training is not None]
