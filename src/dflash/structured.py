"""Structured output: generations that are always a JSON object (OpenAI's `response_format: {"type": "json_object"}`).

At every position the target picks its token among those that keep the output a prefix of a JSON object, and may
end only once the object is closed. The mask is applied to the target's logits where penalties are (sampling.py): at
each position of a verify block from the state the tokens before it leave (the committed output, then the block's
drafts up to it). A draft the grammar refuses is simply never the target's pick, so speculation stays lossless with
respect to constrained decoding of the target alone: greedy tokens are identical, seeded samples too.

The grammar runs on bytes, as byte-level tokenizers cut text: a token may hold a closing quote and the comma after
it, or half of a UTF-8 character inside a string (strings take valid UTF-8 only, so the text always decodes). A
pushdown automaton over bytes (`feed`) says what each byte leaves; a token's mask over the whole vocabulary walks the
vocabulary sorted as bytes, so a prefix the grammar refuses is skipped with every token that starts with it (a trie
walk without the trie), and inside a string the tokens of plain characters, most of the vocabulary, are allowed at
once. Masks are kept per state: a generation meets few distinct states (in a string, after a key, after a
value, at each nesting).

Runs of whitespace between tokens of the grammar are capped (MAX_SPACES): a small model under a JSON mask otherwise
likes to pad with newlines until it runs out of tokens.
"""

from __future__ import annotations

import bisect
import functools
import json
from collections import OrderedDict

import torch

from .errors import UserError

RESPONSE_FORMATS = ("text", "json_object")
MAX_SPACES = 32  # consecutive whitespace bytes between structural tokens
MASK_CACHE_BYTES = 64 << 20  # masks kept per vocabulary, as bool tensors

# modes of the automaton (a state is (mode, aux, spaces, stack); stack: the open containers, "o" or "a")
(START, OBJECT_OPEN, KEY_NEXT, COLON, VALUE, ARRAY_OPEN, AFTER_VALUE, STRING, ESCAPE, UNICODE, UTF8, MINUS, ZERO,
 INTEGER, POINT, FRACTION, EXP_MARK, EXP_SIGN, EXPONENT, LITERAL, DONE) = range(21)
WHITESPACE = frozenset(b" \t\n\r")
DIGITS = frozenset(b"0123456789")
HEX = frozenset(b"0123456789abcdefABCDEF")
SIMPLE_ESCAPES = frozenset(b'"\\/bfnrt')
LITERALS = (b"true", b"false", b"null")
QUOTE, BACKSLASH = ord('"'), ord("\\")
# a number's modes: byte class -> next mode; the modes where a number may end, the byte then read as after a value
NUMBER_MOVES = {
    MINUS: {"0": ZERO, "d": INTEGER},
    ZERO: {".": POINT, "e": EXP_MARK},
    INTEGER: {"0": INTEGER, "d": INTEGER, ".": POINT, "e": EXP_MARK},
    POINT: {"0": FRACTION, "d": FRACTION},
    FRACTION: {"0": FRACTION, "d": FRACTION, "e": EXP_MARK},
    EXP_MARK: {"+": EXP_SIGN, "0": EXPONENT, "d": EXPONENT},
    EXP_SIGN: {"0": EXPONENT, "d": EXPONENT},
    EXPONENT: {"0": EXPONENT, "d": EXPONENT},
}
NUMBER_ENDS = {ZERO, INTEGER, FRACTION, EXPONENT}
BYTE_CLASS = {**{b: "d" for b in b"123456789"}, ord("0"): "0", ord("."): ".", ord("e"): "e", ord("E"): "e",
              ord("+"): "+", ord("-"): "+"}

START_STATE = (START, 0, 0, ())


