"""What a round asks of the host around its CUDA graphs: the torch ops dispatched outside the graphed calls (each a
kernel launch or more on a GPU) and the reads back to the host (each a wait for the GPU), per `ar` step and per
DFlash round, counted on the CPU through the graphs' bookkeeping run eagerly (`use_graphs(capture=False)`).

An H100 ran a graphed decode step in 3.3 ms and a whole-block DFlash round in 6.9 ms (docs/RESULTS.md,
thirty-fourth session). This says what a round launches outside its graphs, and how many ops each graph holds.

Usage: .venv/bin/python scripts/graph_host_ops.py [METHODS] [NEW] (defaults ar,dflash:whole 48; one GSM8K prompt,
float32 SmolLM2; run from the repository root: ../shared/data)
Prints, per method, ops and host reads per round outside the graphs, the commonest ops, and the ops that launch work
inside each kind of graph (on a GPU each a kernel: what a replay costs when kernels, not bytes, bound it).
"""

import collections
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.bench import read_prompts, resolve_dataset
from dflash.engine import Engine, GenerationConfig, SpeculativeDecoder
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions
from dflash.models import graphs

HOST_READS = ("tolist", "item")  # a device tensor read on the host: a sync on a GPU
# ops that make views or nothing, no kernel on a GPU (inside the graphs; `empty` stands for a C product's output here,
# whose product on a GPU is a kernel of its own: counted as such)
VIEWS = {"view", "alias", "reshape", "unsqueeze", "squeeze", "transpose", "t", "slice", "select", "expand", "permute",
         "_unsafe_view", "as_strided", "detach", "lift_fresh", "split", "chunk", "unbind", "split_with_sizes",
         "contiguous"}


class Counter(TorchDispatchMode):
    """Counts the aten ops dispatched while no graphed call runs (inside one they are the graph's, replayed free)."""

    def __init__(self):
        super().__init__()
        self.ops, self.inside = collections.Counter(), 0
        self.op_seconds = self.left_out_seconds = 0.0  # in the counted ops; in what the count leaves out
        self.graph_ops = 0  # ops that launch work (not views), inside the graphed calls
        self.replays = collections.Counter()  # graphed calls by kind
        self.replay_ops = collections.Counter()  # their ops that launch work, by kind

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.inside:
            if str(func.overloadpacket.__name__) not in VIEWS:
                self.graph_ops += 1
            return func(*args, **(kwargs or {}))
        self.ops[str(func.overloadpacket.__name__)] += 1
        started = time.perf_counter()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.op_seconds += time.perf_counter() - started


def uncounted(owner, name: str, counter: Counter) -> None:
    """Leave `owner.name`'s ops out of the count."""
    method = getattr(owner, name)

    def wrapped(*args, **kwargs):
        counter.inside += 1
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            counter.inside -= 1
            if not counter.inside:
                counter.left_out_seconds += time.perf_counter() - started

    setattr(owner, name, wrapped)


def counted(counter: Counter):
    """Leave out the graphed calls (their ops are the graph's: counted apart, by kind) and the prompt's pass (once a
    generation, eager), and count the host reads as ops named 'host:...'."""
    replay = graphs.CapturedCall.replay

    def counted_replay(self, pool=None):
        before = counter.graph_ops
        try:
            return replay(self, pool)
        finally:
            kind = "drafter" if "block_embeds" in self.inputs else f"target, {self.inputs['ids'].shape[1]} wide"
            counter.replays[kind] += 1
            counter.replay_ops[kind] += counter.graph_ops - before

    graphs.CapturedCall.replay = counted_replay
    uncounted(graphs.CapturedCall, "replay", counter)
    uncounted(Engine, "_read_prompt", counter)
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def read(self, *a, _original=original, _name=name, **k):
            if not counter.inside:
                counter.ops["host:" + _name] += 1
            return _original(self, *a, **k)

        setattr(torch.Tensor, name, read)


def main(argv: list[str]) -> int:
    methods, new = (argv + ["ar,dflash:whole", "48"][len(argv):])[:2]
    torch.set_num_threads(2)
    target = load_target_cached("smollm2-135m", "float32")
    target.use_graphs(capture=False)
    path, template = resolve_dataset("gsm8k")
    prompt = target.encode_prompt(read_prompts(path, template, 1)[0].turns[0])
    config = GenerationConfig(max_new_tokens=int(new), ignore_eos=True)
    counter = Counter()
    counted(counter)
    for method in methods.split(","):
        name, _, mode = method.partition(":")
        # a float32 drafter runs torch's ops, as on a GPU (on a CPU `auto` may draft through C)
        drafts = name.split("+")[0] in ("dflash", "eagle3")
        proposer, _ = build_proposer(name, target, MethodOptions(draft_dtype="float32") if drafts else MethodOptions())
        decoder = SpeculativeDecoder(target, proposer, adaptive=mode != "whole")
        decoder.generate(prompt, config)  # warm: caches, graphs' buffers, calibration
        counter.ops.clear(), counter.replays.clear(), counter.replay_ops.clear()
        counter.op_seconds = counter.left_out_seconds = 0.0
        started = time.perf_counter()
        with counter:
            result = decoder.generate(prompt, config)
        seconds = time.perf_counter() - started
        rounds = max(1, result.stats.num_rounds)
        reads = sum(v for k, v in counter.ops.items() if k.startswith("host:"))
        ops = sum(counter.ops.values()) - reads
        print(f"{method}: {rounds} rounds, tau {result.stats.tau:.2f}; per round outside the graphs: "
              f"{ops / rounds:.1f} ops, {reads / rounds:.2f} host reads; here, ms a round: "
              f"{1e3 * (seconds - counter.left_out_seconds - counter.op_seconds) / rounds:.2f} of Python around "
              f"{1e3 * counter.op_seconds / rounds:.2f} in those ops (dispatch included)")
        print("   " + ", ".join(f"{k} {v / rounds:.1f}" for k, v in counter.ops.most_common(14)))
        print("   inside the graphs, ops that launch work a call (products included): " + ", ".join(
            f"{kind} {counter.replay_ops[kind] / n:.0f} ({n} calls)" for kind, n in counter.replays.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
