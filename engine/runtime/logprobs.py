"""Log-probabilities of the output tokens, for the requests that ask (`SamplingParams.logprobs`).

They are the log-softmax of the model's own logits for the row the token was picked from: before the repetition
penalty, temperature, top-k/p, min-p and a grammar's mask (vLLM's default, `raw_logprobs`; OpenAI's values do
not move with temperature either), so they say what the model thought of the token, the same at any sampling
setting, and a greedy request's are not all 0. They are computed on the device and read in the copy that
brings the step's tokens to the host (`packed`, `unpack`): float64 holds token ids exactly, so one copy carries
both."""
from __future__ import annotations

import torch

from .request import TokenLogprob


def packed(logits: torch.Tensor, chosen: torch.Tensor, top: int) -> torch.Tensor:
    """For rows of logits [rows, vocab] and each row's chosen token [rows] (device tensors, read by no one):
    [rows * (1 + 2 * top)] float64, each row's chosen token's logprob, then its `top` largest logprobs, largest
    first, then their ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    parts = [lp.gather(1, chosen.view(-1, 1).long())]
    if top:
        values, ids = torch.topk(lp, top, dim=-1)
        parts += [values, ids]
    return torch.cat([p.double() for p in parts], dim=1).flatten()


def width(top: int) -> int:
    """Values `packed` gives a row."""
    return 1 + 2 * top


def unpack(values: list[float], top: int) -> list[TokenLogprob]:
    """`packed`'s rows, read on the host."""
    w = width(top)
    out = []
    for r in range(0, len(values), w):
        row = values[r:r + w]
        out.append(TokenLogprob(row[0], tuple(zip((int(i) for i in row[1 + top:]), row[1:1 + top], strict=True))))
    return out
