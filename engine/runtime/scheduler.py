"""Admission: up to `max_running` requests run, up to `max_pending` wait in arrival order, the rest are refused;
and the KV pool's tokens, which running requests with caches of their own reserve before they allocate them."""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

from ..errors import NinferError


class Overloaded(NinferError):
    """The pending queue is full; the caller should retry later (HTTP 429/529 with Retry-After)."""

    exit_code = 2


@dataclass(eq=False)
class Ticket:
    admitted: bool = False
    done: bool = False


class Admission:
    def __init__(self, max_running: int, max_pending: int) -> None:
        self.max_running, self.max_pending = max_running, max_pending
        self._cond = threading.Condition()
        self._queue: deque[Ticket] = deque()
        self.running = 0

    @property
    def pending(self) -> int:
        return len(self._queue)

    def enter(self) -> Ticket:
        """Take a running slot or a place in the queue at once, or raise Overloaded."""
        with self._cond:
            ticket = Ticket()
            if self.running < self.max_running and not self._queue:
                self.running += 1
                ticket.admitted = True
            elif len(self._queue) < self.max_pending:
                self._queue.append(ticket)
            else:
                raise Overloaded(f"the server is busy: {self.running} running and {len(self._queue)} queued "
                                 f"requests (max_pending_requests = {self.max_pending})",
                                 hint="retry in a few seconds, or raise max_pending_requests in the profile")
            return ticket

    def wait(self, ticket: Ticket, cancel: threading.Event) -> bool:
        """Block until the ticket may run; False (and out of the queue) when cancelled first, or when the ticket
        was given back before it ran (its slot may be someone else's by now)."""
        with self._cond:
            while not ticket.admitted or ticket.done:
                if cancel.is_set() or ticket.done:
                    self._leave(ticket)
                    return False
                self._cond.wait(0.05)
            return True

    def leave(self, ticket: Ticket) -> None:
        with self._cond:
            self._leave(ticket)

    def _leave(self, ticket: Ticket) -> None:
        if ticket.done:
            return
        ticket.done = True
        if ticket.admitted:
            self.running -= 1
        else:
            self._queue.remove(ticket)
        while self._queue and self.running < self.max_running:
            nxt = self._queue.popleft()
            nxt.admitted = True
            self.running += 1
        self._cond.notify_all()
