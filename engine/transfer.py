"""Moving small integer tensors between host and device without stalling the host on work queued after them.

Host to device: `torch.tensor(ids, device="cuda")` copies from pageable memory and then waits for the stream to
drain, i.e. for every kernel queued before it: in a speculative round that stalls the host between the drafter's
graph and the verify step it is about to launch, and in a decode step it stalls the host until the previous step
ends. Staged in pinned memory, the copy queues behind that work instead (the caching host allocator keeps the
staging buffer alive until the copy has run).

Device to host: `HostCopy` queues the copy of a sampled token and reads it later, so the host can launch the
next step (which consumes the token on the device) before it waits for the token's value."""
from __future__ import annotations

import torch


def to_device(values: list[int], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory (a held conversation moved off the GPU): pinned and queued without waiting
    when t is on a GPU, so copying it back later runs at full PCIe speed, and both copies keep their order with
    the stream's kernels; a clone on the CPU."""
    if t.device.type != "cuda":
        return t.clone()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class HostCopy:
    """A device tensor's value on its way to the host: the copy is queued at once; `result` waits for the work
    queued before it (not after it) and returns the host tensor."""

    def __init__(self, value: torch.Tensor) -> None:
        self._event = None
        if value.device.type != "cuda":
            self._host = value
            return
        self._host = to_host(value)
        self._event = torch.cuda.Event()
        self._event.record()

    def result(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host
