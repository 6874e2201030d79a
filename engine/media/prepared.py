"""Images and videos made ready for the tower, kept by their file's content hash: agent clients resend every image
and video of a conversation with each turn, and each file is decoded, resized and cut into patches once. The hash is
the prepared image's digest too, the key of the tower's cache (which saves the encoding) and of its place in held
conversations: the file is hashed once, its patches never."""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable

from .image import Image

# Patches kept (fp32, each repeated over the temporal patch): ten images at the default million pixels
CACHE_BYTES = 256 << 20


class PreparedImages:
    """One engine's: its bounds and the tower's geometry, which shape what a file makes, are fixed."""

    def __init__(self, cache_bytes: int = CACHE_BYTES) -> None:
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[bytes, Image] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()  # requests' images are made ready on several threads
        self.made = 0  # files prepared (the rest came from the cache)

    def get(self, data: bytes, make: Callable[[bytes], Image], variant: bytes) -> Image:
        """The image (or video) `make` prepares from the file `data` with the digest it is given: made once while it
        stays among the most recently used (the least recently used go past the cap). `variant` tells apart what
        one file makes under other bounds (the pixels it is resized to, a video's frame budget): the digest is the
        hash of the file's hash and it, so that all of its bytes key a held conversation's pads. A file `make`
        refuses raises each time it comes."""
        key = hashlib.sha256(hashlib.sha256(data).digest() + variant).digest()
        with self._lock:
            image = self._cache.get(key)
            if image is not None:
                self._cache.move_to_end(key)
                return image
        image = make(key)  # outside the lock: a decode takes a while, and another file's need not wait for it
        with self._lock:
            self.made += 1
            if key not in self._cache:  # the same file made at once on two threads is kept once
                self._cache[key] = image
                self._bytes += image.pixels.nbytes
            while self._bytes > self.cache_bytes:
                self._bytes -= self._cache.popitem(last=False)[1].pixels.nbytes
        return image
