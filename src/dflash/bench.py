"""`dflash bench`: methods side by side on a benchmark set (tau, speedup, tokens/s), every output checked against ar.

    dflash bench --dataset gsm8k --limit 20 --methods ar,hf,ngram,dflash,eagle3 --max-new-tokens 256 --out runs/gsm8k

All methods run in one process, interleaved per prompt (the order rotates from prompt to prompt so no method always
runs on a cache warmed by another), after one short warm-up generation each; a timed run during which CUDA graphs
were captured (or compiled) is run again and its repeat kept (`run_on_replays`). `hf` is the target's own
`model.generate` (greedy or sampled), timed the same way, to show that our `ar` path is not a slow strawman.

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
import copy
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from .errors import UserError
from .jsonl import iter_jsonl

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
HF_METHOD = "hf"  # transformers' own generate, beside the engine's methods
LLAMACPP_METHOD = "llamacpp"  # llama.cpp (llama-cpp-python) on a GGUF file: the engine a CPU user would pick instead
BASELINES = (HF_METHOD, LLAMACPP_METHOD)  # other engines: timed, but not ours to compare token by token
WARMUP_TOKENS = 8


# ---- datasets -----------------------------------------------------------------------------------------------------
@dataclass
class BenchPrompt:
    id: str
    turns: list[str]  # user messages; turn i > 0 follows the model's own answer to turn i-1


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
    """Rows with `turns` (a list of strings) or `prompt`; the template wraps the first turn only."""
    prompts = []
    for line_no, row in iter_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        turns = _turns_of(row)
        if turns is None:
            raise UserError(f"{path}:{line_no} needs a string 'prompt' or a list of strings 'turns'")
        turns[0] = TEMPLATES[template].format(prompt=turns[0])
        prompts.append(BenchPrompt(str(row.get("id", line_no - 1)), turns))
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


def _turns_of(row) -> list[str] | None:
    if not isinstance(row, dict):
        return None
    turns = row.get("turns")
    if isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns):
        return list(turns)
    prompt = row.get("prompt")
    return [prompt] if isinstance(prompt, str) and prompt.strip() else None


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


# ---- running one generation --------------------------------------------------------------------------------------
@dataclass
class Run:
    tokens: list[int]
    text: str
    ttft_s: float
    total_s: float
    accept_lengths: list[int] | None = None  # None for hf (no verify rounds)
    draft_lengths: list[int] | None = None  # drafts verified per round
    skipped_drafting: int = 0
    lookup_rounds: int = 0  # rounds that verified prompt lookup's drafts (NAME+ngram)
    table_rounds: int = 0  # rounds that verified drafts of the target's continuation table
    prompt_ids: list[int] | None = None  # what the generation continued (a later turn: the conversation so far)


class EngineRunner:
    """A proposer behind the shared verification loop."""

    def __init__(self, method: str, target, proposer, sampling, adaptive: bool = True):
        from .engine import SpeculativeDecoder

        self.method, self.sampling = method, sampling
        self.decoder = SpeculativeDecoder(target, proposer, adaptive=adaptive)
        self.block_size = proposer.max_draft + 1
        self.report = proposer.report

    @property
    def threads(self) -> dict | None:
        """Where this method's thread chooser ended up (threads.py); None when the count was fixed."""
        chooser = self.decoder.engine.threads
        if chooser is None:
            return None
        return {"counts": list(chooser.counts), "final": chooser.current, "probes": chooser.probes,
                "switches": chooser.switches}

    def generate(self, prompt_ids: list[int], max_new: int, ignore_eos: bool) -> Run:
        from .engine import GenerationConfig

        config = GenerationConfig(max_new_tokens=max_new, sampling=copy.copy(self.sampling), ignore_eos=ignore_eos)
        result = self.decoder.generate(prompt_ids, config)
        stats = result.stats
        return Run(result.tokens, result.text, stats.ttft_s, stats.total_s, list(stats.accept_lengths),
                   list(stats.draft_lengths), stats.skipped_drafting, stats.lookup_rounds, stats.table_rounds)


class _FirstTokenClock:
    """A `generate` streamer that notes when the first new token arrives (its first `put` is the prompt)."""

    def __init__(self):
        self.puts, self.first_token_at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