def _utf8_lead(byte: int) -> tuple[int, int, int] | None:
    """A UTF-8 lead byte's continuation bytes to come and the range of the first (strict: no overlong forms, no
    surrogates, nothing past U+10FFFF, as Python's decoder)."""
    if 0xC2 <= byte <= 0xDF:
        return 1, 0x80, 0xBF
    if 0xE0 <= byte <= 0xEF:
        return 2, 0xA0 if byte == 0xE0 else 0x80, 0x9F if byte == 0xED else 0xBF
    if 0xF0 <= byte <= 0xF4:
        return 3, 0x90 if byte == 0xF0 else 0x80, 0x8F if byte == 0xF4 else 0xBF
    return None


def feed(state: tuple, byte: int) -> tuple | None:
    """The state after one more byte, or None where no JSON object continues that way."""
    mode, aux, spaces, stack = state
    if mode == STRING:
        if byte == QUOTE:
            return (COLON, 0, 0, stack) if aux else (AFTER_VALUE, 0, 0, stack)
        if byte == BACKSLASH:
            return (ESCAPE, aux, 0, stack)
        if byte < 0x80:
            return state if byte >= 0x20 else None  # raw control characters are not allowed in a string
        lead = _utf8_lead(byte)
        return None if lead is None else (UTF8, (aux, *lead), 0, stack)
    if mode == UTF8:  # inside a multi-byte character: aux is (is_key, bytes to come, the next one's range)
        is_key, left, low, high = aux
        if not low <= byte <= high:
            return None
        return (STRING, is_key, 0, stack) if left == 1 else (UTF8, (is_key, left - 1, 0x80, 0xBF), 0, stack)
    if mode == ESCAPE:
        if byte in SIMPLE_ESCAPES:
            return (STRING, aux, 0, stack)
        return (UNICODE, aux * 8 + 4, 0, stack) if byte == ord("u") else None
    if mode == UNICODE:
        if byte not in HEX:
            return None
        is_key, left = divmod(aux, 8)
        return (STRING, is_key, 0, stack) if left == 1 else (UNICODE, aux - 1, 0, stack)
    if mode in NUMBER_MOVES:
        following = NUMBER_MOVES[mode].get(BYTE_CLASS.get(byte, ""))
        if following is not None:
            return (following, 0, 0, stack)
        return feed((AFTER_VALUE, 0, 0, stack), byte) if mode in NUMBER_ENDS else None
    if mode == LITERAL:
        word, at = divmod(aux, 8)
        if byte != LITERALS[word][at]:
            return None
        return (AFTER_VALUE, 0, 0, stack) if at + 1 == len(LITERALS[word]) else (LITERAL, aux + 1, 0, stack)
    if mode == DONE:
        return None
    if byte in WHITESPACE and mode != START:  # the object comes first, as OpenAI's JSON mode writes it
        return (mode, aux, spaces + 1, stack) if spaces < MAX_SPACES else None
    return _structural(mode, stack, byte)


def _structural(mode: int, stack: tuple, byte: int) -> tuple | None:
    """A byte other than whitespace where the grammar expects punctuation or a value."""
    if mode == START:
        return (OBJECT_OPEN, 0, 0, ("o",)) if byte == ord("{") else None
    if mode in (OBJECT_OPEN, KEY_NEXT) and byte == QUOTE:
        return (STRING, 1, 0, stack)
    if mode == OBJECT_OPEN and byte == ord("}") or mode == ARRAY_OPEN and byte == ord("]"):
        return _closed(stack)
    if mode == COLON:
        return (VALUE, 0, 0, stack) if byte == ord(":") else None
    if mode in (VALUE, ARRAY_OPEN):
        return _value_start(stack, byte)
    if mode == AFTER_VALUE:
        top = stack[-1]
        if byte == ord(","):
            return (KEY_NEXT if top == "o" else VALUE, 0, 0, stack)
        if byte == (ord("}") if top == "o" else ord("]")):
            return _closed(stack)
    return None


