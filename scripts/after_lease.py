"""After a lease: from the runs' tars to one table of candidate drafters scored on the held-out split, resumable.

Usage: .venv/bin/python scripts/after_lease.py [--jobs N] FILES WORK [RUN ...]

FILES is the folder a lease's $OUT came back to (RUN.tar.part00, RUN.tar.part01, ... from scripts/lease/fetch.sh),
WORK where the runs are unpacked and the candidates made (e.g. runs/after-lease), RUN the runs to read (default:
every RUN.tar.part00 in FILES). Steps, the post-lease protocol of docs/TRAINING.md:
  1. each run's tar joined and unpacked into WORK/RUN, and its log's last held-out figures (eval_tau, the GPU's);
  2. the shipped drafter (WORK/base, a copy: the one the runs started from) and each run scored on the corpus's
     held-out split, one thread: scripts/eval_heldout.py dflash DIR corpus/smollm2-135m 128 float32 0.006
     (286 s alone on the AMD EPYC Zen 4 of the sixty-fourth session);
  3. where two or more runs came back, the mean of the two best (WORK/mean: every weight averaged, a "model soup"
     of runs that left one warm start side by side), scored alike;
  4. the run with the highest held-out decode tau (then surrogate tau) extrapolated along its stage,
     RUN + alpha x (RUN - base) for alpha 0.3, 0.6 and 1.0 (scripts/extrapolate_drafter.py), and scored alike.
Each score is kept beside its drafter (heldout.txt), so a call after a crash or in the next session scores only what
is missing (the shipped drafter's folder carries its own). Steps 2 and 3-4 score their drafters N at a time (--jobs,
default: one per core; each scoring runs on one thread, so its figures do not depend on N): two at once took 312 and
314 s there, so on 2 cores the candidates take about half as long, and the benches of what ships wait on them.
WORK/summary.md and WORK/summary.json hold the table. What ships, and the benches that confirm it, stay with you
(docs/TRAINING.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "src/dflash/drafters/smollm2-135m-dflash"
ALPHAS = (0.3, 0.6, 1.0)
SCORE_FILE = "heldout.txt"
LINE = re.compile(r"eval_tau (?P<tau>[\d.]+), eval_decode_tau (?P<decode>[\d.]+), eval_loss (?P<loss>[\d.]+)")


def heldout_scores(folder: Path) -> str:
    """The held-out protocol's one line for the drafter in `folder` (one thread, as every figure in TRAINING.md)."""
    command = [sys.executable, str(ROOT / "scripts/eval_heldout.py"), "dflash", str(folder),
               str(ROOT / "corpus/smollm2-135m"), "128", "float32", "0.006"]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"scoring {folder} failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip().splitlines()[-1]


def digest(folder: Path) -> str:
    return hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()


def scored(folder: Path, evaluate) -> dict:
    """{tau, decode, loss} of `folder`, from its heldout.txt when an earlier call left one for these weights (the
    shipped drafter's folder carries its own: one drafter less to score after every lease)."""
    kept = folder / SCORE_FILE
    if not kept.is_file() or f"sha256 {digest(folder)}" not in kept.read_text():
        print(f"scoring {folder} on the held-out split ...", flush=True)
        kept.write_text(f"{evaluate(folder)}\nmodel.safetensors sha256 {digest(folder)}\n")
    match = LINE.search(kept.read_text())
    if match is None:
        raise SystemExit(f"{kept} holds no held-out figures: delete it to score {folder} again")
    return {key: float(value) for key, value in match.groupdict().items()}


def scored_all(folders: list[Path], evaluate, jobs: int) -> list[dict]:
    """`scored` of each folder, `jobs` at a time (each scoring is a process of its own: threads only wait on them)."""
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        return list(pool.map(lambda folder: scored(folder, evaluate), folders))


def unpack(files: Path, run: str, work: Path) -> Path:
    folder = work / run
    if (folder / "model.safetensors").is_file():
        return folder
    parts = sorted(files.glob(f"{run}.tar.part*"))
    if not parts:
        raise SystemExit(f"no {run}.tar.part* in {files}")
    folder.mkdir(parents=True, exist_ok=True)
    joined = b"".join(part.read_bytes() for part in parts)
    subprocess.run(["tar", "-x", "-C", str(folder)], input=joined, check=True)
    if not (folder / "model.safetensors").is_file():
        raise SystemExit(f"{run}'s tar holds no model.safetensors")
    return folder


