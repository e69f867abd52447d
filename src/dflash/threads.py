"""How many CPU threads the target's passes run on, chosen by timing them while generating.

Why: a user's CPU is rarely idle. When another process holds one of the cores, our threads wait for it: on 2 AMD
EPYC cores beside a one-thread `dflash data` job a float32 step took 100-136 ms on 2 threads and 50-70 ms on 1, a
16-token verify 168-248 ms against 75-120 (scripts/bench_threads.py --beside, docs/RESULTS.md). On a quiet machine
2 threads win by ~1.6x. Which case holds changes while a job runs, so it is measured, not configured: every so
often one target pass runs on one thread fewer (a probe), and two probes in a row that beat the current count by
10% switch to it; probes that lose come half as often, down to one in MAX_GAP passes (under 1% of the time on a
quiet machine). The first probe comes early (FIRST_PROBE): beside a busy core a pass on both threads can cost 5x one
on a single thread (twenty-fifth session), so a short generation cannot wait long to find out. A count's figure is
its cheapest pass until it has run MIN_PASSES, not their average, and a winning probe is confirmed only after one
more pass on the current count: one slow first pass cannot make a probe look good.

Pass times are compared per unit of work: the caller divides a pass's seconds by its relative cost (the engine's
CostModel: a 16-token verify costs ~1.5-2 steps), so passes of different widths compare. An engine runs each of its
steps (drafting included) on its chosen count and gives torch its own count back after it, so engines side by side
(`dflash bench` interleaves methods) and transformers' `generate` never run on another engine's choice.

`dflash ... --threads N` pins the count (`pin()`), as does a count of 1 or a target off the CPU. Results do not
depend on the count: our C kernels compute every output on one thread in a fixed order (tests/test_native.py).
"""

from __future__ import annotations

from typing import Callable

import torch

FIRST_PROBE = 2  # the pass that probes first
MIN_PASSES = 4  # until a count has run this many passes, its figure is its cheapest
PROBE_EVERY = 16  # passes between probes after the first one, and after every switch
MAX_GAP = 128  # the most passes between probes: how long a change of load can go unnoticed
MARGIN = 0.9  # a probe wins when its pass costs under 90% of the current count's average
WINS_TO_SWITCH = 2  # consecutive winning probes: one lucky pass does not move us
SMOOTHING = 0.2

_pinned = False


def pin() -> None:
    """Keep torch's thread count as it is (the CLI's --threads)."""
    global _pinned
    _pinned = True


def unpin() -> None:
    global _pinned
    _pinned = False


def chooser_for(device: torch.device | str) -> ThreadChooser | None:
    """A chooser between torch's current thread count n and n - 1, or None where the count stays as it is."""
    threads = torch.get_num_threads()
    if _pinned or torch.device(device).type != "cpu" or threads < 2:
        return None
    return ThreadChooser((threads, threads - 1))


class ThreadChooser:
    """Call `before_pass()` before each target pass and `after_pass(cost)` after it, with the pass's seconds per
    unit of relative cost. `current` is the count in use between probes."""

    def __init__(self, counts: tuple[int, int], set_threads: Callable[[int], None] = torch.set_num_threads):
        self.counts = counts
        self.current = counts[0]
        self.set_threads = set_threads
        self.average: dict[int, float] = {}  # a pass's cost per unit on each count, smoothed
        self.measured: dict[int, int] = {}  # passes timed on each count since it became current
        self.gap = PROBE_EVERY
        self.until_probe = FIRST_PROBE
        self.wins = 0
        self.probing: int | None = None
        self.probes = self.switches = 0

    def _other(self) -> int:
        return self.counts[1] if self.current == self.counts[0] else self.counts[0]

    def before_pass(self) -> None:
        self.until_probe -= 1
        if self.until_probe <= 0 and self.current in self.average:
            self.probing = self._other()
            self.probes += 1
            self.set_threads(self.probing)

    def after_pass(self, cost: float) -> None:
        if self.probing is None:
            old, measured = self.average.get(self.current), self.measured.get(self.current, 0)
            if old is None or measured < MIN_PASSES:
                self.average[self.current] = cost if old is None else min(old, cost)
            else:
                self.average[self.current] = old + SMOOTHING * (cost - old)
            self.measured[self.current] = measured + 1
            return
        probed, self.probing = self.probing, None
        if cost < MARGIN * self.average[self.current]:
            self.wins += 1
            if self.wins >= WINS_TO_SWITCH:
                self.current, self.wins, self.switches = probed, 0, self.switches + 1
                self.average[probed] = cost  # the old average of this count is from another load
                self.measured[probed] = 1
                self.gap = PROBE_EVERY
            self.until_probe = 2 if self.wins else self.gap  # a first win is checked after one more current pass
        else:
            self.wins = 0
            self.gap = min(2 * self.gap, MAX_GAP)
            self.until_probe = self.gap
        self.set_threads(self.current)
