"""Structured output: every generated text a JSON object (OpenAI's `response_format` `json_object`), or one that a
JSON Schema allows (`json_schema`), or either free text or such a document where the text starts like one
(`json_schema_or_text`: a reply that may call tools, tools.py), or text that a regular expression matches whole
(`regex`, regex_grammar.py: vLLM's structured outputs `regex` and `choice`).

At every position the target picks its token among those that keep the output a prefix of a valid document
(grammar.py), and may end only once the document is whole. The mask is applied to the target's logits where
penalties are (sampling.py): at each position of a verify block from the state the tokens before it leave (the
committed output, then the block's drafts up to it). A draft the grammar refuses is simply never the target's pick,
so speculation stays lossless with respect to constrained decoding of the target alone: greedy tokens are
identical, seeded samples too. Greedy rows keep the LM head's screen (engine._grammar_checked): where the
unconstrained argmax is allowed it is the constrained one.

The grammar runs on bytes, as byte-level tokenizers cut text: a token may hold a closing quote and the comma after
it, or half of a UTF-8 character inside a string. A state's mask over the whole vocabulary walks the vocabulary
sorted as bytes, so a prefix the grammar refuses is skipped with every token that starts with it (a trie walk
without the trie), and inside a string the tokens of plain characters, most of the vocabulary, are allowed at once.
Masks are kept per grammar and state: a generation meets few distinct states (in a string, after a key, after a
value, at each nesting). SmolLM2's 49,152 tokens: a new state's mask in ~1.5-2 ms (median) on one core
(scripts/grammar_masks.py).
"""

from __future__ import annotations

import bisect
import functools
import json
from collections import OrderedDict

import torch

from .ebnf import grammar_format, rules_grammar
from .errors import UserError
from .grammar import JSON_OBJECT, START_STATE, STRING, TEXT, Frame, JsonGrammar, compile_schema
from .logprobs import BYTE_TOKEN, byte_level_alphabet
from .regex_grammar import PatternGrammar, pattern_format, pattern_grammar
from .structural_tags import structural_tag_format, tag_grammar

# "json_schema_framed": documents between tags (a chat template's tool calls, tools.py), its json_schema
# {"schema": ..., "frame": Frame's fields as text}
# "regex": the whole output matches json_schema["regex"] (regex_grammar.py: vLLM's structured outputs regex, choice)
# "grammar": the whole output is one that json_schema["grammar"] (EBNF) allows (ebnf.py: vLLM's structured outputs
# grammar)
# "structural_tag": free text with JSON documents between tags its triggers open (structural_tags.py: vLLM's and
# SGLang's structural_tag), its json_schema {"structures": [...], "triggers": [...]}
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "json_schema_or_text", "json_schema_framed", "structural_tag",
                    "regex", "grammar")
MASK_CACHE_BYTES = 64 << 20  # masks kept per vocabulary, as bool tensors
# ASCII tokens up to this long go through a grammar's table at once (_tabled), a byte position a time; the longer
# ones, few (SmolLM2: 154 of 49,152 past 16 bytes, mostly runs of spaces), are walked with the rest
TABLED_BYTES = 16
# the table pays where more than 1 / TABLE_SHARE of those tokens go on past their first byte (a prefix the grammar
# refuses skips its tokens in a walk: SmolLM2, a new state's mask walked 0.7 ms against 2.4 tabled after a choice's
# first bytes, 59 ms against 3.0 in a regex of words; scripts/grammar_masks.py)
TABLE_SHARE = 16
FORCED_BYTES = 64  # the longest run of forced bytes drafted at once
FORCED_STATES = 4096  # forced runs kept per vocabulary


