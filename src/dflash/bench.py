"""`dflash bench`: methods side by side on a benchmark set (tau, speedup, tokens/s), every output checked against ar.

    dflash bench --dataset gsm8k --limit 20 --methods ar,hf,ngram,dflash,eagle3 --max-new-tokens 256 --out runs/gsm8k

All methods run in one process, interleaved per prompt (the order rotates from prompt to prompt so no method always
runs on a cache warmed by another), after one short warm-up generation each; a timed run during which CUDA graphs
were captured (or compiled) is run again and its repeat kept (`run_on_replays`). `hf` is the target's own
`model.generate` (greedy or sampled), timed the same way, to show that our `ar` path is not a slow strawman;
`hf-lookup` the same with transformers' own prompt lookup decoding, the speculation a transformers user has for free.

Aggregates (DFLASH_SPEC.md section 7), pooled over all generations rather than averaged per prompt:
    tau            = tokens emitted over all verify rounds / number of rounds (bonus included)
    tokens_per_s   = new tokens / wall time of the generations (TTFT included)
    tpot_ms        = decode time (total - TTFT) / (new tokens - 1 per generation)
    speedup        = ar tpot / method tpot (decode phase; at T=0 outputs match, so this is the decode time ratio)
    e2e_speedup    = method tokens_per_s / ar tokens_per_s (TTFT included)
and beside tau, speedup and e2e_speedup their 95% intervals (`*_ci95`): percentiles of the same pooled figures over
prompts resampled with replacement (paired: a resample draws a prompt's runs of every method together), so a table of
8 prompts says how far its ratios could move on another 8.
At T=0 every method's tokens are compared with ar's and differences are counted in greedy_mismatches, each with the
target's logit gap between the two tokens where they part (`logit_gap`): in float32, and in bfloat16 through our CPU
kernels (the same sums at every width), any difference is a bug; in bfloat16 on a GPU a near tie can round either way.

Writes DIR/results.json, DIR/results.md (the table, also printed), DIR/per_prompt.jsonl and PNG plots.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shlex
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .bench_report import write_outputs
from .bench_runners import (BASELINES, HF_LOOKUP_METHOD, HF_LOOKUP_TOKENS, HF_METHODS, LLAMACPP_METHOD,
                            BaselineCrashed, EngineRunner, HFRunner, LlamaCppRunner, Run)
from .errors import UserError
from .generate import output_format_from_args
from .jsonl import iter_jsonl, layouts_hint, prompt_of
from .options import (add_method_arguments, add_pattern_arguments, add_target_arguments, check_drafter_folders,
                      kill_stops_like_ctrl_c, method_options)

# name -> (file in the data folder, prompt template)
DATASETS = {
    "gsm8k": ("gsm8k_test.jsonl", "math"),
    "math500": ("math500_test.jsonl", "math"),
    "humaneval": ("humaneval.jsonl", "code"),
    "mt_bench": ("mt_bench.jsonl", "chat"),
}
TEMPLATES = {
    "chat": "{prompt}",
    "math": "{prompt}\nPlease reason step by step, and put your final answer within \\boxed{{}}.",
    "code": "Complete the following Python function. Reply with the whole function in one ```python code block."
    "\n\n```python\n{prompt}```",
}
WARMUP_TOKENS = 8


# ---- datasets -----------------------------------------------------------------------------------------------------
@dataclass
class BenchPrompt:
    id: str
    turns: list[str]  # user messages; turn i > 0 follows the model's own answer to turn i-1
    system: str | None = None  # a system message before the first turn


def data_dir() -> Path:
    """$DFLASH_DATA_DIR, else ../shared/data relative to the working directory."""
    return Path(os.environ.get("DFLASH_DATA_DIR", "../shared/data"))


def resolve_dataset(name: str, template: str = "auto") -> tuple[Path, str]:
    """(file, template name) for a built-in name or a .jsonl path. `auto` picks the built-in set's template, else
    sends prompts as they are."""
    if name in DATASETS:
        file_name, default_template = DATASETS[name]
        path = data_dir() / file_name
        if not path.is_file():
            raise UserError(f"dataset {name!r}: {path} not found (set $DFLASH_DATA_DIR to the data folder)")
    else:
        path = Path(name).expanduser()
        if not path.is_file():
            raise UserError(f"dataset {name!r} is neither a built-in name ({', '.join(DATASETS)}) nor a JSONL file")
        by_file = {file_name: tmpl for file_name, tmpl in DATASETS.values()}
        default_template = by_file.get(path.name, "chat")
    chosen = default_template if template == "auto" else template
    if chosen not in TEMPLATES:
        raise UserError(f"unknown template {template!r}; choose auto, {', '.join(TEMPLATES)}")
    return path, chosen


def read_prompts(path: Path, template: str, limit: int | None = None) -> list[BenchPrompt]:
    """Rows with a prompt in any layout jsonl.prompt_of reads; the template wraps the first turn only."""
    prompts = []
    for line_no, row in iter_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        found = prompt_of(row)
        if found is None:
            raise UserError(f"{path}:{line_no} needs {layouts_hint()}")
        turns = [TEMPLATES[template].format(prompt=found.turns[0]), *found.turns[1:]]
        prompts.append(BenchPrompt(str(row.get("id", line_no - 1)), turns, found.system))
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


@dataclass(frozen=True)
class MethodSpec:
    """One entry of --methods: NAME, NAME@B, NAME@B:whole, NAME:whole, NAME[@B]:treeN or NAME[@B]:treeN:whole, to
    run one method at several settings in the same run. B is the block size (tokens verified per round at most:
    dflash's block, EAGLE-3's depth + 1, ngram's drafts + 1); `whole` verifies every draft every round instead of
    the adaptive choice; `treeN` drafts a tree of N nodes (a block drafter's top candidates, trees.py), of which
    the controller verifies the most valuable first ones (`whole`: all)."""

    name: str
    size: int | None = None
    whole_blocks: bool = False
    tree: int | None = None


def known_methods() -> list[str]:
    from .methods import registry

    return registry.names() + list(BASELINES)


def parse_method(text: str) -> MethodSpec:
    head, colon, mode = text.partition(":")
    name, _, size_text = head.partition("@")
    if name not in known_methods():
        raise UserError(f"unknown method {name!r}; choose from {', '.join(known_methods())} "
                        "(optionally NAME@B, NAME@B:whole, NAME:treeN)")
    modes = mode.split(":") if colon else []
    trees = [m for m in modes if m.startswith("tree")]
    if any(m != "whole" and not m.startswith("tree") for m in modes) or len(trees) > 1 or len(set(modes)) < len(modes):
        raise UserError(f"bad method setting {text!r}: the modes are ':whole' and ':treeN' (e.g. dflash@16:whole, "
                        "dflash:tree15, dflash:tree15:whole)")
    tree = None
    if trees:
        if not trees[0][4:].isdigit():
            raise UserError(f"bad method setting {text!r}: use NAME:treeN with an integer N (e.g. dflash:tree15)")
        tree = int(trees[0][4:])
    if (size_text or colon) and name in ("ar", *BASELINES):
        raise UserError(f"{name} takes no setting (got {text!r})")
    size = None
    if size_text:
        try:
            size = int(size_text)
        except ValueError:
            raise UserError(f"bad method setting {text!r}: use NAME@B with an integer B (e.g. dflash@8)") from None
        if size < 2:
            raise UserError(f"{text!r}: block size must be >= 2 (the bonus token and at least one draft)")
    return MethodSpec(name, size, "whole" in modes, tree)


def parse_methods(text: str) -> list[str]:
    """Comma-separated methods (each checked by parse_method), ar always first (every other one is compared with it)."""
    methods = [m.strip() for m in text.split(",") if m.strip()]
    for method in methods:
        parse_method(method)
    return ["ar"] + [m for m in dict.fromkeys(methods) if m != "ar"]


# ---- the runs of a prompt ------------------------------------------------------------------------------------
def build_runners(methods: list[str], target, args, sampling) -> dict:
    from .loading import build_proposer
    from .methods import registry

    specs = {method: parse_method(method) for method in methods}
    if args.continuations is not None and not any(registry.uses_lookup(spec.name) for spec in specs.values()):
        raise UserError("--continuations applies to prompt lookup: add ngram or NAME+ngram to --methods")
    runners = {}
    for method, spec in specs.items():
        if spec.name in HF_METHODS:
            runners[method] = HFRunner(target, sampling, HF_LOOKUP_TOKENS if spec.name == HF_LOOKUP_METHOD else None)
            continue
        if spec.name == LLAMACPP_METHOD:
            try:
                runners[method] = LlamaCppRunner(target, args.llamacpp_gguf, sampling)
            except BaselineCrashed as error:  # before anything ran: nothing to keep
                raise UserError(f"the llamacpp baseline cannot run here: {error}") from None
            continue
        options = method_options(args, spec.name, spec.size, several=True, tree=spec.tree)
        proposer, note = build_proposer(spec.name, target, options)
        if note:
            print(f"[dflash] {method}: {note}", file=sys.stderr)
        adaptive = not (spec.whole_blocks or args.whole_blocks)
        runners[method] = EngineRunner(method, target, proposer, sampling, adaptive, *output_format_from_args(args))
    return runners


def run_conversation(runner, target, prompt: BenchPrompt, max_new: int, ignore_eos: bool) -> list[Run]:
    """All turns of one prompt; a later turn sees the method's OWN earlier answers as assistant messages."""
    runs, messages = [], [{"role": "system", "content": prompt.system}] if prompt.system else []
    for turn in prompt.turns:
        messages.append({"role": "user", "content": turn})
        ids = target.encode_prompt(turn) if len(messages) == 1 else target.encode_messages(messages)
        run = runner.generate(ids, max_new, ignore_eos)
        run.prompt_ids = list(ids)
        runs.append(run)
        messages.append({"role": "assistant", "content": run.text})
    return runs


def run_on_replays(runner, target, prompt: BenchPrompt, max_new: int, ignore_eos: bool,
                   made: Callable[[], int]) -> tuple[list[Run], bool]:
    """run_conversation, timed on replayed graphs: a run during which graphs were made (`made()`, a count, moved)
    paid for capturing them, and under --compile for compiling them (seconds each), which the one short warm-up
    cannot all pay: it meets only the widths its few rounds need. So such a run goes again and its repeat is kept;
    the bool says whether it went again. (A lent H200's compiled bench timed `dflash:whole` at 125 ms a token, its
    drafter's 31 s of compiles inside; the method after it, on the same graphs, at 2.0 ms: docs/RESULTS.md,
    thirty-eighth session.)"""
    before = made()
    runs = run_conversation(runner, target, prompt, max_new, ignore_eos)
    if made() == before:
        return runs, False
    return run_conversation(runner, target, prompt, max_new, ignore_eos), True


def graphs_made(target, runners: dict) -> int:
    """Graphs made so far by the target and the runners' drafters (0 without graphs)."""
    captures = graph_captures(target, runners)
    if captures is None:
        return 0
    return captures["target"]["graphs"] + sum(d["graphs"] for d in captures.get("drafters", []))


# ---- aggregation ----------------------------------------------------------------------------------------------------
@dataclass
class Totals:
    """Pooled statistics of one method over every generation of the run."""

    block_size: int = 1
    generations: int = 0
    new_tokens: int = 0
    total_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    decode_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    draft_lengths: list[int] = field(default_factory=list)
    skipped_drafting: int = 0
    lookup_rounds: int = 0
    table_rounds: int = 0

    def add(self, run: Run) -> None:
        n = len(run.tokens)
        self.generations += 1
        self.new_tokens += n
        self.total_s += run.total_s
        self.ttft_s += run.ttft_s
        self.decode_s += run.total_s - run.ttft_s
        self.decode_tokens += max(0, n - 1)  # the first token belongs to TTFT
        self.accept_lengths += run.accept_lengths or []
        self.draft_lengths += run.draft_lengths or []
        self.skipped_drafting += run.skipped_drafting
        self.lookup_rounds += run.lookup_rounds
        self.table_rounds += run.table_rounds

    @property
    def tpot_ms(self) -> float:
        return 1000 * self.decode_s / max(1, self.decode_tokens)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(1e-9, self.total_s)

    def summary(self, method: str, ar: "Totals") -> dict:
        out = {"tokens_per_s": self.tokens_per_s, "tpot_ms": self.tpot_ms,
               "ttft_ms": 1000 * self.ttft_s / max(1, self.generations), "new_tokens": self.new_tokens}
        if method == "ar":
            return out
        # no decode phase at all (one-token outputs) leaves the TPOT ratio undefined
        out["speedup"] = ar.tpot_ms / self.tpot_ms if self.decode_tokens and ar.decode_tokens else None
        out["e2e_speedup"] = self.tokens_per_s / max(1e-9, ar.tokens_per_s)
        if parse_method(method).name not in BASELINES:  # hf and llama.cpp run no verify rounds
            out.update(acceptance_stats(self.accept_lengths, self.draft_lengths, self.block_size))
            out["skipped_drafting"] = self.skipped_drafting
            if self.lookup_rounds:
                out["lookup_rounds"] = self.lookup_rounds
            if self.table_rounds:
                out["table_rounds"] = self.table_rounds
        return out


def acceptance_stats(accept_lengths: list[int], draft_lengths: list[int], block_size: int) -> dict:
    """tau, per-position acceptance and the histograms over the pooled rounds (the engine's own definitions)."""
    from .engine import GenerationStats

    pooled = GenerationStats(block_size=block_size, accept_lengths=accept_lengths, draft_lengths=draft_lengths)
    return {"tau": pooled.tau, "num_rounds": pooled.num_rounds, "block_size": block_size,
            "per_position_acceptance": pooled.per_position_acceptance, "tau_histogram": pooled.tau_histogram,
            "draft_length_histogram": pooled.draft_length_histogram}


RESAMPLES = 2000


def intervals(per_prompt: dict[str, list["Totals"]], resamples: int = RESAMPLES, seed: int = 0) -> dict[str, dict]:
    """95% intervals of each method's pooled tau, speedup and e2e_speedup: percentiles over `resamples` paired
    resamples of the prompts (seeded: the same runs give the same intervals). None where a figure is undefined in
    a resample, or with fewer than two prompts (one prompt says nothing about another)."""
    import numpy as np

    count = len(per_prompt["ar"])
    if count < 2:
        return {m: {"tau_ci95": None, "speedup_ci95": None, "e2e_speedup_ci95": None} for m in per_prompt if m != "ar"}
    picks = np.random.default_rng(seed).integers(0, count, size=(resamples, count))

    def pooled(method: str, name: str) -> np.ndarray:
        values = np.array([getattr(t, name) if name != "rounds" else len(t.accept_lengths) for t in per_prompt[method]],
                          dtype=np.float64)
        return values[picks].sum(axis=1)

    def bounds(ratio: np.ndarray) -> list[float] | None:
        if not np.all(np.isfinite(ratio)):
            return None
        return [float(x) for x in np.percentile(ratio, [2.5, 97.5])]

    with np.errstate(divide="ignore", invalid="ignore"):
        ar_tpot = pooled("ar", "decode_s") / pooled("ar", "decode_tokens")
        ar_rate = pooled("ar", "new_tokens") / pooled("ar", "total_s")
        out = {}
        for method in per_prompt:
            if method == "ar":
                continue
            tpot = pooled(method, "decode_s") / pooled(method, "decode_tokens")
            rate = pooled(method, "new_tokens") / pooled(method, "total_s")
            out[method] = {"speedup_ci95": bounds(ar_tpot / tpot), "e2e_speedup_ci95": bounds(rate / ar_rate)}
            if parse_method(method).name not in BASELINES:
                accepted = np.array([sum(t.accept_lengths) for t in per_prompt[method]], dtype=np.float64)
                out[method]["tau_ci95"] = bounds(accepted[picks].sum(axis=1) / pooled(method, "rounds"))
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def logit_gap(target, reference: Run, tokens: list[int], at: int) -> float | None:
    """How far apart the target's logits put ar's token and the method's at their first difference `at`, from one
    eager pass over the prompt and ar's tokens before it; None where one output merely ended first. In float32 any
    difference is a bug; in bfloat16 on a GPU, passes of different widths (a 1-token step, a 16-token verify, a
    CUDA graph over the whole cache) round differently, and a greedy choice between two tokens this close flips
    (a near tie: a gap of a few hundredths of a logit); a large gap is a bug there too."""
    if at >= min(len(tokens), len(reference.tokens)) or reference.prompt_ids is None:
        return None
    ids = torch.tensor([reference.prompt_ids + reference.tokens[:at]], device=target.device)
    logits = target.forward(ids, logits_at="last").logits[0, -1].float()
    return round(float(logits[reference.tokens[at]] - logits[tokens[at]]), 4)


# ---- the command ----------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:

    add_target_arguments(p)
    add_method_arguments(p, several=True)
    p.add_argument("--dataset", required=True, help=f"{', '.join(DATASETS)} (from $DFLASH_DATA_DIR or ../shared/data) "
                   "or a JSONL file of prompts ('turns', 'messages', 'conversations', 'prompt', 'instruction', "
                   "'question', 'problem' or 'query')")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--methods", default="ar,ngram,dflash,dflash+ngram",
                   help="comma-separated: the engine's methods, hf (transformers' generate), hf-lookup (the same "
                        "with its prompt lookup decoding) and llamacpp; NAME@B runs a "
                        "method at block size B, NAME@B:whole (or NAME:whole) verifies whole blocks instead of the "
                        "adaptive choice, NAME:treeN drafts a tree of N nodes a round (dflash; :treeN:whole verifies them "
                        "all), side by side "
                        "with the others, e.g. dflash,dflash@8,dflash@16:whole,dflash:tree15,eagle3@4 "
                        "(default: ar,ngram,dflash)")
    p.add_argument("--template", default="auto", choices=["auto", *TEMPLATES], help="prompt template")
    p.add_argument("--llamacpp-gguf", default=None, metavar="FILE",
                   help="GGUF file for the llamacpp baseline (default: the registry's file for the target); f32 / "
                        "bf16: an F32 / BF16 copy of the registry's file, made once by llama.cpp (the float32 / "
                        "bfloat16 target's weights); q8_0: llama.cpp's int8 copy, beside --dtype int8")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (T > 0)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--response-format", choices=["text", "json_object"], default="text",
                   help="json_object: every method's output constrained to a JSON object (default: text)")
    p.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                   help="every method's output constrained to objects this JSON Schema allows")
    add_pattern_arguments(p)
    p.add_argument("--batch", type=int, default=None, metavar="N",
                   help="throughput instead: each method answers the prompts as one continuous batch of up to N rows "
                        "at a time (their first turn; dflash's methods only), the methods taking turns, "
                        "--batch-runs timed runs each (bench_batch.py)")
    p.add_argument("--batch-runs", type=int, default=3, metavar="R", help="timed runs of each method with --batch")
    p.add_argument("--out", default=None,
                   help="output folder (default: runs/bench/DATASET-DATE-TIME, a new one each run)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def validate(args) -> None:
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")
    if output_format_from_args(args)[0] is not None:
        if args.ignore_eos:
            raise UserError("--ignore-eos cannot go with structured output: a JSON document ends where it ends")
        baselines = [m for m in parse_methods(args.methods) if parse_method(m).name in (*HF_METHODS, LLAMACPP_METHOD)]
        if baselines:
            raise UserError(f"{', '.join(baselines)} cannot constrain their output; leave them out of --methods with "
                            "--response-format / --json-schema / --regex / --choice")


def run(args) -> int:
    from tqdm import tqdm

    from .loading import settle_heap, target_from_args
    from .sampling import SamplingConfig

    validate(args)
    if args.batch is not None:
        if output_format_from_args(args)[0] is not None:
            raise UserError("--batch times free text: leave out the structured-output flags")
        from .bench_batch import run as run_batches

        return run_batches(args)
    methods = parse_methods(args.methods)
    path, template = resolve_dataset(args.dataset, args.template)
    prompts = read_prompts(path, template, args.limit)
    out_dir = Path(args.out or default_out(args.dataset))
    args.out = str(out_dir)  # the command line results.json records names it
    names = [parse_method(method).name for method in methods]
    check_drafter_folders(args.drafter, [name for name in names if name not in BASELINES])
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers' `generate` reads the plain weights
    target = target_from_args(args, release_plain=not any(m in HF_METHODS for m in methods))
    sampling = SamplingConfig(temperature=args.temperature, seed=args.seed if args.temperature > 0 else None)
    runners = build_runners(methods, target, args, sampling)
    settle_heap()
    loaded_mb = resident_mb()

    totals = {m: Totals(block_size=r.block_size) for m, r in runners.items()}
    per_prompt = {m: [] for m in runners}  # each prompt's own Totals, for the intervals
    mismatches, rows = [], []
    retimed = dict.fromkeys(runners, 0)  # runs timed again because they captured graphs
    done = 0  # prompts every method has finished: what an interrupted bench reports
    failed = {}  # baselines whose engine died, and how: dropped from the results, the others go on

    def drop(method: str, error: BaselineCrashed) -> None:
        print(f"dflash bench: {method} dropped from this run: {error}", file=sys.stderr)
        failed[method] = str(error)
        methods.remove(method)
        for table in (runners, totals, per_prompt, retimed):
            table.pop(method)

    with kill_stops_like_ctrl_c(), closing_runners(runners):  # the prompts finished are written
        try:
            warm = BenchPrompt("warmup", prompts[0].turns[:1])
            warming = tqdm(list(runners.items()), desc="warm-up", unit="method", disable=args.no_progress)
            for method, runner in warming:
                warming.set_postfix_str(method)
                try:
                    run_conversation(runner, target, warm, min(WARMUP_TOKENS, args.max_new_tokens), args.ignore_eos)
                except BaselineCrashed as error:
                    drop(method, error)
            progress = tqdm(prompts, desc="bench", unit="prompt", disable=args.no_progress)
            for index, prompt in enumerate(progress):
                shift = index % len(methods)
                runs = {}
                for method in methods[shift:] + methods[:shift]:
                    progress.set_postfix_str(method)
                    try:
                        runs[method], again = run_on_replays(runners[method], target, prompt, args.max_new_tokens,
                                                             args.ignore_eos, lambda: graphs_made(target, runners))
                    except BaselineCrashed as error:
                        drop(method, error)
                        continue
                    retimed[method] += again
                compare_prompt(prompt, runs, runners, target, sampling, totals, per_prompt, mismatches, rows)
                done += 1
        except KeyboardInterrupt:
            if not done:
                raise
            print(f"dflash bench: interrupted; the {done} of {len(prompts)} prompts every method finished are "
                  f"written", file=sys.stderr)
    results = collect_results(args, target, prompts[:done], path, methods, totals, mismatches, sampling.greedy,
                              runners)
    results["memory"] = memory_report(target, loaded_mb)
    if any(retimed.values()):
        results["retimed_runs"] = {m: n for m, n in retimed.items() if n}
    if done < len(prompts):
        results["interrupted"] = {"prompts_done": done, "prompts_asked": len(prompts)}
    if failed:
        results["failed"] = failed
    for method, bounds in intervals(per_prompt).items():
        results["methods"][method].update(bounds)
    results["bootstrap_resamples"] = RESAMPLES
    write_outputs(out_dir, results, rows)
    if mismatches:
        print(f"dflash bench: {len(mismatches)} greedy output(s) differ from ar (see results.json)", file=sys.stderr)
        return 1
    return 130 if done < len(prompts) else 0


@contextlib.contextmanager
def closing_runners(runners: dict):
    """Ends the runners' own processes (llama.cpp's) when the benchmark ends, however it ends."""
    try:
        yield
    finally:
        for runner in runners.values():
            if hasattr(runner, "close"):
                runner.close()


def compare_prompt(prompt, runs: dict, runners: dict, target, sampling, totals: dict, per_prompt: dict,
                   mismatches: list, rows: list) -> None:
    """One prompt's runs of every method into the totals, each turn's tokens compared with `ar`'s. The comparisons
    (a logit gap runs a pass) come first and the totals change last, so that an interrupt leaves them whole."""
    new_mismatches, new_rows = [], []
    for method, method_runs in runs.items():
        for turn, r in enumerate(method_runs):
            reference = runs["ar"][turn].tokens
            same = r.tokens == reference
            # llama.cpp runs other (often quantised) weights: its tokens are not the target's to compare
            if sampling.greedy and not same and method != LLAMACPP_METHOD:
                at = first_difference(r.tokens, reference)
                new_mismatches.append({"id": prompt.id, "turn": turn, "method": method, "first_difference": at,
                                       "logit_gap": logit_gap(target, runs["ar"][turn], r.tokens, at)})
            new_rows.append(_row(prompt.id, turn, method, r, same))
    for method, method_runs in runs.items():
        per_prompt[method].append(Totals(block_size=runners[method].block_size))
        for r in method_runs:
            totals[method].add(r)
            per_prompt[method][-1].add(r)
    mismatches += new_mismatches
    rows += new_rows


def graph_captures(target, runners: dict) -> dict | None:
    """The graphs the run captured and the seconds that took, the target's and its drafters' (a drafter keeps its
    graphs beside its weights: shared by the methods that draft with it); None without graphs."""
    if target.graphs is None:
        return None
    drafters = {}
    for runner in runners.values():
        decoder = getattr(runner, "decoder", None)  # hf and llamacpp run without our engine
        graphs = getattr(decoder.engine.proposer, "graphs", None) if decoder is not None else None
        if graphs is not None:  # a DFlash proposer's (kept by its drafter: one set per drafter)
            drafters[id(graphs)] = graphs.report()
    report = {"target": target.graphs.report()}
    if drafters:
        report["drafters"] = list(drafters.values())
    return report


def _row(prompt_id: str, turn: int, method: str, r: Run, same: bool) -> dict:
    row = {"id": prompt_id, "turn": turn, "method": method, "new_tokens": len(r.tokens),
           "ttft_ms": 1000 * r.ttft_s, "total_s": r.total_s, "same_as_ar": same}
    if r.accept_lengths is not None:
        row["tau"] = sum(r.accept_lengths) / max(1, len(r.accept_lengths))
    return row


def collect_results(args, target, prompts, path, methods, totals, mismatches, greedy: bool, runners: dict) -> dict:
    ar = totals["ar"]
    summaries = {m: totals[m].summary(m, ar) for m in methods}
    response_format, json_schema = output_format_from_args(args)
    results = {
        "target": args.target,
        "device": str(target.device),
        "dtype": target.precision,  # "int8" for an int8 target (bfloat16 activations)
        "draft_dtype": args.draft_dtype,
        "drafters": {m: r.report for m, r in runners.items() if getattr(r, "report", None)},
        "threads": {m: r.threads for m, r in runners.items() if getattr(r, "threads", None)},
        "llamacpp": {m: {"gguf": str(r.path), "quantization": r.quantization} for m, r in runners.items()
                     if isinstance(r, LlamaCppRunner)},
        "dataset": args.dataset,
        "num_prompts": len(prompts),
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "methods": summaries,
        # outputs are compared only when decoding is greedy; sampled runs have nothing to compare
        "greedy_mismatches": len(mismatches) if greedy else None,
        "mismatches": mismatches,
        "num_generations": ar.generations,
        "block_size": args.block_size,
        "adaptive": not args.whole_blocks,  # of methods without their own ':whole'
        "engine": target.backend,
        "cuda_graphs": target.graphs is not None,  # the target's passes replayed as CUDA graphs (graphs.py)
        "compiled_graphs": target.graphs_compiled,  # those passes (and a DFlash drafter's) through torch.compile
        "graph_captures": graph_captures(target, runners),  # what capturing (and compiling) them cost
        "kernels": target.kernel_report,
        # greedy rounds' tokens through a screen of the LM head (models/screening.py), or the whole head (None)
        "greedy_screen": target.screen_kind if target.screens else None,
        "ignore_eos": args.ignore_eos,
        "response_format": response_format or "text",
        "json_schema": json_schema,
        "dataset_file": str(path),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(args),
        "machine": machine_info(target),
    }
    if "hf" in summaries:
        # > 1 means our ar path is faster than transformers' generate
        results["ar_vs_hf_tokens_per_s"] = summaries["ar"]["tokens_per_s"] / max(1e-9, summaries["hf"]["tokens_per_s"])
    return results


def default_out(dataset: str) -> Path:
    """runs/bench/<dataset's name>-<local date and time>: a run never writes over an earlier one's results"""
    name = Path(dataset).stem if dataset.endswith(".jsonl") else dataset
    base = Path("runs") / "bench" / f"{name}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    out, n = base, 1
    while out.exists():  # two runs in the same second
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def command_line(args) -> str:
    """The command that reproduces this run (rebuilt from the parsed flags, so it holds the defaults too)."""
    parts = ["dflash bench", f"--dataset {args.dataset}", f"--methods {args.methods}", f"--target {args.target}",
             f"--max-new-tokens {args.max_new_tokens}", f"--temperature {args.temperature}", f"--dtype {args.dtype}",
             f"--device {args.device}"]
    for flag, value in (("--limit", args.limit), ("--block-size", args.block_size),
                        ("--draft-dtype", None if args.draft_dtype == "auto" else args.draft_dtype)):
        if value is not None:
            parts.append(f"{flag} {value}")
    for value in args.drafter or []:
        parts.append(f"--drafter {value}")
    if args.continuations is not None:
        parts.append(f"--continuations {args.continuations}")
    if args.kernels != "auto":
        parts.append(f"--kernels {args.kernels}")
    if args.compile:
        parts.append("--compile")
    if getattr(args, "cuda_graphs", None) is not None:  # unset: the device decides (loading.graphs_by_default)
        parts.append("--cuda-graphs" if args.cuda_graphs else "--no-cuda-graphs")
    if args.template != "auto":
        parts.append(f"--template {args.template}")
    if args.whole_blocks:
        parts.append("--whole-blocks")
    if args.ignore_eos:
        parts.append("--ignore-eos")
    if args.response_format != "text":
        parts.append(f"--response-format {args.response_format}")
    if args.json_schema is not None:
        parts.append(f"--json-schema {shlex.quote(args.json_schema)}")
    if args.regex is not None:
        parts.append(f"--regex {shlex.quote(args.regex)}")
    if args.choice is not None:
        parts.append("--choice " + " ".join(shlex.quote(c) for c in args.choice))
    if args.grammar is not None:
        parts.append(f"--grammar {shlex.quote(args.grammar)}")
    if args.structural_tag is not None:
        parts.append(f"--structural-tag {shlex.quote(args.structural_tag)}")
    if args.threads is not None:
        parts.append(f"--threads {args.threads}")
    return " ".join(parts + [f"--out {args.out}"])


def resident_mb() -> int | None:
    """The process's resident memory now (MB), where /proc tells it."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    found = re.search(r"VmRSS:\s+(\d+) kB", status)
    return int(found.group(1)) >> 10 if found else None


def memory_report(target, loaded_mb: int | None) -> dict:
    """Resident memory after loading (the target, the drafters, the weights released where only our kernels read
    them) and at its peak over the run (MB); on CUDA, the most the device held."""
    import resource

    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux
    report = {"resident_mb_after_loading": loaded_mb, "peak_resident_mb": peak_kb >> 10}
    if target.device.type == "cuda":
        report["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated(target.device) >> 20
    return report


def machine_info(target) -> dict:
    import transformers

    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
            "torch": torch.__version__, "transformers": transformers.__version__}
    if target.device.type == "cpu":
        from .models import native

        info.update(cpu=native.cpu_description(), native_kernels=native.build_id())
    if target.device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(target.device)
    return info