def _value_start(stack: tuple, byte: int) -> tuple | None:
    if byte == ord("{"):
        return (OBJECT_OPEN, 0, 0, stack + ("o",))
    if byte == ord("["):
        return (ARRAY_OPEN, 0, 0, stack + ("a",))
    if byte == QUOTE:
        return (STRING, 0, 0, stack)
    if byte == ord("-"):
        return (MINUS, 0, 0, stack)
    if byte in DIGITS:
        return (ZERO if byte == ord("0") else INTEGER, 0, 0, stack)
    for word, literal in enumerate(LITERALS):
        if byte == literal[0]:
            return (LITERAL, word * 8 + 1, 0, stack)
    return None


def _closed(stack: tuple) -> tuple:
    """The state once the innermost container closes: the object is whole when it was the outermost."""
    return (DONE, 0, 0, ()) if len(stack) == 1 else (AFTER_VALUE, 0, 0, stack[:-1])


def feed_bytes(state: tuple | None, data: bytes) -> tuple | None:
    for byte in data:
        if state is None:
            return None
        state = feed(state, byte)
    return state


def complete(state: tuple | None) -> bool:
    return state is not None and state[0] == DONE


# ---- the vocabulary as bytes ---------------------------------------------------------------------------------------

def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte -> the byte (GPT-2's scheme: printable bytes stand for
    themselves, the others are shifted past 255 in order)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = iter(range(256, 512))
    return {chr(b if b in printable else next(shifted)): b for b in range(256)}


def token_pieces(tokenizer, size: int) -> list[bytes | None]:
    """Each token id's bytes, None for special tokens and ids past the tokenizer; raises UserError for a tokenizer
    whose tokens are not byte-level BPE or SentencePiece pieces (their bytes are not known exactly)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = json.loads(backend.to_str()).get("decoder") if backend is not None else None
    kinds = {part["type"] for part in (decoder.get("decoders", [decoder]) if decoder else [])}
    alphabet = byte_level_alphabet() if "ByteLevel" in kinds else None
    if alphabet is None and not {"Replace", "ByteFallback"} & kinds:
        raise UserError("JSON output needs a byte-level BPE or SentencePiece tokenizer; this target's decoder is "
                        f"{sorted(kinds) or 'none'}")
    added = tokenizer.added_tokens_decoder
    pieces: list[bytes | None] = [None] * size
    for token, index in tokenizer.get_vocab().items():
        if index >= size:
            continue
        if index in added:
            pieces[index] = None if added[index].special else added[index].content.encode()
        elif alphabet is not None:
            pieces[index] = bytes(alphabet[c] for c in token) if all(c in alphabet for c in token) else None
        elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            pieces[index] = bytes([int(token[3:5], 16)])
        else:
            pieces[index] = token.replace("\u2581", " ").encode()
    return [piece or None for piece in pieces]


def _plain_text(piece: bytes) -> bool:
    """Whole characters that a JSON string takes as they are: from a string's state back to the same state."""
    if any(b < 0x20 or b in b'"\\' for b in piece):
        return False
    try:
        piece.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _after_prefix(prefix: bytes) -> bytes | None:
    """The least byte string above every string that starts with `prefix` (None: there is none)."""
    stem = prefix.rstrip(b"\xff")
    return stem[:-1] + bytes([stem[-1] + 1]) if stem else None


