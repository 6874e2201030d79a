"""Grammar masks in the step loop: a constrained request's rows get the tokens its grammar allows, computed on the
host (one row after each of the step's drafts) and applied to the rows' logits on the device before the pick or
the verdict. Rows of other requests in the same step are untouched."""
from __future__ import annotations

import torch

from ..tokenizer.grammar import Matcher

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _SHIFTS[device]


def checked_drafts(matcher: Matcher, drafts: list[int] | torch.Tensor) -> list[int]:
    """The leading drafts the grammar allows. Drafts made on the device are read here (one copy): a grammar
    needs the tokens on the host to follow them."""
    drafts = drafts.tolist() if isinstance(drafts, torch.Tensor) else list(drafts)
    return drafts[:matcher.valid_drafts(drafts)]


def constrained(logits: torch.Tensor, matcher: Matcher, drafts: list[int]) -> torch.Tensor:
    """`logits` [len(drafts) + 1, vocab] (row i scores the token after drafts[:i]) with every token the grammar
    refuses at -inf. The bitmask goes to the device from pinned memory, queued behind the step: no host sync."""
    rows, vocab = logits.shape
    pinned = logits.device.type == "cuda"
    host = torch.empty((rows, matcher.words), dtype=torch.int32, pin_memory=pinned)
    matcher.masks(drafts, host.numpy())
    bits = host.to(logits.device, non_blocking=pinned)
    allowed = ((bits.unsqueeze(-1) >> _shifts(logits.device)) & 1).view(rows, -1)[:, :vocab]
    return logits.masked_fill(allowed == 0, float("-inf"))
