"""Every drafting method by name. Adding a method: one new module or package exporting METHOD, one line here."""

from __future__ import annotations

from ..errors import UserError
from . import ar, dflash, eagle3, ngram
from .base import Method

METHODS: dict[str, Method] = {m.name: m for m in (
    ar.METHOD,
    ngram.METHOD,
    dflash.METHOD,
    eagle3.METHOD,
)}
DEFAULT_METHOD = "dflash"


def get(name: str) -> Method:
    if name not in METHODS:
        raise UserError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]


def names() -> list[str]:
    return list(METHODS)


def trainable() -> list[str]:
    return [name for name, method in METHODS.items() if method.training is not None]