class HFRunner:
    """The target's own `model.generate`, same prompt ids, same stop ids, same length limit as ar."""

    method, block_size = "hf", 1

    def __init__(self, target, sampling):
        from transformers.generation.streamers import BaseStreamer

        self.target, self.sampling = target, sampling
        target.restore_plain_weights()  # transformers' forward reads the model's own parameters
        self.clock_type = type("FirstTokenClock", (_FirstTokenClock, BaseStreamer), {})

    def generation_config(self, max_new: int, ignore_eos: bool):
        gc = copy.deepcopy(self.target.model.generation_config)
        eos = self.target.eos_token_ids
        gc.max_new_tokens, gc.max_length, gc.min_new_tokens, gc.min_length = max_new, None, None, 0
        gc.eos_token_id = None if ignore_eos else (eos or None)
        gc.pad_token_id = eos[0] if eos else 0
        gc.do_sample = not self.sampling.greedy
        if gc.do_sample:
            gc.temperature, gc.top_k, gc.top_p = self.sampling.temperature, self.sampling.top_k, self.sampling.top_p
        else:  # unset sampling knobs so transformers does not warn that they are ignored
            gc.temperature = gc.top_k = gc.top_p = None
        return gc

    def generate(self, prompt_ids: list[int], max_new: int, ignore_eos: bool) -> Run:
        target = self.target
        max_new = min(max_new, target.max_context - len(prompt_ids) - 1)  # the ar engine's own limit
        input_ids = torch.tensor([prompt_ids], device=target.device)
        clock = self.clock_type()
        if self.sampling.seed is not None:
            torch.manual_seed(self.sampling.seed)
        start = time.perf_counter()
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                generation_config=self.generation_config(max_new, ignore_eos), streamer=clock,
            )
        tokens = out[0, len(prompt_ids):].tolist()  # the host copy also waits for the device
        total = time.perf_counter() - start
        eos = set(target.eos_token_ids)
        shown = tokens[:-1] if tokens and tokens[-1] in eos and not ignore_eos else tokens
        ttft = (clock.first_token_at or time.perf_counter()) - start
        return Run(tokens, target.decode(shown), ttft, total)


class BaselineCrashed(Exception):
    """A baseline's engine died in its own process (bench drops the method and goes on with the others)."""


