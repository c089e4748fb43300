"""Bounding how many kernels of this process start at once (:class:`StartGate`)."""
from __future__ import annotations

import os
import threading

__all__ = ["StartGate"]


class StartGate:
    """Bounds how many kernels of this process start at once.

    A cold start is CPU-bound (the new kernel imports ipykernel): more starts at once than the
    machine has cores only slow every one of them down. :meth:`Kernel.start` holds a place from
    launching the process until the kernel answers.

    Args:
        limit: starts at once (int >= 1); default ``os.cpu_count()`` (at least 1).

    Attributes:
        active: starts in progress now (int). peak: the most ever in progress at once (int).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = max(1, int(limit if limit is not None else (os.cpu_count() or 1)))
        self.active = 0
        self.peak = 0
        self._cv = threading.Condition()

    def enter(self, wait: bool = True) -> bool:
        """Take a place (waiting for one when ``wait``); returns whether it got one. The place
        may be given back by another thread (:meth:`leave`)."""
        with self._cv:
            while self.active >= self.limit:
                if not wait:
                    return False
                self._cv.wait()
            self.active += 1
            self.peak = max(self.peak, self.active)
        return True

    def leave(self) -> None:
        """Give a place back."""
        with self._cv:
            self.active -= 1
            self._cv.notify()

    def __enter__(self) -> "StartGate":
        self.enter()
        return self

    def __exit__(self, *exc) -> None:
        self.leave()
