"""What the dashboard's tests share: an ``authorize`` callable they open and shut."""

from __future__ import annotations


class Gate:
    """The ``authorize`` callable of a test: open or shut, and how often it was asked."""

    def __init__(self) -> None:
        self.open = True
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.open
