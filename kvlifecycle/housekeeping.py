"""The owner's background housekeeping: settling the onboards in flight and expiring leases.

``ControlServer`` (``control.py``) runs both:

- ``OnboardSettler``, a thread of its own: once the owner started onboards (``wake()``) it calls
  ``manager.poll_onboards(wait_s=...)`` until none is in flight. That call asks the store about
  the onboards just started, then blocks in one store poll that returns as soon as one copy
  ended, so a copy's end is settled one store message after it happened, not at the next tick of
  a poll loop. After each call that settled a lease it calls ``on_settled()``: the control thread
  then answers the ``onboard_wait`` calls whose leases are all settled.
- ``LeaseExpiry``, on the control thread between requests: ``manager.expire_leases()`` at least
  every ``expire_interval_s``.

A failing call is logged and tried again at its next turn: the owner keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvlifecycle.manager import KVCacheManager

logger = logging.getLogger(__name__)

__all__ = ["LeaseExpiry", "OnboardSettler"]

# How long one poll of the store may block while copies run; the settler asks the store about
# onboards started meanwhile when it returns (at once when a copy ends).
SETTLE_WAIT_S = 0.02
# The settler's pause after a poll that settled nothing: a store that answers polls at once
# (FlexKV's store process) is polled this often, not in a busy loop.
IDLE_POLL_S = 0.0005


class OnboardSettler:
    """The thread that settles the owner's onboards; see the module docstring. ``close()`` once."""

    def __init__(self, manager: KVCacheManager, on_settled: Callable[[], None]) -> None:
        self.manager = manager
        self.on_settled = on_settled
        self._started = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvlifecycle-onboards", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """The owner started onboards: ask the store about them now."""
        self._started.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._started.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop:
            if self.manager.onboards_in_flight() == 0:
                self._started.wait()
                self._started.clear()  # onboards started after this are seen by the check above
                continue
            try:
                settled = self.manager.poll_onboards(wait_s=SETTLE_WAIT_S)
            except Exception:  # a bug: keep serving; the next turn tries again
                logger.error("poll_onboards failed", exc_info=True)
                settled = []
            if settled:
                self.on_settled()
            else:
                time.sleep(IDLE_POLL_S)


class LeaseExpiry:
    """When the control thread expires leases; used by that thread only."""

    def __init__(self, manager: KVCacheManager, expire_interval_s: float) -> None:
        self.manager = manager
        self.expire_interval_s = expire_interval_s
        self._next_expire = time.monotonic() + expire_interval_s

    def wait_ms(self, now: float) -> int:
        """How long the thread may wait for a request before the next expiry is due."""
        return max(1, int((self._next_expire - now) * 1000) + 1)

    def expire_if_due(self, now: float) -> None:
        if now < self._next_expire:
            return
        try:
            self.manager.expire_leases()
        except Exception:
            logger.error("expire_leases failed", exc_info=True)
        self._next_expire = time.monotonic() + self.expire_interval_s