class LlamaCppRunner:
    """llama.cpp through llama-cpp-python (the optional extra `dflash[llamacpp]`) on a GGUF file of the target:
    greedy (or sampled) decoding of the same prompt ids, timed the same way. By default the GGUF file the registry
    ships (for smollm2-135m: Q4_1-quantised, so its outputs differ from the float32 target's and are not compared).
    llama.cpp runs in a process of its own (llamacpp_worker.py), which times each generation itself, so that a crash
    in its native code ends that process and this runner (BaselineCrashed), not the benchmark."""

    method, block_size = LLAMACPP_METHOD, 1

    def __init__(self, target, gguf: str | None, sampling):
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            raise UserError("the llamacpp baseline needs llama-cpp-python: pip install 'dflash[llamacpp]' "
                            "(it compiles llama.cpp: 5-20 minutes on 2 cores)")
        path = (converted_gguf(registry_gguf(target.name), gguf) if gguf in CONVERSIONS
                else Path(gguf) if gguf else registry_gguf(target.name))
        if not path.is_file():
            raise UserError(f"GGUF file not found: {path}")
        self.path, self.sampling, self.eos = path, sampling, sorted(set(target.eos_token_ids))
        self.quantization = quantization_of(path)
        self.decode = target.decode
        worker = Path(__file__).with_name("llamacpp_worker.py")
        self.process = subprocess.Popen(
            [sys.executable, str(worker), str(path), str(min(target.max_context, 4096)), str(torch.get_num_threads()),
             str(sampling.seed or 0)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        ready = self._reply()
        if "error" in ready:
            self.close()
            raise UserError(f"llama.cpp could not load {path}: {ready['error']}")

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:  # the worker is gone: say how it ended
            code = self.process.wait()
            how = f"signal {signal_name(-code)}" if code < 0 else f"exit status {code}"
            hint = ("; SIGILL: an instruction this CPU or OS refused (a llama-cpp-python built with GGML_NATIVE died "
                    "so in its AMX path on an Intel Xeon; built with -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
                    "-DGGML_AMX_BF16=OFF it ran: docs/RESULTS.md, forty-ninth session)"
                    if code == -signal.SIGILL else "")
            raise BaselineCrashed(f"llama.cpp's process died ({how}) running {self.path.name}{hint}")
        return json.loads(line)

    def generate(self, prompt_ids: list[int], max_new: int, ignore_eos: bool) -> Run:
        request = {"prompt": list(prompt_ids), "max_new": max_new, "eos": self.eos, "ignore_eos": ignore_eos,
                   "temperature": self.sampling.temperature, "top_p": self.sampling.top_p}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # (died before: _reply says how)
        reply = self._reply()
        tokens = reply["tokens"]
        shown = tokens[:-1] if tokens and tokens[-1] in self.eos and not ignore_eos else tokens
        return Run(tokens, self.decode(shown), reply["ttft"], reply["total"])

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


CONVERSIONS = {"f32": ("F32", "LLAMA_FTYPE_ALL_F32"), "bf16": ("BF16", "LLAMA_FTYPE_MOSTLY_BF16"),
               "q8_0": ("Q8_0", "LLAMA_FTYPE_MOSTLY_Q8_0")}


def converted_gguf(source: Path, kind: str = "f32") -> Path:
    """An F32, BF16 or Q8_0 copy (`kind` f32 / bf16 / q8_0) of a GGUF file, made once by llama.cpp's own converter
    beside the original. The registry's SmolLM2 file is Q4_1 and the float32 target is that file dequantised, so the
    F32 copy holds the very weights the target runs, and the BF16 copy those of the bfloat16 target (the same
    weights rounded to bfloat16): llama.cpp and dflash then do the same arithmetic on the same numbers. Q8_0 is
    llama.cpp's int8 (a scale per 32 weights), beside an int8 target (a scale per row): alike in bytes, not in
    numbers."""
    import ctypes

    import llama_cpp

    suffix, ftype = CONVERSIONS[kind]
    out = source.with_name(f"{source.stem}.{suffix}.gguf")
    if out.is_file():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = getattr(llama_cpp, ftype), True, 0
    partial = out.with_name(out.name + ".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise UserError(f"llama.cpp could not convert {source} to {suffix}")
    partial.replace(out)
    return out


def registry_gguf(name: str) -> Path:
    from .hub import REGISTRY, fetch_gguf

    if name not in REGISTRY:
        raise UserError(f"--llamacpp-gguf is needed for target {name!r} (only registry targets ship a GGUF file)")
    return fetch_gguf(name)


def quantization_of(path: Path) -> str:
    """The GGUF file's weight type as its name says it (e.g. Q4_1, F32, BF16), else "unknown"."""
    import re

    # the last one named: a converted copy ("model.Q4_1.F32.gguf") is what its last suffix says
    found = re.findall(r"(BF16|F16|F32|Q\d_K(?:_[SML])?|Q\d_\d|Q\d_0|IQ\d\w*)", path.name, re.IGNORECASE)
    return found[-1].upper() if found else "unknown"


def build_runners(methods: list[str], target, args, sampling) -> dict:
    from .cli import method_options
    from .loading import build_proposer
    from .methods import registry

    specs = {method: parse_method(method) for method in methods}
    if args.continuations is not None and not any(registry.uses_lookup(spec.name) for spec in specs.values()):
        raise UserError("--continuations applies to prompt lookup: add ngram or NAME+ngram to --methods")
    runners = {}
    for method, spec in specs.items():
        if spec.name == HF_METHOD:
            runners[method] = HFRunner(target, sampling)
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
        runners[method] = EngineRunner(method, target, proposer, sampling, adaptive)
    return runners


def run_conversation(runner, target, prompt: BenchPrompt, max_new: int, ignore_eos: bool) -> list[Run]:
    """All turns of one prompt; a later turn sees the method's OWN earlier answers as assistant messages."""
    runs, messages = [], []
    for i, turn in enumerate(prompt.turns):
        messages.append({"role": "user", "content": turn})
        ids = target.encode_prompt(turn) if i == 0 else target.encode_messages(messages)
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


def mismatch_summary(mismatches: list[dict]) -> str:
    """"3" or "3 (largest logit gap at the first difference: 0.031)" (logit_gap)."""
    gaps = [abs(m["logit_gap"]) for m in mismatches if m.get("logit_gap") is not None]
    return f"{len(mismatches)}" + (f" (largest logit gap at the first difference: {max(gaps):.3g})" if gaps else "")


# ---- the command ----------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    from .cli import add_method_arguments, add_target_arguments

    add_target_arguments(p)
    add_method_arguments(p, several=True)
    p.add_argument("--dataset", required=True, help=f"{', '.join(DATASETS)} (from $DFLASH_DATA_DIR or ../shared/data) "
                   "or a JSONL file with 'prompt' or 'turns'")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--methods", default="ar,ngram,dflash,dflash+ngram",
                   help="comma-separated: the engine's methods and hf (transformers' generate); NAME@B runs a "
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
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def validate(args) -> None:
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be >= 1, got {args.limit}")
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise UserError(f"--temperature must be >= 0, got {args.temperature}")


def run(args) -> int:
    from tqdm import tqdm

    from .cli import check_drafter_folders, kill_stops_like_ctrl_c
    from .loading import settle_heap, target_from_args
    from .sampling import SamplingConfig

    validate(args)
    methods = parse_methods(args.methods)
    path, template = resolve_dataset(args.dataset, args.template)
    prompts = read_prompts(path, template, args.limit)
    out_dir = Path(args.out)
    names = [parse_method(method).name for method in methods]
    check_drafter_folders(args.drafter, [name for name in names if name not in BASELINES])
    out_dir.mkdir(parents=True, exist_ok=True)
    target = target_from_args(args, release_plain="hf" not in methods)  # transformers' `generate` reads them
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
        "dataset_file": str(path),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": command_line(args),
        "machine": machine_info(target),
    }
    if "hf" in summaries:
        # > 1 means our ar path is faster than transformers' generate
        results["ar_vs_hf_tokens_per_s"] = summaries["ar"]["tokens_per_s"] / max(1e-9, summaries["hf"]["tokens_per_s"])
    return results


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


# ---- reports ----------------------------------------------------------------------------------------------------
def markdown_table(results: dict) -> str:
    lines = ["| method | tau | speedup | e2e speedup | tokens/s | TPOT ms | TTFT ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for method, s in results["methods"].items():
        tau = f"{s['tau']:.2f}{_between(s.get('tau_ci95'))}" if "tau" in s else ("1.00" if method == "ar" else "-")
        name = method
        if method in results.get("llamacpp", {}):  # its weights are not the target's: say which they are
            name = f"{method} ({results['llamacpp'][method]['quantization']} GGUF)"
        speedup = _times(s.get("speedup", 1.0)) + _between(s.get("speedup_ci95"), "x")
        e2e = _times(s.get("e2e_speedup", 1.0)) + _between(s.get("e2e_speedup_ci95"), "x")
        lines.append(f"| {name} | {tau} | {speedup} | {e2e} | {s['tokens_per_s']:.1f} | {s['tpot_ms']:.2f} "
                     f"| {s['ttft_ms']:.1f} |")
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _between(bounds: list[float] | None, unit: str = "") -> str:
    return "" if not bounds else f" ({bounds[0]:.2f}-{bounds[1]:.2f}{unit})"


def attention_note(kernels: dict) -> str:
    """", attention: flash (measured)" where the load chose the SDPA backends by measurement (a CUDA target)."""
    attention = kernels.get("attention") or {}
    if not attention.get("measured"):
        return ""
    per_call = ", ".join(f"{name} {ms:.3g}" for name, ms in attention["ms_per_call"].items())
    return f", attention: {attention['sdpa']} (ms per call: {per_call})"


def machine_line(machine: dict) -> str:
    """One line naming what the figures ran on: the GPU, or the CPU with its instruction sets and threads."""
    cpu = machine.get("cpu") or {}
    where = machine.get("gpu") or " ".join(
        filter(None, [cpu.get("model") or machine.get("processor", "?"),
                      f"family {cpu['family']} model {cpu['model_number']}" if cpu.get("family") else "",
                      f"({', '.join(cpu['isa'])})" if cpu.get("isa") else ""]))
    return (f"{where}, {machine.get('cpu_count', '?')} cores, {machine.get('torch_threads', '?')} torch threads, "
            f"torch {machine.get('torch', '?')}")


def memory_lines(memory: dict | None) -> list[str]:
    if not memory or memory.get("resident_mb_after_loading") is None:
        return []
    line = (f"memory: {memory['resident_mb_after_loading']} MB resident after loading, "
            f"{memory['peak_resident_mb']} MB at the peak")
    if "cuda_peak_allocated_mb" in memory:
        line += f"; GPU: {memory['cuda_peak_allocated_mb']} MB allocated at the peak"
    return ["", line]


def graph_capture_lines(captures: dict | None, retimed: dict | None = None) -> list[str]:
    if not captures:
        return []
    parts = [f"target {captures['target']['graphs']} in {captures['target']['capture_seconds']} s"]
    parts += [f"drafter {d['graphs']} in {d['capture_seconds']} s" for d in captures.get("drafters", [])]
    lines = [f"CUDA graphs captured (compiles included): {', '.join(parts)}"]
    if retimed:  # run_on_replays
        counts = ", ".join(f"{method} {n}" for method, n in retimed.items())
        lines.append(f"runs that captured graphs, timed again on replays: {counts}")
    return lines + [""]


def interrupted_note(results: dict) -> str:
    cut = results.get("interrupted")
    return f" (interrupted: {cut['prompts_done']} of the {cut['prompts_asked']} asked)" if cut else ""


def markdown_report(results: dict, plots: list[str], note: str | None) -> str:
    mismatches = results["greedy_mismatches"]
    lines = [
        f"# dflash bench: {results['dataset']}",
        "",
        f"`{results['command']}`",
        "",
        f"target `{results['target']}` ({results['dtype']}, {results['device']}"
        f"{', CUDA graphs' if results.get('cuda_graphs') else ''}"
        f"{' (compiled)' if results.get('compiled_graphs') else ''}{attention_note(results.get('kernels') or {})}), "
        f"{results['num_prompts']} prompts{interrupted_note(results)} "
        f"({results['num_generations']} generations per method), max {results['max_new_tokens']} new tokens, "
        f"T={results['temperature']}, {results['date']}",
        "",
        f"machine: {machine_line(results.get('machine', {}))}",
        *memory_lines(results.get("memory")),
        "",
        *graph_capture_lines(results.get("graph_captures"), results.get("retimed_runs")),
        markdown_table(results),
        "",
        "speedup = ar TPOT / method TPOT (decode); e2e speedup = tokens/s ratio including TTFT; in brackets, 95% "
        f"intervals over the prompts (paired bootstrap, {RESAMPLES} resamples).",
        "",
        "greedy mismatches vs ar: "
        f"{mismatch_summary(results['mismatches']) if mismatches is not None else 'not compared (sampling)'}",
    ]
    if "ar_vs_hf_tokens_per_s" in results:
        lines.append(f"ar vs transformers generate: ar runs at {results['ar_vs_hf_tokens_per_s']:.2f}x hf's tokens/s")
    lines.append("")
    lines += [f"![{p}]({p})" for p in plots]
    if note:
        lines.append(note)
    return "\n".join(lines) + "\n"


def write_plots(out_dir: Path, results: dict) -> tuple[list[str], str | None]:
    """PNG plots; skipped with a note when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "matplotlib is not installed: plots skipped (pip install 'dflash[plot]')"
    speculative = {m: s for m, s in results["methods"].items() if "tau" in s}
    written = []
    if speculative:
        fig, ax = plt.subplots(figsize=(7, 4))
        width = 0.8 / len(speculative)
        for i, (method, s) in enumerate(speculative.items()):
            hist = s["tau_histogram"]
            share = [h / max(1, sum(hist)) for h in hist]
            ax.bar([k + 1 + (i - (len(speculative) - 1) / 2) * width for k in range(len(hist))], share, width,
                   label=f"{method} (tau {s['tau']:.2f})")
        ax.set(xlabel="tokens emitted per verify round", ylabel="share of rounds", title="acceptance length")
        ax.legend()
        written.append(_save(fig, out_dir / "tau_histogram.png"))

        fig, ax = plt.subplots(figsize=(7, 4))
        for method, s in speculative.items():
            acc = s["per_position_acceptance"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=method)
        ax.set(xlabel="draft position k", ylabel="fraction of rounds accepted", ylim=(0, 1.02),
               title="per-position acceptance")
        ax.legend()
        written.append(_save(fig, out_dir / "per_position_acceptance.png"))

    others = {m: s for m, s in results["methods"].items() if m != "ar"}
    if others:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(others), [s["speedup"] or 0.0 for s in others.values()], color="tab:blue")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set(ylabel="speedup over ar (TPOT)", title=f"{results['dataset']}: speedup")
        written.append(_save(fig, out_dir / "speedup.png"))
    plt.close("all")
    return written, None


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path.name


def write_outputs(out_dir: Path, results: dict, rows: list[dict]) -> None:
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    with (out_dir / "per_prompt.jsonl").open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    plots, note = write_plots(out_dir, results)
    if note:
        print(f"[dflash] {note}", file=sys.stderr)
    (out_dir / "results.md").write_text(markdown_report(results, plots, note))
    print(markdown_table(results))
    mismatches = results["greedy_mismatches"]
    print(f"\ngreedy mismatches vs ar: "
          f"{mismatch_summary(results['mismatches']) if mismatches is not None else 'not compared (sampling)'}")
    if "ar_vs_hf_tokens_per_s" in results:
        print(f"ar vs transformers generate: {results['ar_vs_hf_tokens_per_s']:.2f}x hf tokens/s")
    print(f"results: {out_dir / 'results.json'}")
