"""`dflash bench --batch N`: throughput, where the plain bench times one generation at a time. Each method answers
the dataset's prompts (their first turn) as one continuous batch of up to N rows at a time through a fresh engine,
as a server under load or vLLM's `bench throughput` would run them; the methods take turns, in alternating order,
for --batch-runs timed runs after one warm-up, and every run's outputs must be the first method's (greedy, or seeded
sampling). A table (seconds, tokens/s, the ratio to `ar`, tau) and results.json.

In a batch, every row's round costs one target pass whose width is the widest row's block: drafts that a single
sequence verifies almost for free make a batched pass wider, which is why speculation gains less at larger
batches (docs/RESULTS.md has the measurements behind the controller's choices)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from .errors import UserError

BATCH_RUNS = 3


def run(args) -> int:
    from .bench import (BASELINES, default_out, machine_info, parse_method, parse_methods, read_prompts,
                        resolve_dataset)
    from .engine import Engine, GenerationConfig
    from .loading import build_proposer, settle_heap, target_from_args
    from .options import check_drafter_folders, method_options
    from .sampling import SamplingConfig

    if args.batch < 1 or args.batch_runs < 1:
        raise UserError(f"--batch and --batch-runs must be >= 1, got {args.batch} and {args.batch_runs}")
    methods = parse_methods(args.methods)
    specs = {method: parse_method(method) for method in methods}
    baselines = [method for method, spec in specs.items() if spec.name in BASELINES]
    if baselines:
        raise UserError(f"--batch runs dflash's engine: {', '.join(baselines)} cannot run in it; leave them out")
    path, template = resolve_dataset(args.dataset, args.template)
    prompts = read_prompts(path, template, args.limit)
    check_drafter_folders(args.drafter, [spec.name for spec in specs.values()])
    out_dir = Path(args.out or default_out(args.dataset))
    target = target_from_args(args, many_rows=True, release_plain=True)
    proposers = {}
    for method, spec in specs.items():
        options = method_options(args, spec.name, spec.size, several=True, tree=spec.tree)
        proposer, note = build_proposer(spec.name, target, options)
        if note:
            print(f"[dflash] {method}: {note}", file=sys.stderr)
        proposers[method] = (proposer, not (spec.whole_blocks or args.whole_blocks))
    settle_heap()
    sampling = SamplingConfig(temperature=args.temperature, seed=args.seed if args.temperature > 0 else None)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, sampling=sampling, ignore_eos=args.ignore_eos)
    prompt_ids = [target.encode_prompt(prompt.turns[0]) for prompt in prompts]
    for proposer, _ in proposers.values():  # every prompt fits every method's context, said before anything runs
        checking = Engine(target, proposer)
        for ids in prompt_ids:
            checking.budget(ids)
    for proposer, adaptive in proposers.values():  # kernels, caches and the controller's first timings
        batch_run(target, proposer, adaptive, prompt_ids[: args.batch], GenerationConfig(max_new_tokens=8), args.batch)
    runs = {method: [] for method in methods}
    reference, mismatched = None, []
    comparable = sampling.greedy or sampling.seed is not None
    for turn in range(args.batch_runs):
        for method in methods if turn % 2 == 0 else methods[::-1]:
            proposer, adaptive = proposers[method]
            timed = batch_run(target, proposer, adaptive, prompt_ids, config, args.batch)
            runs[method].append(timed)
            reference = reference or timed["outputs"]
            if comparable and timed["outputs"] != reference and method not in mismatched:
                mismatched.append(method)
            print(f"run {turn + 1} {method}: {timed['seconds']:.2f} s, tau {timed['tau']:.2f}", file=sys.stderr)
    results = summary(args, methods, runs, len(prompt_ids), mismatched, comparable)
    results["machine"] = machine_info(target)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print(f"results: {out_dir / 'results.json'}")
    if mismatched:
        print(f"dflash bench: {', '.join(mismatched)} gave other outputs than {methods[0]}", file=sys.stderr)
        return 1
    return 0


def batch_run(target, proposer, adaptive: bool, prompt_ids: list[list[int]], config, rows: int) -> dict:
    """One method's answers to every prompt, up to `rows` at a time, through a fresh engine: seconds, tokens, tau."""
    from .engine import Engine

    engine = Engine(target, proposer, max_batch=rows, adaptive=adaptive)
    sequences = [engine.submit(ids, config) for ids in prompt_ids]
    start = time.perf_counter()
    engine.run()
    seconds = time.perf_counter() - start
    outputs = [seq.result.tokens for seq in sequences]
    committed = sum(sum(seq.result.stats.accept_lengths) for seq in sequences)  # tau counts rounds' tokens (spec)
    rounds = sum(seq.result.stats.num_rounds for seq in sequences)
    return {"seconds": seconds, "tokens": sum(len(tokens) for tokens in outputs), "tau": committed / max(1, rounds),
            "outputs": outputs}


def summary(args, methods: list[str], runs: dict, prompts: int, mismatched: list[str], comparable: bool) -> dict:
    """Each method's median run, and its time against the first method's (`ar`) run by run."""
    base = runs[methods[0]]
    results = {"command": f"dflash bench --batch {args.batch} --batch-runs {args.batch_runs} --dataset {args.dataset} "
                          f"--methods {args.methods} --target {args.target} --max-new-tokens {args.max_new_tokens} "
                          f"--temperature {args.temperature} --dtype {args.dtype}"
                          + (f" --limit {args.limit}" if args.limit is not None else ""),
               "dataset": args.dataset, "prompts": prompts, "batch": args.batch, "runs": args.batch_runs,
               "outputs_compared": comparable, "mismatched": mismatched, "methods": {}}
    for method in methods:
        seconds = [run["seconds"] for run in runs[method]]
        ratios = [b["seconds"] / run["seconds"] for b, run in zip(base, runs[method])]
        tokens = runs[method][0]["tokens"]
        results["methods"][method] = {
            "seconds": statistics.median(seconds), "seconds_by_run": seconds, "tokens": tokens,
            "tokens_per_s": tokens / statistics.median(seconds), "speedup": statistics.median(ratios),
            "tau": statistics.median(run["tau"] for run in runs[method])}
    return results


def table(results: dict) -> str:
    first = next(iter(results["methods"]))
    lines = [f"{results['dataset']}: {results['prompts']} prompts, up to {results['batch']} at a time, medians of "
             f"{results['runs']} runs" + (", outputs identical" if results["outputs_compared"] and not
                                          results["mismatched"] else ""),
             f"{'method':24s} {'seconds':>8s} {'tok/s':>8s} {'x ' + first:>10s} {'tau':>6s}"]
    for method, figures in results["methods"].items():
        lines.append(f"{method:24s} {figures['seconds']:8.2f} {figures['tokens_per_s']:8.1f} "
                     f"{figures['speedup']:9.2f}x {figures['tau']:6.2f}")
    return "\n".join(lines)
