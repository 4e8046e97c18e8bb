"""A stalled step ends the process with every thread's stack instead of hanging (a kernel that never
finishes cannot be recovered in-process), so a supervisor restarts it; as SGLang's watchdog.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time

log = logging.getLogger("zipfusion")

EXIT_CODE = 70                    # EX_SOFTWARE: an internal error, not the user's input


class Watchdog:
    """Watches the engine's steps; ``timeout_s``: the longest a step may run."""

    def __init__(self, timeout_s: float):
        if not timeout_s > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = float(timeout_s)
        self._step = 0
        self._since: float | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="zipfusion-watchdog", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self._step += 1
        self._since = time.monotonic()

    def end(self) -> None:
        self._since = None

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self._closed.set()

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 4)
        while not self._closed.wait(period):
            since, step = self._since, self._step
            if since is not None and time.monotonic() - since > self.timeout_s:
                self._stalled(step, time.monotonic() - since)
                return

    def _stalled(self, step: int, age: float) -> None:
        log.critical("zipfusion watchdog: engine step %d has run %.0f s (watchdog_timeout_s=%g): the GPU or "
                     "the host is stalled; every thread's stack follows, then the process exits with code %d",
                     step, age, self.timeout_s, EXIT_CODE)
        print(f"zipfusion watchdog: engine step {step} stalled for {age:.0f} s; stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_CODE)
