"""Stop strings over streamed text: hold back what could still become a stop string."""
from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._pending = ""
        self.stopped = False
        self.matched: str | None = None

    def feed(self, piece: str) -> str:
        """Add generated text; return the part that is safe to show. Sets `stopped` on a match."""
        if not self.stops:
            return piece
        self._pending += piece
        hits = [(i, s) for s in self.stops if (i := self._pending.find(s)) >= 0]
        if hits:
            cut, self.matched = min(hits)
            self.stopped = True
            out, self._pending = self._pending[:cut], ""
            return out
        safe = len(self._pending) - self._hold
        if safe <= 0:
            return ""
        out, self._pending = self._pending[:safe], self._pending[safe:]
        return out

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out