# ---- the vocabulary as bytes ---------------------------------------------------------------------------------------

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
        elif match := BYTE_TOKEN.fullmatch(token):
            pieces[index] = bytes([int(match.group(1), 16)])
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
    """A target's vocabulary as bytes, sorted for pruned walks, and the masks of the (grammar, state) pairs met so
    far (MASK_CACHE_BYTES of them, least recently used out first)."""

    def __init__(self, pieces: list[bytes | None]):
        self.pieces, self.size = pieces, len(pieces)
        plain = [i for i, p in enumerate(pieces) if p is not None and _plain_text(p)]
        self.plain_in_string = torch.zeros(self.size, dtype=torch.bool)
        self.plain_in_string[plain] = True
        self.plain_characters = torch.zeros(self.size, dtype=torch.int32)  # a plain token's characters (maxLength)
        self.plain_characters[plain] = torch.tensor([len(pieces[i].decode()) for i in plain], dtype=torch.int32)
        everything = sorted((p, i) for i, p in enumerate(pieces) if p is not None)
        self.all_keys, self.all_ids = [p for p, _ in everything], [i for _, i in everything]
        plain_set = set(plain)
        self.special_keys = [p for p, i in everything if i not in plain_set]
        self.special_ids = [i for p, i in everything if i not in plain_set]
        self.masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.max_masks = max(16, MASK_CACHE_BYTES // max(1, self.size))
        self.by_bytes: dict[bytes, int] = {}
        for piece, token in zip(self.all_keys, self.all_ids):
            self.by_bytes.setdefault(piece, token)
        self.longest = max(map(len, self.all_keys), default=0)
        self.forced_runs: dict[tuple, list[int]] = {}
        self.holding: dict[bytes, list[int]] = {}  # bytes -> the sorted positions of the tokens that hold one
        self.crossing: dict[bytes, tuple[list, list]] = {}  # closers -> the tokens that hold one before their end
        self.bytes_unknown = [i for i, piece in enumerate(pieces) if piece is None]  # special tokens
        self.ascii_split = None  # the tokens of ASCII bytes laid out for tables (_ascii_split), made at first use
        self.plain_split = None  # those of plain ASCII characters, for held strings' tables

    def advance(self, grammar: JsonGrammar, state: tuple | None, token: int) -> tuple | None:
        if state is None:
            return None
        if state[0] == TEXT:  # free text takes any token, special ones too
            return state
        if token >= self.size or self.pieces[token] is None:  # a special token: text in free text only
            return grammar.after_special(state)
        return grammar.feed_bytes(state, self.pieces[token])

    def allowed(self, grammar: JsonGrammar, state: tuple) -> torch.Tensor:
        """Bool [vocab]: the tokens that keep the output a prefix of a valid document after `state` (none once the
        document is whole: ending is the caller's, with its stop tokens)."""
        key = (grammar.key, state)
        mask = self.masks.get(key)
        if mask is not None:
            self.masks.move_to_end(key)
            return mask
        if state == START_STATE and grammar.text_otherwise:  # free text unless a token opens the document
            return self._kept(key, self._text_or_document(grammar))
        if grammar.free_text_tag(state) is not None:
            return self._kept(key, self._free_text(grammar, state))
        if grammar.delegate(state) is not None:
            return self._kept(key, self._delegated(grammar, state))
        if (nested := getattr(grammar, "nested", None)) is not None and (inside := nested(state)) is not None:
            return self._kept(key, self._nested(grammar, state, *inside))
        if state[0] == STRING:  # plain characters keep a string going; only the others need a walk
            mask = self.plain_in_string.clone()
            if state[1] not in (0, 1):  # a checked string
                at, count, states = state[1]
                if states is not None:  # a pattern: its plain characters through a table where it has one
                    return self._kept(key, self._held(grammar, state))
                if grammar.nodes[at].max_length is not None:  # the plain tokens that fit what is left
                    mask &= self.plain_characters <= grammar.nodes[at].max_length - count
            mask[self._walk(grammar, state, self.special_keys, self.special_ids)] = True
        elif (tabled := self._tabled(grammar, state)) is not None:
            mask = tabled
        else:
            mask = torch.zeros(self.size, dtype=torch.bool)
            mask[self._walk(grammar, state, self.all_keys, self.all_ids)] = True
            if grammar.after_special(state) is not None:  # where the output may still open its thinking
                mask[self.bytes_unknown] = True
        return self._kept(key, mask)

    def _tabled(self, grammar, state: tuple) -> torch.Tensor | None:
        """The mask of a state whose grammar tables its ASCII moves (regex_grammar.PatternGrammar.ascii_table): the
        tokens of ASCII bytes run through the table all at once, a byte position at a time, the others walked; None
        where the grammar has no such table."""
        found = grammar.ascii_table(state)
        if found is None:
            return None
        if self.ascii_split is None:
            self.ascii_split = _ascii_split(self.all_keys, self.all_ids, lambda key: key.isascii())
        return self._through_table(grammar, state, *found, self.ascii_split)

    def _held(self, grammar: JsonGrammar, state: tuple) -> torch.Tensor:
        """The mask of a state inside a held string (a pattern's, a format's, a grammar's): the tokens of plain
        ASCII characters through the string's table (JsonGrammar.held_table), the others (a quote, an escape, other
        characters) walked; every token walked where there is no table."""
        found = grammar.held_table(state)
        if found is not None:
            if self.plain_split is None:
                self.plain_split = _ascii_split(self.all_keys, self.all_ids, _plain_ascii)
            mask = self._through_table(grammar, state, *found, self.plain_split)
            if mask is not None:
                return mask
        mask = torch.zeros(self.size, dtype=torch.bool)
        mask[self._walk(grammar, state, self.all_keys, self.all_ids)] = True
        return mask

    def _through_table(self, grammar, state: tuple, table: torch.Tensor, row: int, split) -> torch.Tensor | None:
        """The mask of `state` with the tokens of `split` (_ascii_split's) run through `table` from `row` all at
        once, a byte position at a time, the others walked; None where a walk would be cheaper."""
        ids, columns, counts, other_keys, other_ids = split
        if int(table[row, columns[0]].count_nonzero()) * TABLE_SHARE < len(ids):
            return None  # few tokens go on past their first byte: a walk skips the rest sooner
        current = torch.full((len(ids),), row, dtype=torch.long)
        for column, count in zip(columns, counts):  # tokens longest first: those this long are a prefix
            current[:count] = table[current[:count], column]
        mask = torch.zeros(self.size, dtype=torch.bool)
        mask[ids[current != 0]] = True
        mask[self._walk(grammar, state, other_keys, other_ids)] = True
        return mask

    def _text_or_document(self, grammar: JsonGrammar) -> torch.Tensor:
        """The first mask of a grammar with free text otherwise: every token, but of those whose first byte could open
        the document (each byte's tokens a run of the sorted vocabulary) only the ones the document takes."""
        mask = torch.zeros(self.size, dtype=torch.bool)
        mask[self.all_ids] = True
        for opener in sorted(grammar.nodes[grammar.root].first_bytes(grammar.nodes)):
            low = bisect.bisect_left(self.all_keys, bytes([opener]))
            high = bisect.bisect_left(self.all_keys, bytes([opener + 1]))
            mask[self.all_ids[low:high]] = False
            mask[self._walk(grammar, START_STATE, self.all_keys[low:high], self.all_ids[low:high])] = True
        return mask

    def _free_text(self, grammar: JsonGrammar, state: tuple) -> torch.Tensor:
        """The mask of free text that a tag ends (a framed grammar's words, a reasoning model's thinking; or one of
        several tags: structural tags' triggers): every token, but of those that could complete a tag (the ones
        holding its last byte) only the ones whose bytes after it the grammar takes."""
        tags = grammar.free_text_tag(state)
        mask = torch.ones(self.size, dtype=torch.bool)
        keys, ids = self._holding(bytes(sorted({tag[-1] for tag in ([tags] if isinstance(tags, bytes) else tags)})))
        mask[ids] = False
        mask[self._walk(grammar, state, keys, ids)] = True
        return mask

    def _holding(self, some: bytes) -> tuple[list[bytes], list[int]]:
        """The tokens that hold any of the bytes `some`, sorted (for _walk): their keys and ids."""
        if some not in self.holding:
            self.holding[some] = [k for k, piece in enumerate(self.all_keys) if any(b in piece for b in some)]
        return [self.all_keys[k] for k in self.holding[some]], [self.all_ids[k] for k in self.holding[some]]

    def _nested(self, grammar, state: tuple, inner, inner_state: tuple, closers: bytes) -> torch.Tensor:
        """The mask of a state inside a document of its own grammar (structural_tags.TagGrammar.nested): the inner
        grammar's mask, but the tokens that hold a closing byte before their last (they may close the document and
        go on after it) walked from the state."""
        mask = self.allowed(inner, inner_state).clone()
        if closers not in self.crossing:
            keys, ids = self._holding(closers)
            crossing = [k for k, key in enumerate(keys) if any(b in key[:-1] for b in closers)]
            self.crossing[closers] = [keys[k] for k in crossing], [ids[k] for k in crossing]
        keys, ids = self.crossing[closers]
        mask[ids] = False
        mask[self._walk(grammar, state, keys, ids)] = True
        return mask

    def _delegated(self, grammar: JsonGrammar, state: tuple) -> torch.Tensor:
        """The mask of a state that reads all first bytes but a few as another state does (JsonGrammar.delegate): the
        other's, but the tokens that open with those bytes (each byte's tokens a run of the sorted vocabulary) walked
        from the state."""
        other, few = grammar.delegate(state)
        mask = self.allowed(grammar, other).clone() if other is not None else torch.zeros(self.size, dtype=torch.bool)
        for byte in few:
            low = bisect.bisect_left(self.all_keys, bytes([byte]))
            high = bisect.bisect_left(self.all_keys, bytes([byte + 1]))
            mask[self.all_ids[low:high]] = False
            mask[self._walk(grammar, state, self.all_keys[low:high], self.all_ids[low:high])] = True
        return mask

    def _kept(self, key: tuple, mask: torch.Tensor) -> torch.Tensor:
        self.masks[key] = mask
        if len(self.masks) > self.max_masks:
            self.masks.popitem(last=False)
        return mask

    def forced(self, grammar: JsonGrammar, state: tuple) -> list[int]:
        """Tokens for the bytes the grammar forces after `state` (each the only byte it allows: a key's name once its
        quote is open, where the schema leaves one), cut greedily into the longest tokens inside them; [] where the
        next byte is free."""
        key = (grammar.key, state)
        tokens = self.forced_runs.get(key)
        if tokens is not None:
            return tokens
        run = bytearray()
        while len(run) < FORCED_BYTES:
            only = _only_byte(grammar, state)
            if only is None:
                break
            run.append(only[0])
            state = only[1]
        tokens, at = [], 0
        while at < len(run):
            for length in range(min(self.longest, len(run) - at), 0, -1):
                token = self.by_bytes.get(bytes(run[at: at + length]))
                if token is not None:
                    tokens.append(token)
                    at += length
                    break
            else:
                break
        if len(self.forced_runs) >= FORCED_STATES:
            self.forced_runs.clear()
        self.forced_runs[key] = tokens
        return tokens

    @staticmethod
    def _walk(grammar: JsonGrammar, state: tuple, keys: list[bytes], ids: list[int]) -> list[int]:
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
                current = grammar.feed(current, byte)
                if current is None:
                    break
                path.append(current)
            previous = key
            if current is None:
                after = _after_prefix(key[: len(path)])
                i = len(keys) if after is None else bisect.bisect_left(keys, after, i + 1)
                continue
            if current[0] == TEXT:  # free text takes anything: every key that starts as this one did is allowed
                reached = next(k for k, state in enumerate(path) if state[0] == TEXT)
                after = _after_prefix(key[:reached])
                end = len(keys) if after is None else bisect.bisect_left(keys, after, i + 1)
                allowed += ids[i:end]
                i = end
                continue
            allowed.append(ids[i])
            i += 1
        return allowed


def _plain_ascii(key: bytes) -> bool:
    """Printable ASCII but `"` and `\\`: what a held string writes as itself (grammar.PLAIN_HELD)."""
    return key.isascii() and all(0x20 <= b < 0x7F and b not in b'"\\' for b in key)


def _ascii_split(keys: list[bytes], ids: list[int], tabled_key):
    """The tokens of up to TABLED_BYTES bytes that `tabled_key` takes (ASCII ones), longest first, as (their ids,
    each byte position's bytes of the tokens that reach it, how many do); and the others' keys and ids (sorted, for
    a walk)."""
    tabled = [bool(key) and len(key) <= TABLED_BYTES and tabled_key(key) for key in keys]
    ascii_tokens = sorted(((key, token) for key, token, t in zip(keys, ids, tabled) if t),
                          key=lambda pair: -len(pair[0]))
    longest = len(ascii_tokens[0][0]) if ascii_tokens else 0
    # the keys as rows of one byte matrix (padded with zeros), so each position's column is a slice
    matrix = torch.frombuffer(bytearray(b"".join(key.ljust(longest, b"\0") for key, _ in ascii_tokens)) or
                              bytearray(1), dtype=torch.uint8)[:len(ascii_tokens) * longest]
    matrix = matrix.view(len(ascii_tokens), longest).long()
    lengths = torch.tensor([len(key) for key, _ in ascii_tokens], dtype=torch.long)
    counts = [int((lengths > position).sum()) for position in range(longest)]
    columns = [matrix[:count, position].contiguous() for position, count in enumerate(counts)]
    others = [(key, token) for key, token, t in zip(keys, ids, tabled) if not t]
    return (torch.tensor([token for _, token in ascii_tokens], dtype=torch.long), columns, counts,
            [key for key, _ in others], [token for _, token in others])


def _only_byte(grammar: JsonGrammar, state: tuple) -> tuple[int, tuple] | None:
    """(the byte, the state after it) where the grammar allows one byte only after `state`, else None."""
    only = None
    for byte in range(256):
        following = grammar.feed(state, byte)
        if following is not None:
            if only is not None:
                return None
            only = (byte, following)
    return only


@functools.lru_cache(maxsize=4)
def json_vocabulary(tokenizer, size: int) -> JsonVocabulary:
    return JsonVocabulary(token_pieces(tokenizer, size))


class JsonConstraint:
    """One generation's grammar state: the state after its committed output (advanced as the output grows) and the
    mask at any position after it."""

    def __init__(self, vocabulary: JsonVocabulary, grammar: JsonGrammar, stop_ids: set[int]):
        if not stop_ids:
            raise UserError("JSON output needs an end-of-sequence token to end on (it cannot run with ignore_eos)")
        self.vocabulary, self.grammar = vocabulary, grammar
        self.stop_ids = {i for i in stop_ids if i < vocabulary.size}
        self.state, self.seen = grammar.initial, 0
        # the states along the tokens past the committed output last asked about (a block's positions come in
        # order, each one token further): chain[k] is the state after the first k of `chain_tokens`
        self.chain, self.chain_tokens = [self.state], []
        self.done_mask = torch.zeros(vocabulary.size, dtype=torch.bool)
        self.done_mask[sorted(self.stop_ids)] = True
        self.free_mask = torch.ones(vocabulary.size, dtype=torch.bool)  # free text (grammar.TEXT): any token
        self.ending: dict[tuple, torch.Tensor] = {}  # masks of states where the output may end, or may not in text

    def commit(self, output: list[int]) -> None:
        """Fold newly committed output tokens into the state (a stop token ends the output and changes nothing)."""
        for token in output[self.seen:]:
            if token in self.stop_ids:
                continue
            advanced = self.vocabulary.advance(self.grammar, self.state, token)
            if advanced is None:
                raise AssertionError(f"token {token} was committed against the grammar")
            self.state = advanced
        if self.seen != len(output):
            self.chain, self.chain_tokens = [self.state], []
        self.seen = len(output)

    def _state_after(self, past: list[int]) -> tuple | None:
        """The state after the committed output and `past`, from the chain of the last tokens asked about as far as
        they agree; None where the grammar refuses one of them."""
        shared, limit = 0, min(len(past), len(self.chain_tokens))
        while shared < limit and past[shared] == self.chain_tokens[shared]:
            shared += 1
        del self.chain[shared + 1:], self.chain_tokens[shared:]
        for token in past[shared:]:
            state = self.vocabulary.advance(self.grammar, self.chain[-1], token)
            if state is None:
                return None
            self.chain.append(state)
            self.chain_tokens.append(token)
        return self.chain[-1]

    def allowed_prefix(self, output: list[int], draft: list[int]) -> int:
        """How many of `draft`'s first tokens the grammar allows after the committed `output` (a stop token only
        once the document is whole, and nothing after it)."""
        return len(self.allowed_chain(output, [[token] for token in draft]))

    def allowed_chain(self, output: list[int], candidates: list[list[int]]) -> list[int]:
        """A chain through each position's candidate tokens (best first) after the committed `output`: at each
        position the index of the first candidate the grammar allows after those chosen before it, up to the first
        position where it allows none (a stop token only once the document is whole, and nothing after it)."""
        self.commit(output)
        state, chosen = self.state, []
        for options in candidates:
            if state[0] == TEXT:  # free text from here: every first candidate
                return chosen + [0] * (len(candidates) - len(chosen))
            for index, token in enumerate(options):
                if token in self.stop_ids:
                    if self.grammar.may_end(state):
                        return chosen + [index]
                    continue
                advanced = None if self.grammar.finished(state) else self.vocabulary.advance(self.grammar, state,
                                                                                            token)
                if advanced is not None:
                    state = advanced
                    chosen.append(index)
                    break
            else:
                return chosen
        return chosen

    def forced(self, output: list[int]) -> list[int]:
        """Tokens of the bytes the grammar forces after the committed `output` (JsonVocabulary.forced)."""
        self.commit(output)
        return [] if self.grammar.may_end(self.state) else self.vocabulary.forced(self.grammar, self.state)

    def mask(self, output: list[int], past: list[int]) -> torch.Tensor:
        """Bool [vocab] of the tokens allowed after the committed `output` and then `past` (a block's drafts before
        the position): the grammar's, or the stop tokens once the document is whole."""
        self.commit(output)
        state = self._state_after(past)
        if state is None:  # a refused draft before this position: nothing here is ever read
            return self.done_mask
        if self.grammar.finished(state) or state[0] == TEXT:
            return self.done_mask if state[0] != TEXT else self.free_mask
        ending, text = self.grammar.may_end(state), self.grammar.after_special(state) is not None
        if not ending and not text:
            return self.vocabulary.allowed(self.grammar, state)
        if state not in self.ending:  # the stop tokens (special tokens, text where any is) as the output may end
            allowed = self.vocabulary.allowed(self.grammar, state)
            self.ending[state] = allowed | self.done_mask if ending else allowed & ~self.done_mask
        return self.ending[state]


def output_grammar(response_format: str | None, json_schema: dict | None,
                   thinking: str | None = None) -> JsonGrammar | PatternGrammar | None:
    """The grammar of a GenerationConfig's response format (None: free text); UserError for a bad pairing.
    `thinking`: the output thinks first (JsonGrammar.thinking_first)."""
    grammar = _format_grammar(response_format, json_schema)
    return None if grammar is None else grammar.thinking_first(thinking)


def _format_grammar(response_format: str | None, json_schema: dict | None) -> JsonGrammar | PatternGrammar | None:
    if response_format is not None and response_format not in RESPONSE_FORMATS:
        raise UserError(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}, got {response_format!r}")
    if (response_format in RESPONSE_FORMATS[2:]) != (json_schema is not None):
        raise UserError(f"a JSON schema goes with response_format json_schema (or json_schema_or_text), and "
                        f"{response_format} needs a schema")
    if response_format == "json_object":
        return JSON_OBJECT
    if response_format == "regex":
        return pattern_grammar(json_schema["regex"])
    if response_format == "grammar":
        return rules_grammar(json_schema["grammar"])
    if response_format == "structural_tag":
        return tag_grammar(json_schema)
    if json_schema is None:
        return None
    if response_format == "json_schema_framed":
        frame = json_schema["frame"]
        return compile_schema(json_schema["schema"], frame=Frame(
            **{k: v.encode() if isinstance(v, str) else v for k, v in frame.items()}))
    return compile_schema(json_schema, text_otherwise=response_format == "json_schema_or_text")


def one_constraint(given: tuple, other: tuple | None, other_name: str) -> tuple:
    """(response_format, json_schema): `other` where it is given (vLLM's structured outputs, a regex or a choice),
    else `given` (OpenAI's response_format); both at once are refused, as each constrains the output."""
    if other is None:
        return given
    if given[0] not in (None, "text") or given[1] is not None:
        raise UserError(f"response_format and {other_name} each constrain the output: send one")
    return other


VLLM_KINDS = ("regex", "choice", "json", "json_object", "grammar", "structural_tag")


def vllm_format(structured_outputs: dict | None, guided_regex=None, guided_choice=None, guided_json=None,
                guided_grammar=None, ebnf=None, regex=None) -> tuple[str | None, dict | None] | None:
    """vLLM's structured outputs (`structured_outputs` {"regex"|"choice"|"json"|"json_object"|"grammar"|
    "structural_tag": ...}, or its older guided_regex / guided_choice / guided_json / guided_grammar; SGLang's
    `ebnf`, a grammar too, and `regex`) as
    (response_format, json_schema); None where none is given. Its other options (whitespace, fallbacks) change
    nothing here."""
    if structured_outputs is not None and not isinstance(structured_outputs, dict):
        raise UserError("structured_outputs must be an object such as {\"choice\": [...]}")
    given = dict(structured_outputs or {})
    older = [("regex", guided_regex), ("choice", guided_choice), ("json", guided_json), ("grammar", guided_grammar),
             ("ebnf", ebnf), ("regex", regex)]
    sent = [(kind, given[kind]) for kind in VLLM_KINDS if given.get(kind) not in (None, False)]
    sent += [(kind, value) for kind, value in older if value is not None]
    if not sent:
        return None
    if len(sent) > 1:
        raise UserError(f"structured outputs take one constraint, got {' and '.join(kind for kind, _ in sent)}")
    kind, value = sent[0]
    if kind in ("regex", "choice"):
        return pattern_format(value if kind == "regex" else None, value if kind == "choice" else None)
    if kind == "json_object":
        return "json_object", None
    if kind in ("grammar", "ebnf"):
        return grammar_format(value)
    if kind == "structural_tag":
        return structural_tag_format(value)
    try:
        schema = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        schema = None
    if not isinstance(schema, dict):
        raise UserError("structured outputs' json must be a JSON Schema (an object, or its JSON text)")
    return "json_schema", schema
