"""One quantization spread over processes with torch.distributed: the CPUs or machines that `torchrun` starts
(docs/quantizer.md "More than one process"). Run alone, everything here is a no-op for rank 0 of 1.

The unit of work is one weight: each rank quantizes the weights it owns and saves each to the run's parts
folder (quantize.py), which is the hand-off: in sequential mode every rank loads the others' parts of a block
before the next block's Hessians, rank 0 writes the file from all of them. So the parts folder must be one
folder for all ranks (on several machines, a shared filesystem), and a rank that dies loses only the weight
it was working on: torchrun restarts the job, which resumes from the parts. Shared codebooks combine the
refit rounds' per-weight sums (vptq.shared_codebook) through `gather`, in weight order, so the codebook has
the same bits at every world size. Each rank computes on its own device (quantize.default_device: one GPU
per rank where there are GPUs); what the ranks exchange is small and travels as CPU tensors, hence gloo for
CPUs and GPUs alike.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# a rank may wait at a barrier while rank 0 alone fine-tunes or another rank quantizes a large weight: a
# dead rank is torchrun's to detect (it stops the others), not the barrier's
TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        """Rank 0: prints, checks, fine-tunes and writes the file."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def mine(self, names: list[str], cost: dict[str, float]) -> list[str]:
        """The weights of `names` this rank quantizes, in `names` order: largest first, each to the rank with the
        least cost so far (the same split on every rank)."""
        load, owner = [0.0] * self.world, {}
        for name in sorted(names, key=lambda n: -cost[n]):
            r = min(range(self.world), key=load.__getitem__)
            owner[name], load[r] = r, load[r] + cost[name]
        return [n for n in names if owner[n] == self.rank]

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """slots [n, ...] where each rank has filled the rows it owns and left the others zero: every rank's
        rows on every rank (a sum with zeros, so each row's bits are its owner's)."""
        if self.world > 1:
            dist.all_reduce(slots)
        return slots

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's t on every rank."""
        if self.world > 1:
            dist.broadcast(t, src=0)
        return t


def ranks() -> Ranks:
    """This process's place in the job torchrun started (joining its process group the first time), or
    rank 0 of 1 without torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return Ranks()
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=TIMEOUT)
    return Ranks(dist.get_rank(), dist.get_world_size())
