"""The DFlash recipe ablation at equal compute (issue: a drafter that pays off on what users send).

Every variant trains from scratch on the same data for the same wall-clock minutes on one core: a short probe run
measures its steps/s, and the real run's warmup + cosine schedule is fitted to the steps that fit. Then each is
measured by its held-out surrogate tau (the trainer's last evaluation) and by `dflash bench` tau on GSM8K and
MT-Bench prompts (whole blocks, so tau does not depend on the adaptive controller).

Usage: .venv/bin/python scripts/ablate.py DATA OUT [--minutes 30] [--parallel 2] [--variants base,kl,...]
       (DATA: a packed corpus or a `dflash data` folder; OUT/results.json and OUT/results.md at the end)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

DFLASH = [sys.executable, "-m", "dflash.cli"]
BASE = ["--num-layers", "2", "--block-size", "16", "--loss", "ce", "--init", "random"]
VARIANTS = {  # name -> flags on top of BASE (later flags win)
    "base": [],
    "kl": ["--loss", "kl"],
    "target-init": ["--init", "target"],
    "block8": ["--block-size", "8"],
    "layers3": ["--num-layers", "3"],
    "layers5": ["--num-layers", "5"],
}
# 64 anchors per sequence, not the paper's 512: on one CPU core a 512-anchor step of a long ShareGPT sequence takes
# 10-15 s, so 30 minutes would see barely 150 sequences; at 64 each variant sees several times more data
COMMON = ["--target", "smollm2-135m", "--threads", "1", "--no-progress", "--anchors-per-seq", "64", "--epochs", "100",
          "--lr", "6e-4", "--eval-fraction", "0.05", "--seed", "0", "--draft-vocab", "8192"]


def train(variant: str, data: str, out: Path, extra: list[str]) -> None:
    argv = DFLASH + ["train", "--data", data, "--out", str(out), *COMMON, *BASE, *VARIANTS[variant], *extra]
    with open(out.with_suffix(".log"), "a") as log:
        subprocess.run(argv, check=True, stdout=log, stderr=subprocess.STDOUT)


def steps_per_second(variant: str, data: str, root: Path) -> float:
    probe = root / f"probe-{variant}"
    probe.mkdir(parents=True, exist_ok=True)
    train(variant, data, probe, ["--max-steps", "16", "--schedule-steps", "1000", "--log-every", "4",
                                 "--eval-every", "100000", "--save-every", "100000", "--eval-fraction", "0"])
    records = [json.loads(line) for line in (probe / "log.jsonl").read_text().splitlines()]
    rates = [r["steps_per_s"] for r in records if "steps_per_s" in r][1:]  # after the first (cold) window
    return len(rates) / sum(1 / r for r in rates)  # steps of very different lengths: the harmonic mean


def run_variant(variant: str, data: str, root: Path, minutes: float) -> dict:
    out = root / variant
    done = out / "result.json"
    if done.exists():  # a re-run after an interruption keeps the variants that finished
        return json.loads(done.read_text())
    plan = root / f"plan-{variant}.json"
    if plan.exists():  # interrupted mid-training: keep the step budget measured before, resume its checkpoint
        rate, steps = json.loads(plan.read_text())
    else:
        rate = steps_per_second(variant, data, root)
        steps = max(10, int(minutes * 60 * rate))
        plan.write_text(json.dumps([rate, steps]))
    checkpoints = list((out / "checkpoints").glob("step-*"))
    if not checkpoints:
        shutil.rmtree(out, ignore_errors=True)
    started = time.perf_counter()
    # --schedule-steps fixes the schedule, so a variant cut short resumes from its checkpoint on the same curve
    train(variant, data, out, ["--schedule-steps", str(steps), "--max-steps", str(steps), "--log-every", "20",
                               "--eval-every", str(max(1, steps // 2)), "--save-every", str(max(1, steps // 6))]
          + (["--resume"] if checkpoints else []))
    evals = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    last = [r for r in evals if "eval_tau" in r][-1]
    result = {"variant": variant, "flags": " ".join(BASE + VARIANTS[variant]), "probe_steps_per_s": rate,
              "steps": steps, "train_minutes": round((time.perf_counter() - started) / 60, 1),
              "heldout_tau": last["eval_tau"], "heldout_loss": last["eval_loss"]}
    done.write_text(json.dumps(result, indent=2) + "\n")
    return result


def bench_tau(result: dict, root: Path) -> dict:
    final = root / result["variant"] / "final"
    for dataset, limit in (("gsm8k", 5), ("mt_bench", 3)):
        out = root / f"bench-{result['variant']}-{dataset}"
        if (out / "results.json").exists():
            result[f"{dataset}_tau"] = json.loads((out / "results.json").read_text())["methods"]["dflash:whole"]["tau"]
            continue
        subprocess.run(DFLASH + ["bench", "--dataset", dataset, "--limit", str(limit), "--methods", "ar,dflash:whole",
                                 "--drafter", f"dflash={final}", "--max-new-tokens", "128", "--threads", "1",
                                 "--no-progress", "--out", str(out)], check=True, capture_output=True)
        methods = json.loads((out / "results.json").read_text())["methods"]
        result[f"{dataset}_tau"] = methods["dflash:whole"]["tau"]
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data")
    p.add_argument("out")
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--parallel", type=int, default=2, help="variants trained at once, one core each")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    names = args.variants.split(",")
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda v: run_variant(v, args.data, root, args.minutes), names))
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda r: bench_tau(r, root), results))
    (root / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = ["| variant | flags | steps (min) | held-out tau | GSM8K tau | MT-Bench tau |", "|---|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['variant']} | `{r['flags']}` | {r['steps']} ({r['train_minutes']}) | "
                     f"{r['heldout_tau']:.3f} | {r['gsm8k_tau']:.2f} | {r['mt_bench_tau']:.2f} |")
    (root / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
