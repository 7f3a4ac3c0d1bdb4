"""The owner's background housekeeping: settling the onboards in flight and expiring leases.

``ControlServer`` (``control.py``) starts ``OwnerHousekeeping``, a thread of its own, so that the
control thread only answers requests (kv_offload's commits are on every request's path):

- once the owner started onboards (``wake()``) it calls ``manager.poll_onboards(wait_s=...)``
  until none is in flight. That call asks the store about the onboards just started, then blocks
  in one store poll that returns as soon as one copy ended, so a copy's end is settled one store
  message after it happened, not at the next tick of a poll loop. Whenever leases were settled
  it calls ``on_settled()``: the control thread then answers the ``onboard_wait`` calls whose
  leases are all settled. Onboards started while it waits are asked about when that poll
  returns (the store copies one task at a time, so they lose little).
- ``manager.expire_leases()`` at least every ``expire_interval_s`` (it reaps quarantined pages
  through the store client, whose lock a waiting poll holds: here it never stalls the control
  thread).

A failing call is logged and tried again at its next turn: the owner keeps serving.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvlifecycle.manager import KVCacheManager

logger = logging.getLogger(__name__)

__all__ = ["OwnerHousekeeping"]

# How long one poll of the store may block while copies run; the thread asks the store about
# onboards started meanwhile when it returns (at once when a copy ends).
SETTLE_WAIT_S = 0.02
# The pause after a poll that settled nothing: a store that answers polls at once (FlexKV's store
# process) is polled this often, not in a busy loop.
IDLE_POLL_S = 0.0005


class OwnerHousekeeping:
    """The owner's housekeeping thread; see the module docstring. ``close()`` once."""

    def __init__(self, manager: KVCacheManager, on_settled: Callable[[], None], expire_interval_s: float) -> None:
        self.manager = manager
        self.on_settled = on_settled
        self.expire_interval_s = expire_interval_s
        self._started = threading.Event()
        self._stop = False
        self._next_expire = time.monotonic() + expire_interval_s
        self._thread = threading.Thread(target=self._run, name="kvlifecycle-housekeeping", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """The owner started onboards: ask the store about them now, or when the poll the thread
        is blocked in returns (a copy ended, or ``SETTLE_WAIT_S``)."""
        self._started.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._started.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop:
            self._expire_if_due()
            if self.manager.onboards_in_flight() == 0:
                # Until woken, or the next expiry; a start that missed its wake is polled then.
                self._started.wait(max(0.0, self._next_expire - time.monotonic()))
                self._started.clear()  # onboards started after this are seen by the check above
                continue
            try:
                settled = bool(self.manager.poll_onboards(wait_s=SETTLE_WAIT_S))
            except Exception:  # a bug: keep serving; the next turn tries again
                logger.error("poll_onboards failed", exc_info=True)
                settled = True  # it may have settled some first: the control thread looks (harmless if not)
            if settled:
                self.on_settled()
            else:
                time.sleep(IDLE_POLL_S)

    def _expire_if_due(self) -> None:
        if time.monotonic() < self._next_expire:
            return
        try:
            self.manager.expire_leases()
        except Exception:
            logger.error("expire_leases failed", exc_info=True)
        self._next_expire = time.monotonic() + self.expire_interval_s
