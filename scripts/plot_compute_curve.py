"""GSM8K whole-block tau of each shipped drafter stage against the training core-minutes behind it.

Usage: .venv/bin/python scripts/plot_compute_curve.py [docs/data/compute_curve.json] [docs/img/compute_curve.png]
The points and the command that measured them are in the JSON file (docs/TRAINING.md, "Where the drafter stands").
"""

import json
import sys
from pathlib import Path

from plot_training import save_figure

LABELS = {"dflash": "DFlash (2 layers, block 16)", "eagle3": "EAGLE-3 (1 layer, depth 7)"}


def gpu_minutes(point: dict) -> str:
    """A GPU stage's minutes on each kind of GPU behind it, e.g. "23.7 H100-minutes + 7.1 H200-minutes"."""
    kinds = [(key.removesuffix("_minutes").upper(), minutes) for key, minutes in point.items()
             if key.endswith("_minutes") and key != "core_minutes"]
    return " + ".join(f"{minutes} {kind}-minutes" for kind, minutes in kinds)


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    source = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/data/compute_curve.json")
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "docs/img/compute_curve.png")
    data = json.loads(source.read_text())
    fig, ax = plt.subplots(figsize=(10, 4))
    for method, label in LABELS.items():
        points = data[method]
        ax.plot([p["core_minutes"] for p in points], [p["tau"] for p in points], marker="o", label=label)
        for p in points:
            ax.annotate(f"s{p['stage']}", (p["core_minutes"], p["tau"]), textcoords="offset points", xytext=(4, -10),
                        fontsize=8)
        print(f"| {label} | " + " | ".join(f"{p['core_minutes']} min: {p['tau']:.2f}" for p in points) + " |")
    # a GPU stage: its CPU core-minutes on the axis, its GPU minutes in words
    for i, p in enumerate(data.get("dflash_gpu", [])):
        extrapolated = ", extrapolated (no training)" if p.get("extrapolated") else ""
        ax.plot([p["core_minutes"]], [p["tau"]], marker="*", markersize=12, linestyle="none", color=f"C{2 + i}",
                label=f"DFlash + {gpu_minutes(p)}{extrapolated}")
        ax.annotate(f"s{p['stage']}", (p["core_minutes"], p["tau"]), textcoords="offset points", xytext=(6, 2),
                    fontsize=8)
        print(f"| DFlash, stage {p['stage']} | {p['core_minutes']} core-min + {gpu_minutes(p)}: {p['tau']:.2f} |")
    ax.set_xscale("log")
    ax.margins(x=0.08)  # room for the GPU stages' labels at the right edge
    save_figure(fig, ax, out, "training compute (CPU core-minutes, log scale)", "GSM8K tau, whole blocks",
                legend_outside=True)


if __name__ == "__main__":
    main()
