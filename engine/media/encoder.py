"""The vision tower behind a cache of its outputs by image digest (its file's content hash, taken as it was prepared:
`PreparedImages`): agent clients resend every image of a conversation with each turn, and each image is encoded
once."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..models.vision import VisionTower
from .image import Image

CACHE_BYTES = 256 << 20  # embeddings kept: ~25 images of 1,000 tokens at the 27B's width in bf16


class ImageEncoder:
    def __init__(self, tower: VisionTower, device: torch.device, max_patches: int,
                 cache_bytes: int = CACHE_BYTES) -> None:
        """`max_patches`: the most patches one run of the tower takes (its activations grow with them)."""
        self.tower, self.device, self.max_patches, self.cache_bytes = tower, device, max_patches, cache_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0  # the cache's, counted as it changes
        self._lock = threading.Lock()  # requests are submitted from several threads
        self.encoded = 0  # images the tower ran on (the rest came from the cache)

    def encode(self, images: list[Image]) -> torch.Tensor:
        """The pad-token embeddings of the images, one after another: [sum of their tokens, text width]."""
        with self._lock:
            new = list({i.digest: i for i in images if i.digest not in self._cache}.values())
            for image in new:
                embeds = self._cache[image.digest] = self._run(image)
                self._bytes += embeds.nbytes
            self.encoded += len(new)
            found = [self._cache[i.digest] for i in images]
            for image in images:
                self._cache.move_to_end(image.digest)
            while len(self._cache) > len(set(i.digest for i in images)) and self._bytes > self.cache_bytes:
                self._bytes -= self._cache.popitem(last=False)[1].nbytes
            return torch.cat(found)

    def _run(self, image: Image) -> torch.Tensor:
        """One image's (or video's) embeddings; a video's frames in runs of at most `max_patches` patches: its
        attention stays within a frame and every other step within a patch, so the runs' rows are its rows."""
        t, h, w = image.grid
        per_run = max(1, self.max_patches // (h * w))  # temporal patches a run takes
        out = []
        with torch.no_grad():
            for first in range(0, t, per_run):
                n = min(per_run, t - first)
                pixels = image.pixels[first * h * w:(first + n) * h * w].to(self.device)
                out.append(self.tower(pixels, [(n, h, w)]))
        return out[0] if len(out) == 1 else torch.cat(out)
