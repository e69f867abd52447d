"""What summing a drafter's gradients over gloo costs a step: one all_reduce of N float32 numbers between the
processes torchrun starts (default: the shipped DFlash drafter's 8,740,480 parameters plus its step metrics).

Usage: OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \
    scripts/time_gloo_sum.py [N] [REPEATS]
"""

import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    numbers = int(sys.argv[1]) if len(sys.argv) > 1 else 8_740_480 + 20
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    dist.init_process_group("gloo")
    flat = torch.ones(numbers)
    for _ in range(2):  # connections and buffers set up
        dist.all_reduce(flat)
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(flat)
    seconds = (time.perf_counter() - started) / repeats
    if dist.get_rank() == 0:
        print(f"all_reduce of {numbers * 4 / 1e6:.1f} MB over {dist.get_world_size()} processes: "
              f"{seconds * 1000:.1f} ms")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
