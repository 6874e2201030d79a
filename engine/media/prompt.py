"""Images in a prompt: each one's pad token expanded to one pad per merged patch, the M-RoPE coordinates of every
prompt token (transformers' qwen3_5 `get_rope_index`), the rows whose embeddings the tower's output replaces, and
the keys by which held conversations match the prompt.

All image pads share one token id, so matching prompts by ids alone would serve one image's KV to another image:
the keys put a value derived from the image's digest (and the pad's place in it) where each pad is, negative so
that it never equals a token id.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import UserError
from . import IMAGE_MARKER, IMAGE_SLOT, VISION_TOKENS
from .image import Image


@dataclass
class PromptMedia:
    """A prompt's images as the text model sees them."""

    positions: torch.Tensor  # [3, n] M-RoPE (time, row, column) of each prompt token, int64 on the CPU
    delta: int  # a token at index i past the prompt sits at i + delta on every axis
    rows: torch.Tensor  # [k] the prompt indices of the image pads, ascending (CPU)
    embeds: torch.Tensor  # [k, hidden] their embeddings (the tower's output), on the model's device
    keys: list[int]  # the prompt's ids, each pad replaced by its image's key (held-conversation matching)

    def rope(self, start: int, count: int) -> torch.Tensor:
        """[3, count]: the M-RoPE coordinates of tokens start..start+count-1."""
        n = self.positions.shape[1]
        inside = self.positions[:, start:start + count]
        past = torch.arange(min(max(start, n), start + count), start + count) + self.delta
        return torch.cat([inside, past.expand(3, -1)], dim=1)

    def splice(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(offsets within the tokens start..start+count-1, embeddings) of the image pads among them; None when
        there are none."""
        lo, hi = torch.searchsorted(self.rows, torch.tensor([start, start + count])).tolist()
        if lo == hi:
            return None
        return self.rows[lo:hi] - start, self.embeds[lo:hi]


def encode_rendered(tokenizer, text: str) -> list[int]:
    """A rendered prompt's ids: each IMAGE_SLOT the image marker's ids, and the vision tokens the rest spells out
    encoded as their characters (so the image pads are exactly the slots a front end put)."""
    spelled = [t for t in VISION_TOKENS if t in tokenizer.special and t in text]
    if IMAGE_SLOT not in text and not spelled:  # most prompts: one encode
        return tokenizer.encode(text, add_special=True)
    marker = tokenizer.encode(IMAGE_MARKER)
    ids = tokenizer.encode("", add_special=True)  # the BOS, where the tokenizer adds one
    for i, piece in enumerate(text.split(IMAGE_SLOT)):
        if i:
            ids += marker
        ids += _as_text(tokenizer, piece, spelled)
    return ids


def _as_text(tokenizer, text: str, spelled: list[str]) -> list[int]:
    """The ids of text in which the special tokens `spelled` are characters: each with its first character
    encoded apart, so that no special token matches."""
    if not spelled:
        return tokenizer.encode(text) if text else []
    ids: list[int] = []
    for j, part in enumerate(re.split("(" + "|".join(map(re.escape, spelled)) + ")", text)):
        if j % 2:
            ids += tokenizer.encode(part[:1]) + tokenizer.encode(part[1:])
        elif part:
            ids += tokenizer.encode(part)
    return ids


def expand_pads(ids: list[int], pad_id: int, images: list[Image]) -> list[int]:
    """The prompt with its i-th pad token (one per image, as the chat template writes it) repeated once per
    merged patch of image i."""
    found = ids.count(pad_id)
    if found != len(images):
        raise UserError(f"the prompt has {found} image placeholders for {len(images)} images",
                        hint="give each image once, as a message part; do not write image tokens in text")
    out: list[int] = []
    it = iter(images)
    for t in ids:
        out.extend([pad_id] * next(it).tokens if t == pad_id else [t])
    return out


def image_key(image: Image, place: int) -> int:
    """The held-conversation key of pad `place` of an image: negative, from its digest."""
    return -1 - (int.from_bytes(image.digest[:8], "little") + place) % (1 << 62)


def prompt_media(ids: list[int], pad_id: int, images: list[Image], embeds: torch.Tensor,
                 merge: int) -> PromptMedia:
    """The PromptMedia of an expanded prompt (`expand_pads`) whose images' tower output is `embeds` (their rows
    one after another). Text tokens advance all three coordinates together; an image's pads sit at the position
    where it starts plus (0, row, column) of their merged patch, and the text after it starts past its larger
    side."""
    columns, keys, rows = [], [], []
    pos = i = 0
    it = iter(images)
    while i < len(ids):
        if ids[i] != pad_id:
            j = i
            while j < len(ids) and ids[j] != pad_id:
                j += 1
            columns.append(torch.arange(pos, pos + j - i).expand(3, -1))
            keys.extend(ids[i:j])
            pos, i = pos + j - i, j
            continue
        image = next(it)
        t, h, w = image.grid[0], image.grid[1] // merge, image.grid[2] // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        columns.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        keys.extend(image_key(image, k) for k in range(image.tokens))
        rows.extend(range(i, i + image.tokens))
        pos, i = pos + max(h, w), i + image.tokens
    positions = torch.cat(columns, dim=1)
    return PromptMedia(positions, int(positions.max()) + 1 - len(ids), torch.tensor(rows, dtype=torch.long),
                       embeds, keys)
