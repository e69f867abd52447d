"""Data parallelism across the processes `torchrun` starts: `torchrun --nproc-per-node N -m dflash train ...`.

Each process holds the target and the whole drafter, takes its share of every step's sequences, and the gradients
are summed across processes before the optimizer step, so every process applies the same update and N processes
follow the curve one process follows with the same global batch (`--grad-accum`). gloo on CPU, nccl on CUDA (one GPU
per process, `LOCAL_RANK`). Process 0 alone writes logs, evaluations, checkpoints and the final drafter.

More processes than GPUs share them (`--nproc-per-node 3` on one GPU): a trainer that runs one sequence at a time
leaves a fast GPU idle while Python prepares the next kernels (an H100 was 47% busy training the SmolLM2 drafter), and
several processes fill it. NCCL refuses two ranks on one GPU, so a shared world sums over gloo, through host memory.

Gradients are summed by hand (one flat all-reduce per step) instead of wrapping the model in
DistributedDataParallel: the objectives call the drafter in several places per example (context cache, block pass,
chunked LM head), and a plain sum after the step's backward passes is the same arithmetic with none of DDP's hooks.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch

from .errors import UserError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    staged: bool = False  # collectives go through host copies (gloo with CUDA tensors)

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This process's part of `items`: every size-th one, starting at its rank."""
        return items[self.rank :: self.size]

    def sum_(self, tensors: list[torch.Tensor]) -> None:
        """Sum `tensors` across processes, in place, in one collective."""
        if self.size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        if self.staged:
            flat = flat.cpu()
        torch.distributed.all_reduce(flat)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Process 0's values everywhere (a new drafter's random init may differ between processes)."""
        if self.size == 1:
            return
        for t in tensors:
            if self.staged:
                host = t.data.cpu()
                torch.distributed.broadcast(host, src=0)
                t.data.copy_(host)
            else:
                torch.distributed.broadcast(t.data, src=0)

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def close(self) -> None:
        """The group's teardown, once every process has got here (call it after a clean finish only: after an
        exception the others may be inside a collective that would never end, and the launcher ends them). A rank
        that tore its group down while the other still worked aborted at exit once in a CI run ("terminate called
        without an active exception": gloo's threads outliving the group)."""
        if self.size > 1 and torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


SINGLE = World()


def placement(local_rank: int, local_size: int, gpus: int) -> tuple[int, str]:
    """(this process's GPU, the backend) for LOCAL_RANK of local_size processes on a node with `gpus` GPUs: round
    robin, and gloo as soon as any GPU holds two processes."""
    if gpus < 1:
        raise UserError("--device cuda under torchrun, but no GPU is visible")
    return local_rank % gpus, "nccl" if local_size <= gpus else "gloo"


def init_world(device: str | None = None) -> World:
    """The world torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK), or a single process."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return SINGLE
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    cuda = torch.cuda.is_available() and (device is None or str(device).startswith("cuda"))
    backend, staged = "gloo", False
    if cuda:
        gpu, backend = placement(local_rank, local_size, torch.cuda.device_count())
        torch.cuda.set_device(gpu)  # "cuda" now means this process's GPU
        staged = backend == "gloo"
        if staged and rank == 0:
            print(f"[dflash] {local_size} processes share {torch.cuda.device_count()} GPU(s): gradients are summed "
                  "over gloo through host memory", file=sys.stderr)
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend)
    return World(rank, size, local_rank, staged)
