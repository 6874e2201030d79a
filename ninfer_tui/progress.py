"""A small progress bar on stderr for long steps (downloads, loading)."""
from __future__ import annotations

import math
import sys
import threading
import time


def size_text(n: int) -> str:
    exp = min(int(math.log(max(n, 1), 1024)), 4)
    return f"{n / 1024 ** exp:.1f} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[exp]}"


class Progress:
    """A bar of `done` out of `total`. With `sizes`, the counts are bytes and the line also shows them and the rate
    since the bar started (`done` given at the start, e.g. a resumed download's bytes, is not counted as speed).
    Several threads may advance one bar: parallel downloads share it."""

    def __init__(self, label: str, total: int, enabled: bool = True, sizes: bool = False, done: int = 0) -> None:
        self.label, self.total, self.done = label, max(total, 1), done
        self.enabled, self.sizes = enabled, sizes
        self._start, self._start_done = time.monotonic(), done
        self._last = 0.0
        self._lock = threading.Lock()

    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
                self._last = now
                frac = min(self.done / self.total, 1.0)
                filled = int(frac * 30)
                line = f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {frac * 100:5.1f}%"
                if self.sizes:
                    rate = (self.done - self._start_done) / max(now - self._start, 1e-3)
                    line += f"  {size_text(self.done)} / {size_text(self.total)}  {size_text(int(rate))}/s "
                sys.stderr.write(line)
                sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
