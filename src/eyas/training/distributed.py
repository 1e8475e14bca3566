"""A training run's place among torchrun's processes (gloo on a CPU, NCCL on a GPU)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device_kind: str) -> Dist:
    """torchrun sets WORLD_SIZE and RANK (LOCAL_RANK picks the GPU: eyas.targets.placement); gloo on
    CPU, NCCL on GPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Dist()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_kind == "cuda" else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size())
