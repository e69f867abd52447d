"""Draw a `dflash bench` folder's plots again from its results.json (the acceptance-length histogram, per-position
acceptance and speedup), e.g. for the bench folders under docs/data, which keep their JSON but not their PNGs.

Usage: .venv/bin/python scripts/replot_bench.py DIR [DIR ...]
"""

import json
import sys
from pathlib import Path

from dflash.bench_report import write_plots


def main(folders: list[str]) -> int:
    if not folders:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    for folder in map(Path, folders):
        results = folder / "results.json"
        if not results.is_file():
            print(f"{folder}: no results.json", file=sys.stderr)
            return 2
        written, note = write_plots(folder, json.loads(results.read_text()))
        print(note or "\n".join(written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
