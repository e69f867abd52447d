"""Log-probabilities of the tokens a generation emits, as OpenAI's `logprobs` reports them.

They are the target's own: log-softmax of its raw logits at the position that chose each token, before temperature,
top-k or top-p (vLLM's default, "raw logprobs"). Speculative decoding changes nothing here: a round's verify pass
holds the target's logits at every accepted position, so the figures are those a plain decoding step computes, up
to float rounding between a one-token step and a wider pass.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat's top_logprobs (and vLLM's default max_logprobs)


@dataclass
class TokenLogprob:
    """One emitted token: its id, its log-probability, and the `top` most likely tokens at its position."""

    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`logits` [n, vocab] at the positions that chose `tokens` (n of them): each token's log-probability and the
    `top` most likely alternatives at its position, most likely first."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0].tolist()
    if top > 0:
        values, ids = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [[] for _ in tokens]
    return [TokenLogprob(t, lp, alternatives) for t, lp, alternatives in zip(tokens, chosen, tops)]


@functools.cache
def byte_level_alphabet() -> dict[str, int]:
    """The characters byte-level BPE tokenizers (GPT-2's scheme) spell each byte with, mapped back to the byte:
    printable bytes stand for themselves, the others for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes a token contributes to the text (a token may hold part of a UTF-8 character, which its decoded
    text cannot show): through the byte-level alphabet or a byte-fallback token where the tokenizer uses one, else
    the token's own text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if piece is None:  # a row past the tokenizer's vocabulary (a model's padded embedding): no text
        return b""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ == "ByteLevel":
        alphabet = byte_level_alphabet()
        if all(c in alphabet for c in piece):
            return bytes(alphabet[c] for c in piece)
    if match := BYTE_TOKEN.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
