"""Held-out surrogate tau against training sequences seen, for runs continued over several stages.

Usage: .venv/bin/python scripts/plot_training.py OUT.png LABEL=RUN_DIR[:LAST_STEP][,RUN_DIR...] [LABEL=...]
Each RUN_DIR is a `dflash train --out` folder; the stages of one label are chained: a stage's steps continue after
the previous stage's LAST_STEP (the checkpoint the next stage started from; default its last logged step).
Also prints the points as a Markdown table.
"""

import json
import sys
from pathlib import Path


def held_out_curve(run_dirs: list[str]) -> list[tuple[int, float]]:
    points, offset = [], 0
    for spec in run_dirs:
        run, _, last = spec.partition(":")
        records = [json.loads(line) for line in (Path(run) / "log.jsonl").read_text().splitlines() if line]
        last_step = int(last) if last else max((r["step"] for r in records), default=0)
        evals = [(r["step"], r["eval_tau"]) for r in records if "eval_tau" in r and r["step"] <= last_step]
        points += [(offset + step, tau) for step, tau in evals]
        offset += last_step
    return points


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, specs = sys.argv[1], sys.argv[2:]
    fig, ax = plt.subplots(figsize=(7, 4))
    for spec in specs:
        label, runs = spec.split("=", 1)
        curve = held_out_curve(runs.split(","))
        ax.plot([s for s, _ in curve], [t for _, t in curve], marker="o", markersize=3, label=label)
        print(f"| {label} | " + " | ".join(f"{s}: {t:.2f}" for s, t in curve) + " |")
    save_figure(fig, ax, out, "training sequences seen (one sequence per step)", "held-out surrogate tau")


def save_figure(fig, ax, out, xlabel: str, ylabel: str, legend_outside: bool = False) -> None:
    """The finish every training plot shares: axis labels, a light grid, the legend, 100 dpi. legend_outside puts
    the legend right of the axes, for a plot whose points fill every corner."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if legend_outside:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    else:
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()
