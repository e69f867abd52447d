"""Reasoning models' thinking (`--reasoning-parser think`, or vLLM's names for the same format, `qwen3` and
`deepseek_r1`): a reply that thinks in `<think>...</think>` before it answers, returned as the message's `reasoning`
(and `reasoning_content`, the older name DeepSeek's API and many clients read) beside its `content`.

Where the thinking starts is read from the prompt (thinking_state): a template that opens it (`<think>` ends the
prompt, as DeepSeek-R1's and newer Qwen3 ones do) leaves the reply inside it from its first token; one that closed it
(Qwen3 with `enable_thinking: false` writes an empty `<think></think>`) leaves none; otherwise the reply may open it
itself. A reply whose format a grammar holds (structured output, tool calls) thinks freely first: the grammar holds
what follows `</think>` (grammar.JsonGrammar.thinking_first), as vLLM applies its grammars once the reasoning ends.
"""

from __future__ import annotations

from .errors import UserError

PARSERS = ("think", "qwen3", "deepseek_r1")  # one format, <think>...</think>, by the names vLLM gives it too
OPEN, CLOSE = "<think>", "</think>"
TAIL_TOKENS = 32  # of a prompt, decoded to see where its thinking stands: a tag and whitespace, however tokenized


def check_parser(name: str | None) -> str | None:
    if name not in (None, "none", *PARSERS):
        raise UserError(f"the reasoning parser must be one of none, {', '.join(PARSERS)}, got {name!r}")
    return None if name in (None, "none") else "think"


def thinking_of(target, prompt_ids: list[int], parser: str | None) -> str | None:
    """Where a reply to `prompt_ids` starts its thinking (thinking_state), None without a parser. Only the prompt's
    end is decoded: a long conversation's whole text would be decoded again for every request."""
    return thinking_state(target.decode(prompt_ids[-TAIL_TOKENS:])) if parser is not None else None


def thinking_state(prompt_text: str) -> str | None:
    """Where a reply's thinking stands as the prompt leaves it: "open" (the reply starts inside it), None (the
    prompt closed it: no thinking to come), "optional" (the reply may open it)."""
    tail = prompt_text.rstrip()
    if tail.endswith(OPEN):
        return "open"
    return None if tail.endswith(CLOSE) else "optional"


def split(text: str, state: str | None) -> tuple[str | None, str]:
    """(reasoning, content) of a reply: its thinking (None where it has none) and its answer after it ("" where it was
    cut short while thinking)."""
    if state is None:
        return None, text
    if state == "optional":
        if not text.lstrip().startswith(OPEN):
            return None, text
        text = text.lstrip()[len(OPEN):]
    thought, closed, answer = text.partition(CLOSE)
    return thought.strip(), answer.lstrip() if closed else ""


class ThinkingDeltas:
    """A streamed reply split into its thinking and its answer as the pieces come: `push` gives (reasoning, content)
    to send now. Held back until more text decides: the first bytes of a tag, and whitespace at the thinking's start
    and after its end (split strips them)."""

    def __init__(self, state: str | None):
        self.phase = {"open": "starting", "optional": "opening", None: "answer"}[state]
        self.pending = ""

    def push(self, piece: str) -> tuple[str, str]:
        self.pending += piece
        reasoning, content = [], []
        while self.pending:
            if self.phase == "opening":  # the reply may open its thinking
                text = self.pending.lstrip()
                if OPEN.startswith(text):
                    break  # nothing, or the tag's first bytes: wait
                self.phase = "starting" if text.startswith(OPEN) else "answer"
                self.pending = text[len(OPEN):] if self.phase == "starting" else self.pending
            elif self.phase in ("starting", "after"):  # whitespace after <think>, or after </think>
                self.pending = self.pending.lstrip()
                if self.pending:
                    self.phase = "thinking" if self.phase == "starting" else "answer"
            elif self.phase == "thinking":
                end = self.pending.find(CLOSE)
                if end >= 0:
                    reasoning.append(self.pending[:end])
                    self.pending, self.phase = self.pending[end + len(CLOSE):], "after"
                    continue
                keep = next((k for k in range(min(len(CLOSE) - 1, len(self.pending)), 0, -1)
                             if self.pending.endswith(CLOSE[:k])), 0)
                reasoning.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            else:
                content.append(self.pending)
                self.pending = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held once the reply is whole: a tag's first bytes that never completed are text."""
        held, self.pending = self.pending, ""
        if self.phase == "thinking":
            return held, ""
        return ("", "") if self.phase in ("starting", "after") else ("", held)
