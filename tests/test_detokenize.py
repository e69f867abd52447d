"""GrowingText (detokenize.py): the text of a growing token list, decoding only its end, always equal to decoding
the whole list."""

import random

import pytest

from dflash.detokenize import SETTLE_EVERY, GrowingText, byte_tokens
from dflash.testing import tiny_byte_tokenizer, tiny_tokenizer


def sentencepiece_tokenizer():
    """Llama 2's and Gemma's kind of decoder: "▁" for a space, bytes for what the pieces lack (a character may take
    several tokens), and the text's first space stripped."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<eos>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁a", "▁the", "b", "c", "▁.", ".", "\n", "▁n't", "é", "▁▁"]
    core = Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True, unk_token="<unk>"))
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>")


TOKENIZERS = {"words": lambda: tiny_tokenizer(64), "bytes": lambda: tiny_byte_tokenizer(320),
              "sentencepiece": sentencepiece_tokenizer}


def utf8_heavy_ids(tokenizer, rng: random.Random, count: int) -> list[int]:
    """Random tokens, half of them whole multi-byte characters spelled a byte at a time where the vocabulary has
    byte tokens (so the settled point often falls inside a character), and some raw bytes that never make one."""
    ids = []
    vocab = len(tokenizer)
    while len(ids) < count:
        if rng.random() < 0.5:
            ids += tokenizer.encode(rng.choice(["é", "日本", "€ ", " 🙂", "\n", " the.", "n't"]),
                                    add_special_tokens=False)
        else:
            ids.append(rng.randrange(vocab))
    return ids


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("kind", sorted(TOKENIZERS))
def test_growing_text_equals_decoding_the_whole_list(kind, skip):
    """Random tokens, special ones among them, kept or left out of the text (skip_special_tokens)."""
    tokenizer = TOKENIZERS[kind]()

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=skip)

    rng = random.Random(f"{kind}{skip}")
    for trial in range(3):
        ids = utf8_heavy_ids(tokenizer, rng, 600)
        text, length, calls = GrowingText(decode, byte_tokens(tokenizer)), 0, 0
        while length < len(ids):
            length += rng.randint(1, 6)
            assert text(ids[:length]) == decode(ids[:length]), (kind, trial, length)
            calls += 1
            if rng.random() < 0.1:  # another branch: a shorter list, or the same list with another last token
                shorter = rng.randint(1, length)
                assert text(ids[:shorter]) == decode(ids[:shorter])
                other = ids[: length - 1] + [rng.randrange(len(tokenizer))]
                assert text(other) == decode(other)
        assert text.settled, "the settled point never moved: every call decoded the whole list"


def test_growing_text_decodes_only_the_end():
    tokenizer = tiny_byte_tokenizer(320)
    decoded = []

    def decode(ids):
        decoded.append(len(ids))
        return tokenizer.decode(ids)

    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)
    assert len(ids) > 1000
    text = GrowingText(decode)
    for length in range(1, len(ids) + 1):
        text(ids[:length])
    whole = len(ids) * (len(ids) + 1) // 2  # what decoding the whole list at every call costs
    assert sum(decoded) < whole / 8
    moves = len(ids) // SETTLE_EVERY
    assert sum(decoded) < 3 * sum(range(SETTLE_EVERY, len(ids) + 1, SETTLE_EVERY)) + len(ids) * (SETTLE_EVERY + 9) \
        and moves >= 15


def test_byte_tokens_are_found_only_where_the_vocabulary_has_them():
    assert len(byte_tokens(sentencepiece_tokenizer())) == 256
    assert byte_tokens(tiny_byte_tokenizer(320)) == frozenset()  # byte-level BPE spells bytes as characters


@pytest.mark.real_model
def test_growing_text_on_the_real_tokenizer():
    """SmolLM2's tokenizer, on real text (code, a table of emoji, another script) and on random tokens."""
    from transformers import AutoTokenizer

    from dflash.hub import resolve_registry_folder

    tokenizer = AutoTokenizer.from_pretrained(resolve_registry_folder("smollm2-135m"))
    rng = random.Random(0)
    text = "def f(x):\n    return x ** 2  # squares\n\n| a | b |\n|---|---|\n| 🙂 | 日本語 |\n" * 20
    for ids in (tokenizer.encode(text), utf8_heavy_ids(tokenizer, rng, 800)):
        growing = GrowingText(tokenizer.decode, byte_tokens(tokenizer))
        length = 0
        while length < len(ids):
            length += rng.randint(1, 6)
            assert growing(ids[:length]) == tokenizer.decode(ids[:length]), length
        assert growing.settled


def test_a_decoder_that_rewrites_the_settled_text_is_caught_at_the_next_move():
    """Outside what GrowingText assumes (a token's rendering depends only on its near neighbours): here one token
    upper-cases the whole text. The answers between two moves may be stale, but the next move finds the kept text
    wrong, starts over, and every answer after it is exact again."""

    def decode(ids):
        text = " ".join(f"w{i}" for i in ids)
        return text.upper() if 0 in ids else text

    ids = list(range(1, 200)) + [0] + list(range(1, 200))
    text = GrowingText(decode)
    for length in range(1, 2 * SETTLE_EVERY):
        assert text(ids[:length]) == decode(ids[:length])
    assert text.settled
    first_move = next(length for length in range(201, len(ids)) if length >= text.next_move)
    for length in range(200, len(ids) + 1):
        answer = text(ids[:length])
        if length >= first_move:
            assert answer == decode(ids[:length]), length
