"""One op's time limit."""
from __future__ import annotations

import time


class Deadline:
    """One op's time limit: every wait of the op shares it, so an op gives up
    `timeout` seconds after it began, not after its last wait began."""
    __slots__ = ("timeout", "at")

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.at = time.monotonic() + timeout

    def left(self) -> float:
        return max(self.at - time.monotonic(), 0.001)
