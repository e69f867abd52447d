"""What one speculative round costs on this machine, against the weight-bandwidth bound (milliseconds).

Usage: .venv/bin/python scripts/profile_round.py [float32|bfloat16|int8] [THREADS] [--json FILE]

The bound: a decode step must read every weight once, so it cannot beat weight bytes / memory bandwidth. The
bandwidth is measured in the same run, two ways: a read-only pass over a buffer the size of the model (`sum`), and
the best kernel's matrix-vector product over a matrix of that size, each the median of readings before, between and
after the passes. Reported: our forward (dflash's engine) and
transformers' forward for a 1-token step and verify passes of 2-16 tokens (with features, logits at every position),
ours also for a 16-token pass whose logits stop at the first FIRST_LOGITS positions (engine.py: a round whose
drafts fail there) and one without logits (its decoder layers alone), a round's drafting pass (after a target
step, reading a round's few new tokens: best_drafting_seconds), and each step's ratio to the bound. Medians of 10 runs each; the engine is warmed up first.
"""

import json
import sys
import time

import torch

from dflash.engine import FIRST_LOGITS
from dflash.loading import build_proposer, load_target_cached
from dflash.methods.base import MethodOptions, best_drafting_seconds
from dflash.models.kernels import FrozenLinear
from dflash.models.target import TargetModel


def median_ms(fn, runs: int = 10) -> float:
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[runs // 2]


def bandwidth_gb_s(weight_bytes: int, dtype: torch.dtype) -> dict:
    """GB/s of a read-only pass over `weight_bytes` and of the best matvec over a [N, 576] matrix of that size."""
    element = torch.empty((), dtype=dtype).element_size()
    # the read pass sums float32 whatever the model's dtype: a bf16 sum is bound by its conversions on CPUs without
    # native bf16 arithmetic (14 against 22 GB/s on AVX2), which would flatter every bf16 ratio
    read_buffer = torch.ones(weight_bytes // 4, dtype=torch.float32)
    read_ms = median_ms(lambda: read_buffer.sum(), runs=5)
    del read_buffer
    buffer = torch.ones(weight_bytes // element, dtype=dtype)
    matrix = buffer.view(-1, 576)[: (weight_bytes // element) // 576]
    frozen = FrozenLinear(matrix)
    x = torch.randn(1, 576, dtype=dtype)
    with torch.inference_mode():
        matvec_ms = min(median_ms(lambda k=k: frozen.run(x, k), runs=5) for k in frozen.kernels())
    return {"read": weight_bytes / read_ms / 1e6, "matvec": matrix.numel() * element / matvec_ms / 1e6}


def profile(target: TargetModel, layers: tuple[int, ...], widths=(1, 2, 3, 4, 8, 16)) -> dict[int, float]:
    prompt = target.encode_prompt("Janet's ducks lay 16 eggs per day. How much does she make every day?")
    cache = target.new_cache(capacity=512)
    target.forward(torch.tensor([prompt]), cache)
    length = len(cache)

    def verify(n):
        def run():
            target.forward(torch.tensor([[5] * n]), cache, layers if n > 1 else ())
            cache.truncate(length)
        return run

    def stepped():  # a 16-token round as the engine runs it when a draft within the first FIRST_LOGITS fails
        hidden = target.forward(torch.tensor([[5] * 16]), cache, layers, logits_at="hidden").hidden
        target.logits_of(hidden[:, :FIRST_LOGITS]).argmax(-1).tolist()
        cache.truncate(length)

    def layers_only():  # the decoder layers of a 16-token pass: what no choice of logits can take off
        target.forward(torch.tensor([[5] * 16]), cache, layers, logits_at="none")
        cache.truncate(length)

    times = {n: median_ms(verify(n)) for n in widths}
    if target.defers_logits:  # ours (transformers computes the logits inside its forward whatever we ask)
        times["16 stepped"] = median_ms(stepped)
        times["16 no logits"] = median_ms(layers_only)
    return times


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    dtype = args[0] if args else "float32"
    torch.set_num_threads(int(args[1]) if len(args) > 1 else 2)
    out_file = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    target = load_target_cached("smollm2-135m", dtype)
    proposer, _ = build_proposer("dflash", target, MethodOptions(draft_dtype="auto"))
    layers = proposer.feature_layers
    weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    if target.int8:  # the decoder products' weights are read as a byte each (where our kernels read int8)
        weight_bytes -= sum(lin.weight.numel() for lin in target.engine.frozen_linears() if lin.int8_weights())
    hf = TargetModel(target.model, target.tokenizer, target.name, prefer_transformers=True)
    # the bandwidth of this shared machine moves: measured before, between and after the passes, median of the three
    readings = [bandwidth_gb_s(weight_bytes, target.dtype)]
    ours = profile(target, layers)
    readings.append(bandwidth_gb_s(weight_bytes, target.dtype))
    theirs = profile(hf, layers)
    readings.append(bandwidth_gb_s(weight_bytes, target.dtype))
    bandwidth = {k: sorted(r[k] for r in readings)[1] for k in readings[0]}
    bound_ms = {k: weight_bytes / (v * 1e6) for k, v in bandwidth.items()}
    # a round's pass, not the first one over a whole prompt (3.7 ms against a round's 2.3 in bfloat16)
    draft_ms = 1000 * best_drafting_seconds(proposer, target, runs=10)
    report = {"dtype": dtype, "threads": torch.get_num_threads(), "weight_mb": weight_bytes / 1e6,
              "bandwidth_gb_s": bandwidth, "bound_ms": bound_ms, "ours_ms": ours, "transformers_ms": theirs,
              "draft_ms": draft_ms, "draft_dtype": proposer.report.get("draft_dtype"), "kernels": target.kernel_report}
    print(f"target {dtype}, {torch.get_num_threads()} threads, {weight_bytes / 1e6:.0f} MB of weights; bandwidth "
          f"{bandwidth['read']:.1f} GB/s (read) / {bandwidth['matvec']:.1f} GB/s (best matvec) -> a step cannot beat "
          f"{bound_ms['read']:.1f} / {bound_ms['matvec']:.1f} ms")
    print(f"{'tokens':>6} {'ours ms':>9} {'x bound':>8} {'x step':>7} {'transformers ms':>16} "
          f"{'ours vs transformers':>21}")
    for n in theirs:
        print(f"{n:>6} {ours[n]:>9.1f} {ours[n] / bound_ms['read']:>7.2f}x {ours[n] / ours[1]:>6.2f}x "
              f"{theirs[n]:>16.1f} {theirs[n] / ours[n]:>20.2f}x")
    stepped, bare = ours.get("16 stepped"), ours.get("16 no logits")
    print(f"verify-16 / step: {ours[16] / ours[1]:.2f}x with logits at all 16 positions"
          + (f", {stepped / ours[1]:.2f}x ({stepped:.1f} ms) with logits at the first {FIRST_LOGITS}, as a round "
             f"that rejects there runs it, {bare / ours[1]:.2f}x ({bare:.1f} ms) without logits" if stepped else "")
          + f"; a round's drafting pass ({report['draft_dtype']}): {draft_ms:.1f} ms")
    if out_file:
        with open(out_file, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
