"""Images and videos in a prompt: each video's slot written as the Qwen3-VL processor writes it (each temporal
patch's time as text, then its frame between the vision markers), each pad token expanded to one pad per merged
patch of its image or frame, the M-RoPE coordinates of every prompt token (transformers' qwen3_5
`get_rope_index`: a video's frames are placed as images one after another), the rows whose embeddings the tower's
output replaces, and the keys by which held conversations match the prompt.

All image pads share one token id (and all video pads another), so matching prompts by ids alone would serve one
image's KV to another image: the keys put a value derived from the image's digest (and the pad's place in it)
where each pad is, negative so that it never equals a token id.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..errors import UserError
from . import IMAGE_MARKER, IMAGE_SLOT, VIDEO_MARKER, VIDEO_SLOT, VISION_TOKENS
from .image import Image
from .video import Video


@dataclass
class PromptMedia:
    """A prompt's images and videos as the text model sees them."""

    positions: torch.Tensor  # [3, n] M-RoPE (time, row, column) of each prompt token, int64 on the CPU
    delta: int  # a token at index i past the prompt sits at i + delta on every axis
    rows: torch.Tensor  # [k] the prompt indices of the image and video pads, ascending (CPU)
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


def encode_rendered(tokenizer, text: str, videos: list[Video] = ()) -> list[int]:
    """A rendered prompt's ids: each IMAGE_SLOT the image marker's ids, each VIDEO_SLOT its video's frames (one pad
    each: `expand_pads` makes them the frames' pads), and the vision tokens the rest spells out encoded as their
    characters (so the pads are exactly the slots a front end put). A frame's time is text, encoded with the text
    before it, as the processor's expansion of the prompt is before it is tokenised."""
    spelled = [t for t in VISION_TOKENS if t in tokenizer.special and t in text]
    slots = re.split(f"({re.escape(IMAGE_SLOT)}|{re.escape(VIDEO_SLOT)})", text)
    found = slots.count(VIDEO_SLOT)
    if found != len(videos):
        raise UserError(f"the prompt has {found} video placeholders for {len(videos)} videos",
                        hint="give each video once, as a message part")
    if len(slots) == 1 and not spelled:  # most prompts: one encode
        return tokenizer.encode(text, add_special=True)
    image, video = tokenizer.encode(IMAGE_MARKER), tokenizer.encode(VIDEO_MARKER)
    ids = tokenizer.encode("", add_special=True)  # the BOS, where the tokenizer adds one
    pending, it = "", iter(videos)
    for i, piece in enumerate(slots):
        if i % 2 == 0:
            pending += piece
        elif piece == IMAGE_SLOT:
            ids += _as_text(tokenizer, pending, spelled) + image
            pending = ""
        else:
            for seconds in next(it).timestamps:
                ids += _as_text(tokenizer, pending + f"<{seconds:.1f} seconds>", spelled) + video
                pending = ""
    return ids + _as_text(tokenizer, pending, spelled)


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


def expand_pads(ids: list[int], pads: tuple[int, int], items: list[Image]) -> list[int]:
    """The prompt with each pad token repeated once per merged patch of its image or frame: `pads` are the image
    and video pad ids; `items` the prompt's images and videos in order, an image's one pad (as the chat template
    writes it) and each of a video's frames' (`encode_rendered`) in their places."""
    image_pad, video_pad = pads
    images = [i for i in items if not isinstance(i, Video)]
    found = ids.count(image_pad)
    if found != len(images):
        raise UserError(f"the prompt has {found} image placeholders for {len(images)} images",
                        hint="give each image once, as a message part; do not write image tokens in text")
    frames = sum(i.grid[0] for i in items if isinstance(i, Video))
    if ids.count(video_pad) != frames:
        raise UserError(f"the prompt has {ids.count(video_pad)} video frame placeholders for {frames} frames",
                        hint="give each video once, as a message part; do not write video tokens in text")
    spans = iter(_spans(items))
    out: list[int] = []
    for t in ids:
        if t not in pads:
            out.append(t)
            continue
        item, _, count = next(spans)
        if (t == video_pad) != isinstance(item, Video):
            raise UserError("the prompt's image and video placeholders are not in the order of its images and "
                            "videos", hint="pass the images and videos in the order the prompt holds them")
        out.extend([t] * count)
    return out


def _spans(items: list[Image]) -> list[tuple[Image, int, int]]:
    """(item, its first pad's place in it, pads) of each run of pads the items take in a prompt, in order: an image
    one, a video one per frame."""
    spans = []
    for item in items:
        n = item.grid[0] if isinstance(item, Video) else 1
        spans += [(item, k * item.tokens // n, item.tokens // n) for k in range(n)]
    return spans


def image_key(image: Image, place: int) -> int:
    """The held-conversation key of pad `place` of an image or video: negative, from its digest."""
    return -1 - (int.from_bytes(image.digest[:8], "little") + place) % (1 << 62)


def prompt_media(ids: list[int], pads: tuple[int, int], items: list[Image], embeds: torch.Tensor,
                 merge: int) -> PromptMedia:
    """The PromptMedia of an expanded prompt (`expand_pads`) whose images' and videos' tower output is `embeds`
    (their rows one after another, in `items`' order). Text tokens advance all three coordinates together; the pads
    of an image or a video's frame sit at the position where it starts plus (0, row, column) of their merged patch,
    and the text after it starts past its larger side."""
    columns, keys, rows = [], [], []
    pos = i = 0
    spans = iter(_spans(items))
    while i < len(ids):
        if ids[i] not in pads:
            j = i
            while j < len(ids) and ids[j] not in pads:
                j += 1
            columns.append(torch.arange(pos, pos + j - i).expand(3, -1))
            keys.extend(ids[i:j])
            pos, i = pos + j - i, j
            continue
        item, first, count = next(spans)
        t = 1 if isinstance(item, Video) else item.grid[0]
        h, w = item.grid[1] // merge, item.grid[2] // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
        columns.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
        keys.extend(image_key(item, first + k) for k in range(count))
        rows.extend(range(i, i + count))
        pos, i = pos + max(h, w), i + count
    positions = torch.cat(columns, dim=1)
    return PromptMedia(positions, int(positions.max()) + 1 - len(ids), torch.tensor(rows, dtype=torch.long),
                       embeds, keys)
