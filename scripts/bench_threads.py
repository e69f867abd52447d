"""Decode step and 16-token verify pass on a quiet machine and beside one busy process (milliseconds).

Usage: .venv/bin/python scripts/bench_threads.py [float32|bfloat16] [--json FILE] [--beside PGID]

Why: a user's machine is rarely idle. Our C layers once opened ~180 OpenMP regions a step, and each region's
barrier waited for a thread the OS had descheduled in favour of another process: beside one busy process a 25 ms
step took 1.6 s. This measures that case directly: the busy process is a one-thread matrix product loop, started
and stopped between rounds so that the quiet and busy readings interleave. Each reading is the median of 15 passes,
for torch thread counts 1 and 2. `--beside PGID` takes a real job (say a `dflash data` run with --threads 1) as the
busy process instead: it is resumed (SIGCONT) for the busy readings and paused (SIGSTOP) for the quiet ones, and
left running at the end.
"""

import json
import os
import signal
import subprocess
import sys
import time

import torch

from dflash.loading import load_target_cached

BUSY = "import torch; torch.set_num_threads(1); a = torch.randn(512, 512)\nwhile True: a @ a"


def median_ms(target, cache, width: int, context: int, runs: int = 15) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        target.forward(torch.arange(5, 5 + width)[None], cache)
        times.append(time.perf_counter() - start)
        cache.truncate(context)
    return 1000 * sorted(times)[runs // 2]


def main(argv: list[str]) -> int:
    dtype = argv[0] if argv and not argv[0].startswith("--") else "float32"
    json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
    beside = int(argv[argv.index("--beside") + 1]) if "--beside" in argv else None
    target = load_target_cached("smollm2-135m", dtype, "cpu", "native")
    context = 200
    cache = target.new_cache(1, 512)
    target.forward(torch.arange(100, 100 + context)[None], cache)
    rows = []
    for round_ in range(2):
        for load in ("quiet", "busy"):
            busy = None
            if beside is not None:
                os.killpg(beside, signal.SIGCONT if load == "busy" else signal.SIGSTOP)
            elif load == "busy":
                busy = subprocess.Popen([sys.executable, "-c", BUSY])
            try:
                time.sleep(0.5 if busy else 0.0)
                for threads in (2, 1):
                    torch.set_num_threads(threads)
                    step, verify = median_ms(target, cache, 1, context), median_ms(target, cache, 16, context)
                    rows.append({"round": round_, "load": load, "threads": threads, "step_ms": step,
                                 "verify16_ms": verify})
                    print(f"round {round_}  {load:5}  {threads} threads  step {step:7.1f} ms  verify-16 "
                          f"{verify:7.1f} ms", flush=True)
            finally:
                if busy:
                    busy.kill()
                    busy.wait()
    if beside is not None:
        os.killpg(beside, signal.SIGCONT)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"dtype": dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