def last_gpu_eval(folder: Path) -> dict:
    """The last held-out line of the run's own log (its GPU's figures: 512 anchors, so not the table's scale)."""
    log = folder / "log.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines() if '"eval_tau"' in line] if log.is_file() else []
    return {key: lines[-1][key] for key in ("step", "eval_tau", "eval_decode_tau") if key in lines[-1]} if lines else {}


def extrapolate(run: Path, base: Path, alpha: float, out: Path) -> Path:
    if not (out / "model.safetensors").is_file():
        done = subprocess.run([sys.executable, str(ROOT / "scripts/extrapolate_drafter.py"), str(run), str(base),
                               str(alpha), str(out)], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"extrapolating {run} failed: {done.stderr.strip()}")
    return out


def averaged(runs: list[Path], out: Path) -> Path:
    """The two runs' mean, every weight (a + b) / 2, made as a + (-0.5) x (a - b) by scripts/extrapolate_drafter.py
    (its checks, the same tensors and shapes, come with it)."""
    first, second = runs
    if (first / "config.json").read_text() != (second / "config.json").read_text():
        raise SystemExit(f"the runs {first} and {second} have different configs: no mean of them")
    return extrapolate(first, second, -0.5, out)


def main(argv: list[str], evaluate=heldout_scores, shipped: Path = SHIPPED) -> int:
    jobs = os.cpu_count() or 1
    if argv[:1] == ["--jobs"] and len(argv) > 1 and argv[1].isdigit() and int(argv[1]) >= 1:
        jobs, argv = int(argv[1]), argv[2:]
    if len(argv) < 2 or argv[0].startswith("--"):
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    files, work = Path(argv[0]), Path(argv[1])
    runs = argv[2:] or sorted(p.name.removesuffix(".tar.part00") for p in files.glob("*.tar.part00"))
    if not runs:
        print(f"no RUN.tar.part00 in {files}", file=sys.stderr)
        return 2
    base = work / "base"
    if not (base / "model.safetensors").is_file():
        shutil.copytree(shipped, base, dirs_exist_ok=True)
    elif digest(base) != digest(shipped):  # the runs started from the shipped drafter: extrapolate from it
        print(f"{work} holds an earlier lease's drafters (its base is not the shipped drafter): give a new WORK",
              file=sys.stderr)
        return 2
    folders = [unpack(files, run, work) for run in runs]
    scores = scored_all([base, *folders], evaluate, jobs)
    rows = [{"name": "base (shipped)", "folder": str(base), **scores[0]}]
    rows += [{"name": run, "folder": str(folder), "gpu_eval": last_gpu_eval(folder), **score}
             for run, folder, score in zip(runs, folders, scores[1:])]
    best = max(rows[1:], key=lambda row: (row["decode"], row["tau"]))
    candidates = []  # (name, folder): made from the runs' scores, then scored together
    if len(runs) > 1:
        # two runs side by side made 1.86x the steps of one on an H200 (sixty-third session); their mean is one
        # drafter again, and there it tied the better run (docs/TRAINING.md, stage 17)
        pair = sorted(rows[1:], key=lambda row: (row["decode"], row["tau"]))[-2:]
        pair = [row for row in rows[1:] if row in pair]  # in the runs' order
        candidates.append((f"mean of {pair[0]['name']}, {pair[1]['name']}",
                           averaged([Path(row["folder"]) for row in pair], work / "mean")))
    for alpha in ALPHAS:
        candidates.append((f"{best['name']} + {alpha} x ({best['name']} - base)",
                           extrapolate(Path(best["folder"]), base, alpha, work / f"{best['name']}-x{alpha}")))
    scores = scored_all([folder for _, folder in candidates], evaluate, jobs)
    rows += [{"name": name, "folder": str(folder), **score} for (name, folder), score in zip(candidates, scores)]
    (work / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    table = ["| drafter | held-out surrogate tau | decode tau | loss | the run's own last eval (GPU) |",
             "|---|---:|---:|---:|---|"]
    for row in rows:
        gpu = row.get("gpu_eval") or {}
        own = ", ".join(f"{key} {value:.3f}" if isinstance(value, float) else f"{key} {value}"
                        for key, value in gpu.items())
        table.append(f"| {row['name']} | {row['tau']:.3f} | {row['decode']:.3f} | {row['loss']:.3f} | {own} |")
    (work / "summary.md").write_text("\n".join(table) + "\n")
    print("\n".join(table))
    print(f"\n{work / 'summary.md'}; the benches of the chosen one: docs/TRAINING.md, the post-lease protocol")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