class JsonVocabulary:
    """A target's vocabulary as bytes, sorted for pruned walks, and the masks of the states met so far."""

    def __init__(self, pieces: list[bytes | None]):
        self.pieces, self.size = pieces, len(pieces)
        plain = [i for i, p in enumerate(pieces) if p is not None and _plain_text(p)]
        self.plain_in_string = torch.zeros(self.size, dtype=torch.bool)
        self.plain_in_string[plain] = True
        everything = sorted((p, i) for i, p in enumerate(pieces) if p is not None)
        self.all_keys, self.all_ids = [p for p, _ in everything], [i for _, i in everything]
        plain_set = set(plain)
        self.special_keys = [p for p, i in everything if i not in plain_set]
        self.special_ids = [i for p, i in everything if i not in plain_set]
        self.masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.max_masks = max(16, MASK_CACHE_BYTES // max(1, self.size))

    def advance(self, state: tuple | None, token: int) -> tuple | None:
        if state is None or token >= self.size or self.pieces[token] is None:
            return None
        return feed_bytes(state, self.pieces[token])

    def allowed(self, state: tuple) -> torch.Tensor:
        """Bool [vocab]: the tokens that keep the output a prefix of a JSON object after `state` (none when the
        object is whole: ending is the caller's, with its stop tokens)."""
        mask = self.masks.get(state)
        if mask is not None:
            self.masks.move_to_end(state)
            return mask
        if state[0] == STRING:  # plain characters keep a string going; only the others need a walk
            mask = self.plain_in_string.clone()
            mask[self._walk(state, self.special_keys, self.special_ids)] = True
        else:
            mask = torch.zeros(self.size, dtype=torch.bool)
            mask[self._walk(state, self.all_keys, self.all_ids)] = True
        self.masks[state] = mask
        if len(self.masks) > self.max_masks:
            self.masks.popitem(last=False)
        return mask

    @staticmethod
    def _walk(state: tuple, keys: list[bytes], ids: list[int]) -> list[int]:
        """The ids whose bytes the grammar takes from `state`: keys sorted, each fed from the state of the prefix
        it shares with the key before; a refused prefix skips every key that starts with it."""
        allowed, path, previous, i = [], [state], b"", 0
        while i < len(keys):
            key = keys[i]
            shared, limit = 0, min(len(previous), len(key), len(path) - 1)
            while shared < limit and previous[shared] == key[shared]:
                shared += 1
            del path[shared + 1:]
            current = path[-1]
            for byte in key[shared:]:
                current = feed(current, byte)
                if current is None:
                    break
                path.append(current)
            previous = key
            if current is None:
                after = _after_prefix(key[: len(path)])
                i = len(keys) if after is None else bisect.bisect_left(keys, after, i + 1)
                continue
            allowed.append(ids[i])
            i += 1
        return allowed


@functools.lru_cache(maxsize=4)
def json_vocabulary(tokenizer, size: int) -> JsonVocabulary:
    return JsonVocabulary(token_pieces(tokenizer, size))


class JsonConstraint:
    """One generation's grammar state: the state after its committed output (advanced as the output grows) and the
    mask at any position after it."""

    def __init__(self, vocabulary: JsonVocabulary, stop_ids: set[int]):
        if not stop_ids:
            raise UserError("JSON output needs an end-of-sequence token to end on (it cannot run with ignore_eos)")
        self.vocabulary = vocabulary
        self.stop_ids = {i for i in stop_ids if i < vocabulary.size}
        self.state, self.seen = START_STATE, 0
        self.done_mask = torch.zeros(vocabulary.size, dtype=torch.bool)
        self.done_mask[sorted(self.stop_ids)] = True

    def commit(self, output: list[int]) -> None:
        """Fold newly committed output tokens into the state (a stop token ends the output and changes nothing)."""
        for token in output[self.seen:]:
            if token in self.stop_ids:
                continue
            advanced = self.vocabulary.advance(self.state, token)
            if advanced is None:
                raise AssertionError(f"token {token} was committed against the JSON grammar")
            self.state = advanced
        self.seen = len(output)

    def mask(self, output: list[int], past: list[int]) -> torch.Tensor:
        """Bool [vocab] of the tokens allowed after the committed `output` and then `past` (a block's drafts before
        the position): the grammar's, or the stop tokens once the object is whole."""
        self.commit(output)
        state = self.state
        for token in past:
            state = self.vocabulary.advance(state, token)
            if state is None:  # a refused draft before this position: nothing here is ever read
                return self.done_mask
        return self.done_mask if state[0] == DONE else self.vocabulary.allowed(state)


def validate_format(response_format: str | None) -> None:
    if response_format is not None and response_format not in RESPONSE_FORMATS:
        raise UserError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}")
