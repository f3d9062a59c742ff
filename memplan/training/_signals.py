"""SIGINT/SIGTERM: stop at the next window boundary with a checkpoint; a second Ctrl-C stops at
once.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__: list[str] = []


class StopSignals:
    """``received`` is the name of the signal that asked the run to stop (None: none yet); the
    loop reads it at each window boundary."""

    def __init__(self) -> None:
        self.received: str | None = None

    @contextlib.contextmanager
    def caught(self) -> Iterator[None]:
        """SIGINT/SIGTERM set ``received``; the loop checkpoints at the next window boundary and
        returns. A second SIGINT stops at once (KeyboardInterrupt), as people expect of Ctrl-C."""
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers can only be installed from the main thread
            return

        def handler(signum: int, frame: Any) -> None:
            if self.received is not None and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.received = signal.Signals(signum).name

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old if old is not None else signal.SIG_DFL)
