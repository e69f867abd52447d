"""Training corpora on disk: what `dflash data` writes and `dflash train` reads.

Two formats of the same records {"id", "source", "category", "input_ids", "loss_start"} (input_ids = chat-templated
prompt ids + the target's response ids; loss_start = index of the first response token):

- A regeneration folder (`dflash data --out DIR`), written while the target generates and resumable after a kill:
      shard-00000.jsonl ...  one record per line (with the prompt text too)
      errors.jsonl           {"id", "error", "retryable"}: rows whose regeneration failed; retryable ones (out of
                             memory) are tried again by the next run, the others (an empty response) are final
      skipped.jsonl          {"id", "reason", ...}: duplicates, empty prompts, prompts too long
      manifest.json          settings, counts (ok + error + skipped + retry + pending == inputs) and the mix
  Every flushed group of rows is appended and fsync'ed; a torn last line (the kill landed mid-write) is cut off.

- A packed corpus (`dflash data --pack DIR --to CORPUS`): the records only, compact enough to commit with the code
  (the corpus must outlive the machine it was made on):
      corpus.json            format, counts, mix, settings, and per shard its file and record count
      tokens-00000.npz ...   ids, sources, categories (strings), loss_start (int32), lengths (int32) and every
                             input_ids concatenated (uint16 when the vocabulary fits, else int32), LZMA-compressed
"""

from __future__ import annotations

import io
import json
import lzma
import os
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from .errors import UserError

PACKED_FORMAT = "dflash-corpus-1"
RECORDS_PER_PACKED_SHARD = 5000


# ---- appendable JSONL files ---------------------------------------------------------------------------------------
def read_jsonl_tolerant(path: Path) -> list[dict]:
    """Complete lines of a file we append to; a torn last line (killed mid-write) is cut off the file for good,
    so the next append starts on a fresh line."""
    if not path.exists():
        return []
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with path.open("r+b") as f:
            f.truncate(len(complete))
    # split on "\n" only: str.splitlines() also breaks at U+2028 and friends, which json.dumps leaves raw inside
    # strings (ShareGPT text has them), and a record cut there no longer parses
    return [json.loads(line) for line in complete.decode("utf-8").split("\n") if line.strip()]


