"""Reading user-given JSONL files with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import UserError


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
