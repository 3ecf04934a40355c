"""Lifecycle: the count of API requests in progress, and whether the server drains (new ones are
then refused: `middleware.lifecycle`). `gateway.server.http` starts the drain on SIGTERM and waits for the count to reach 0.
Work that outlives its request (a background response) holds the count too (`Lifecycle.hold`), so
that a drain lets it finish as well, within the same timeout.
"""

from __future__ import annotations

from collections.abc import Callable


class Lifecycle:
    def __init__(self) -> None:
        self.draining = False
        self.active = 0  # API requests in progress (ops routes not counted), and held work

    def start_drain(self) -> None:
        self.draining = True

    def hold(self) -> Callable[[], None]:
        """Count work in progress until the returned call (the first call; later ones change nothing)."""
        self.active += 1
        held = True

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.active -= 1

        return release