def append_lines(path: Path, rows: list[dict]) -> None:
    """One write per group, then fsync: after a crash either a group's lines are on disk or the tail is torn."""
    if not rows:
        return
    with path.open("a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        f.flush()
        os.fsync(f.fileno())


def write_json_atomic(path: Path, payload) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


class OutputDir:
    """A regeneration folder: sharded records plus errors/skipped/manifest; knows which ids are done.

    `writer` names this process's files when several processes fill one folder (`torchrun ... dflash data`):
    each appends only to its own shards (shard-r1-00000.jsonl) and errors (errors-r1.jsonl) and reads everyone's."""

    def __init__(self, path: Path, shard_size: int, writer: str = ""):
        self.path = path
        self.shard_size = shard_size
        self.prefix = f"shard-{writer}-" if writer else "shard-"
        self.errors_path = path / (f"errors-{writer}.jsonl" if writer else "errors.jsonl")
        self.skipped_path = path / "skipped.jsonl"
        self.manifest_path = path / "manifest.json"
        path.mkdir(parents=True, exist_ok=True)
        self.ok: dict[str, tuple[str, int]] = {}  # id -> (category, response tokens)
        own, records, fill = self.own_shards(), [], 0
        for shard in self.shards():
            records = read_jsonl_tolerant(shard)
            for r in records:
                self.ok[r["id"]] = (r.get("category", "chat"), len(r["input_ids"]) - r["loss_start"])
            if own and shard == own[-1]:
                fill = len(records)
        self.errors: dict[str, dict] = {}  # id -> its latest error record
        for errors in sorted(path.glob("errors*.jsonl")):
            for e in read_jsonl_tolerant(errors):
                self.errors[e["id"]] = e
        self.shard_index = max(len(own) - 1, 0)
        self.shard_fill = fill  # of this writer's last shard, which later appends go on filling

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("shard-*.jsonl"))

    def own_shards(self) -> list[Path]:
        """The shards this writer appends to: shard-NNNNN.jsonl, or shard-WRITER-NNNNN.jsonl."""
        return [s for s in self.shards() if re.fullmatch(re.escape(self.prefix) + r"\d{5}\.jsonl", s.name)]

    @property
    def final_error_ids(self) -> set[str]:
        return {i for i, e in self.errors.items() if not e.get("retryable") and i not in self.ok}

    @property
    def retry_ids(self) -> set[str]:
        return {i for i, e in self.errors.items() if e.get("retryable") and i not in self.ok}

    @property
    def done_ids(self) -> set[str]:
        """Ids a re-run skips: regenerated, or failed in a way a retry would not change."""
        return set(self.ok) | self.final_error_ids

    @property
    def response_tokens(self) -> int:
        return sum(tokens for _, tokens in self.ok.values())

    def check_settings(self, settings: dict) -> None:
        if not self.manifest_path.exists():
            return
        previous = json.loads(self.manifest_path.read_text(encoding="utf-8")).get("settings")
        if previous != settings:
            changed = sorted(k for k in settings.keys() | (previous or {}).keys()
                             if settings.get(k) != (previous or {}).get(k))
            raise UserError(f"{self.path} was built with other settings ({', '.join(changed)}); "
                            "re-run the same command to resume, or choose a new --out")

    def add_records(self, records: list[dict]) -> None:
        while records:
            if self.shard_fill >= self.shard_size:
                self.shard_index, self.shard_fill = self.shard_index + 1, 0
            room = self.shard_size - self.shard_fill
            append_lines(self.path / f"{self.prefix}{self.shard_index:05d}.jsonl", records[:room])
            self.shard_fill += len(records[:room])
            for r in records[:room]:
                self.ok[r["id"]] = (r.get("category", "chat"), len(r["input_ids"]) - r["loss_start"])
            records = records[room:]

    def add_errors(self, errors: list[dict]) -> None:
        append_lines(self.errors_path, errors)
        for e in errors:
            self.errors[e["id"]] = e

    def write_skipped(self, skipped: list[dict]) -> None:
        # derived from the inputs alone, so each run rewrites it whole instead of appending
        tmp = self.skipped_path.with_name("skipped.jsonl.tmp")
        tmp.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skipped), encoding="utf-8")
        os.replace(tmp, self.skipped_path)

    def mix(self, ids: set[str] | None = None) -> dict:
        """Sequences and response tokens per category, with their shares of all sequences."""
        chosen = [v for k, v in self.ok.items() if ids is None or k in ids]
        sequences = Counter(category for category, _ in chosen)
        tokens = Counter()
        for category, count in chosen:
            tokens[category] += count
        total = max(1, len(chosen))
        return {c: {"sequences": n, "share": round(n / total, 4), "response_tokens": tokens[c]}
                for c, n in sorted(sequences.items())}


# ---- reading records for training ---------------------------------------------------------------------------------
def read_records(path: str | Path) -> list[dict]:
    """Records {"id", "input_ids", "loss_start", ...} from a packed corpus, a regeneration folder, or one JSONL file.
    Bad files are UserErrors naming the file (and line)."""
    path = Path(path)
    if (path / "corpus.json").is_file():
        return read_packed(path)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(path.glob("shard-*.jsonl")) or sorted(path.glob("*.jsonl"))
        if not files:
            raise UserError(f"no corpus.json and no shard-*.jsonl files in {path}")
    else:
        raise UserError(f"training data not found: {path}")
    records = []
    for file in files:
        with open(file, encoding="utf-8") as handle:
            for line_no, line in enumerate(handle, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line) | {"_where": f"{file}:{line_no}"})
                    except json.JSONDecodeError as exc:
                        raise UserError(f"{file}:{line_no}: not a training record (JSONDecodeError: {exc})") from exc
    return records


