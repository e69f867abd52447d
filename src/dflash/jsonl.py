"""Reading user-given JSONL files with errors that name the file and line, and the prompts in their rows."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .errors import UserError

# Layouts a row's prompt may come in, in the order they are tried (named in errors and --help)
PROMPT_LAYOUTS = ("'turns' (a list of strings)", "'messages' (OpenAI chat)", "'conversations' (ShareGPT)",
                  "'prompt'", "'instruction' (with 'input', Alpaca)", "'question'", "'problem'", "'query'")
USER_ROLES = ("user", "human")  # ShareGPT's name and OpenAI's
ROLE_NAMES = {"human": "user", "gpt": "assistant", "developer": "system"}  # other names -> OpenAI chat's


def iter_jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) for every non-blank line; a bad line is a UserError naming path:line."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{line_no} is not valid JSON ({exc.msg})") from exc
            yield line_no, row


@dataclass
class PromptRow:
    turns: list[str]  # the user's messages in order; the model answers each itself before the next
    system: str | None = None  # a system message to open the conversation with, where the row has one


def prompt_of(row) -> PromptRow | None:
    """A row's prompt in whichever common layout it has (PROMPT_LAYOUTS, first match wins), or None. In a chat
    (`messages`, `conversations`) the user's turns are kept and the assistant's dropped: a benchmark has the method
    answer each turn itself, and regeneration asks the target for the answers."""
    if not isinstance(row, dict):
        return None
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(_text(t) for t in turns):
        return PromptRow(list(turns))
    for key in ("messages", "conversations", "prompt"):  # 'prompt' may hold a chat too
        if isinstance(row.get(key), list):
            return _chat(row[key])
    if _text(row.get("prompt")):
        return PromptRow([row["prompt"]])
    if _text(row.get("instruction")):
        extra = row.get("input")
        return PromptRow([row["instruction"] + (f"\n\n{extra}" if _text(extra) else "")])
    text = next((row[key] for key in ("question", "problem", "query") if _text(row.get(key))), None)
    return PromptRow([text]) if text is not None else None


def conversation_of(row) -> list[dict] | None:
    """A row as the conversation to answer next, in {"role", "content"} messages: a chat (`messages`,
    `conversations`) up to its last user turn, earlier assistant turns included (a finished chat's last answer is
    the one asked for again); any other layout its one prompt, after its system message. None for a row with no
    prompt, a chat without a user turn, or `turns` of several (each later turn follows an answer not yet given:
    `dflash bench` runs those)."""
    chat = next((row[key] for key in ("messages", "conversations", "prompt")
                 if isinstance(row, dict) and isinstance(row.get(key), list)), None)
    if chat is not None:
        if _chat(chat) is None:
            return None
        messages = [{"role": role, "content": text} for role, text in map(_message, chat)
                    if role in ("system", "user", "assistant") and text]
        while messages[-1]["role"] != "user":  # a finished chat: its last answer is the one to give again
            messages.pop()
        return messages
    found = prompt_of(row)
    if found is None or len(found.turns) > 1:
        return None
    opening = [{"role": "system", "content": found.system}] if found.system else []
    return opening + [{"role": "user", "content": found.turns[0]}]


def openai_role(role):
    """A message's role by its OpenAI chat name: ShareGPT's `human` and `gpt`, and OpenAI's newer `developer` for the
    system message, which chat templates do not know (SmolLM2's rendered a `developer` turn after its own default
    system message)"""
    return ROLE_NAMES.get(role, role)


def layouts_hint() -> str:
    return "a prompt in one of the fields " + ", ".join(PROMPT_LAYOUTS)


def _chat(messages: list) -> PromptRow | None:
    """The user turns and first system message of an OpenAI (`role`/`content`) or ShareGPT (`from`/`value`) chat;
    None when it has no user turn or a message is not one of these."""
    turns, system = [], None
    for message in messages:
        if not isinstance(message, dict):
            return None
        role, text = _message(message)
        if role == "user" and text:
            turns.append(text)
        elif role == "system" and text and system is None and not turns:
            system = text
    return PromptRow(turns, system) if turns else None


def _message(message) -> tuple[str | None, str | None]:
    """(role by its OpenAI name, text) of an OpenAI (`role`/`content`) or ShareGPT (`from`/`value`) message"""
    if not isinstance(message, dict):
        return None, None
    return openai_role(message.get("role", message.get("from"))), _content(message.get("content", message.get("value")))


def _content(content) -> str | None:
    """A message's text: a string, or OpenAI's list of parts, of which the text parts joined"""
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content if _text(content) else None


def _text(value) -> bool:
    return isinstance(value, str) and bool(value.strip())
