"""Token ids from the host onto the device without a host sync. `torch.tensor(ids, device="cuda")` copies from
pageable memory and then waits for the stream to drain, i.e. for every kernel queued before it: in a speculative
round that stalls the host between the drafter's graph and the verify step it is about to launch. Staged in
pinned memory, the copy queues behind that work instead (the caching host allocator keeps the staging buffer
alive until the copy has run)."""
from __future__ import annotations

import torch


def token_ids(ids: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(ids, dtype=torch.long)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
