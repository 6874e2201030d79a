"""The vision tower behind a cache of its outputs by image digest: agent clients resend every image of a
conversation with each turn, and each image is encoded once."""
from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ..models.vision import VisionTower
from .image import Image

CACHE_BYTES = 256 << 20  # embeddings kept: ~25 images of 1,000 tokens at the 27B's width in bf16


class ImageEncoder:
    def __init__(self, tower: VisionTower, device: torch.device, cache_bytes: int = CACHE_BYTES) -> None:
        self.tower, self.device, self.cache_bytes = tower, device, cache_bytes
        self._cache: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()  # requests are submitted from several threads
        self.encoded = 0  # images the tower ran on (the rest came from the cache)

    def encode(self, images: list[Image]) -> torch.Tensor:
        """The pad-token embeddings of the images, one after another: [sum of their tokens, text width]."""
        with self._lock:
            new = list({i.digest: i for i in images if i.digest not in self._cache}.values())
            if new:
                pixels = torch.cat([i.pixels for i in new]).to(self.device)
                with torch.no_grad():
                    out = self.tower(pixels, [i.grid for i in new]).split([i.tokens for i in new])
                self.encoded += len(new)
                for image, rows in zip(new, out, strict=True):
                    self._cache[image.digest] = rows
            found = [self._cache[i.digest] for i in images]
            for image in images:
                self._cache.move_to_end(image.digest)
            while len(self._cache) > len(set(i.digest for i in images)) and self._bytes() > self.cache_bytes:
                self._cache.popitem(last=False)
            return torch.cat(found)

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._cache.values())
