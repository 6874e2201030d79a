"""The collectives a model shard takes part in, behind one small interface: the single-process model never holds
one (its weights are plain), so it makes no collective call at all."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

# How long a rank waits for the others in a collective (or to join): every rank runs the same steps, so only a
# rank that died keeps the others waiting, and gloo notices a closed connection before this.
TIMEOUT = datetime.timedelta(minutes=10)


class Comm:
    """The ranks of one model, in a process group of their own (`join`): NCCL between GPUs, gloo between CPU
    processes. Every rank makes the same calls in the same order."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank, self.world = group.rank(), group.size()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (the partial sums of a row-parallel matmul)."""
        self.group.allreduce([x]).wait()
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x [..., n] side by side along the last dimension, rank order: [..., world * n]."""
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """The ranks' x (all of one shape) on rank 0, in rank order; None on the others."""
        parts = [torch.empty_like(x) for _ in range(self.world)] if self.rank == 0 else []
        self.group.gather(parts, x.contiguous(), 0).wait()
        return parts if self.rank == 0 else None

    def scatter(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> torch.Tensor:
        """Rank 0's parts[r] into rank r's `out` (shaped like each part); the others pass None."""
        self.group.scatter(out, [p.contiguous() for p in parts] if self.rank == 0 else [], 0).wait()
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place (a step's token ids, on the device they run on)."""
        self.group.broadcast([x], dist.BroadcastOptions()).wait()
        return x


def join(port: int, rank: int, world: int, device: torch.device, store: dist.TCPStore | None = None) -> Comm:
    """This process as rank `rank` of `world`, meeting the others through the store rank 0 serves on
    127.0.0.1:`port` (rank 0 passes it as `store`). A group object of its own, not torch.distributed's default
    group: an engine that goes takes its group along, and the next one starts afresh."""
    if store is None:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=TIMEOUT)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return Comm(dist.ProcessGroupNCCL(store, rank, world))
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]  # one host: loopback
    options._timeout = TIMEOUT
    return Comm(dist.ProcessGroupGloo(store, rank, world, options))


def serve_store(world: int) -> dist.TCPStore:
    """Rank 0's store, on a free port of 127.0.0.1 (`store.port`) that the other ranks are given."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