# ---- the packed format ----------------------------------------------------------------------------------------------
def pack(records: list[dict], dest: Path, info: dict, vocab_size: int) -> dict:
    """Write `records` as a packed corpus in `dest` (atomically per file); returns the corpus.json written."""
    dest.mkdir(parents=True, exist_ok=True)
    token_dtype = np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    shards = []
    for start in range(0, len(records), RECORDS_PER_PACKED_SHARD):
        chunk = records[start: start + RECORDS_PER_PACKED_SHARD]
        name = f"tokens-{len(shards):05d}.npz"
        arrays = {
            "ids": np.array([r["id"] for r in chunk]),
            "sources": np.array([r.get("source", "") for r in chunk]),
            "categories": np.array([r.get("category", "chat") for r in chunk]),
            "loss_start": np.array([r["loss_start"] for r in chunk], dtype=np.int32),
            "lengths": np.array([len(r["input_ids"]) for r in chunk], dtype=np.int32),
            "tokens": np.concatenate([np.asarray(r["input_ids"], dtype=token_dtype) for r in chunk]),
        }
        buffer = io.BytesIO()
        np.savez(buffer, **arrays)
        tmp = dest / f".{name}.tmp"
        tmp.write_bytes(lzma.compress(buffer.getvalue(), preset=9 | lzma.PRESET_EXTREME))
        os.replace(tmp, dest / name)
        shards.append({"file": name, "records": len(chunk)})
    response_tokens = sum(len(r["input_ids"]) - r["loss_start"] for r in records)
    manifest = {"format": PACKED_FORMAT, "records": len(records), "response_tokens": response_tokens,
                "token_dtype": np.dtype(token_dtype).name, "shards": shards, **info}
    write_json_atomic(dest / "corpus.json", manifest)
    return manifest


def read_packed(path: Path) -> list[dict]:
    try:
        manifest = json.loads((path / "corpus.json").read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{path / 'corpus.json'} is not valid JSON: {exc}") from exc
    if manifest.get("format") != PACKED_FORMAT:
        raise UserError(f"{path / 'corpus.json'} is not a {PACKED_FORMAT} corpus")
    records = []
    for shard in manifest["shards"]:
        file = path / shard["file"]
        try:
            with np.load(io.BytesIO(lzma.decompress(file.read_bytes()))) as npz:
                # each lookup in an NpzFile re-reads its array from the zip: read every array once (per record it
                # was 77K reads, ~60 s of every training run's start)
                arrays = {name: npz[name] for name in npz.files}
        except (OSError, lzma.LZMAError, ValueError, zipfile.BadZipFile) as exc:
            raise UserError(f"{file} is missing or corrupt ({exc.__class__.__name__})") from exc
        missing = {"ids", "sources", "categories", "loss_start", "lengths", "tokens"} - arrays.keys()
        if missing:
            raise UserError(f"{file} does not hold the arrays of a packed corpus (missing: {', '.join(sorted(missing))})")
        offsets = np.concatenate([[0], np.cumsum(arrays["lengths"])])
        if offsets[-1] != len(arrays["tokens"]) or len(arrays["ids"]) != shard["records"]:
            raise UserError(f"{file} does not hold the records corpus.json lists")
        for i in range(len(arrays["ids"])):
            records.append({
                "id": str(arrays["ids"][i]), "source": str(arrays["sources"][i]),
                "category": str(arrays["categories"][i]), "loss_start": int(arrays["loss_start"][i]),
                "input_ids": arrays["tokens"][offsets[i]: offsets[i + 1]].astype(np.int64).tolist(),
                "_where": f"{file}#{i}",
            })
    return records


# ---- statistics -----------------------------------------------------------------------------------------------------
def frequent_tokens(sequences: Iterable[Iterable[int]], vocab_size: int, size: int) -> list[int]:
    """The `size` most frequent target ids in `sequences` (ties: lower id first), topped up with the lowest unseen ids
    so the head always has exactly min(size, vocab_size) entries. Ids outside [0, vocab_size) are not counted.
    Counts with numpy in chunks: a training set has hundreds of millions of tokens."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    chunk: list[np.ndarray] = []
    pending = 0

    def flush() -> None:
        ids = np.concatenate(chunk)
        ids = ids[(ids >= 0) & (ids < vocab_size)]
        counts[:] += np.bincount(ids, minlength=vocab_size)
        chunk.clear()

    for seq in sequences:
        if isinstance(seq, torch.Tensor):
            seq = seq.cpu().numpy()
        elif not isinstance(seq, (list, tuple, np.ndarray)):
            seq = list(seq)
        ids = np.asarray(seq, dtype=np.int64).reshape(-1)
        chunk.append(ids)
        pending += ids.size
        if pending >= 1 << 24:
            flush()
            pending = 0
    if chunk:
        flush()
    ranked = np.lexsort((np.arange(vocab_size), -counts))[: min(size, vocab_size)]  # count desc, then id asc
    return sorted(int(t) for t in ranked)
