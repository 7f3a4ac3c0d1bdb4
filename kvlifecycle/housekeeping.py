"""The owner's background housekeeping: polling the onboards in flight and expiring leases.

``ControlServer`` (``control.py``) runs it on its thread between requests, so one thread drives
the manager. While any onboard is in flight it calls ``manager.poll_onboards()`` (which asks the
store for the onboards just started, then checks the copies) every 0.5-1 ms (``ONBOARD_POLL_S``),
and at once after ``woken()`` (the owner started onboards); it calls
``manager.expire_leases()`` at least every ``expire_interval_s``. A failing call is logged and
tried again at its next turn: the control thread keeps serving.
"""

from __future__ import annotations

import logging
import time

from kvlifecycle.manager import KVCacheManager

logger = logging.getLogger(__name__)

__all__ = ["ONBOARD_POLL_S", "OwnerHousekeeping"]

# While onboards are in flight the thread asks the store about them (one try_wait for all) at
# most this often, and at least once a millisecond: a copy's end reaches its waiter that late.
ONBOARD_POLL_S = 0.0005


class OwnerHousekeeping:
    """When the control thread polls onboards and expires leases; see the module docstring.
    Used by that thread only."""

    def __init__(self, manager: KVCacheManager, expire_interval_s: float) -> None:
        self.manager = manager
        self.expire_interval_s = expire_interval_s
        self._idle_wait_ms = max(1, int(expire_interval_s * 1000 / 2))
        self._next_expire = time.monotonic() + expire_interval_s
        self._next_onboard_poll = 0.0
        self._onboarding = False

    def wait_ms(self) -> int:
        """How long the thread may wait for a request (whole milliseconds: zmq's poll): 1 while
        onboards are in flight, else half the expiry interval."""
        self._onboarding = self.manager.onboards_in_flight() > 0
        return 1 if self._onboarding else self._idle_wait_ms

    def woken(self) -> None:
        """The owner started onboards: poll them at the next ``poll_onboards_if_due``."""
        self._onboarding, self._next_onboard_poll = True, 0.0

    def poll_onboards_if_due(self, now: float) -> None:
        if not self._onboarding or now < self._next_onboard_poll:
            return
        try:
            self.manager.poll_onboards()
        except Exception:  # a bug: keep serving; the next poll tries again
            logger.error("poll_onboards failed", exc_info=True)
        self._next_onboard_poll = now + ONBOARD_POLL_S

    def expire_if_due(self, now: float) -> None:
        if now < self._next_expire:
            return
        try:
            self.manager.expire_leases()
        except Exception:
            logger.error("expire_leases failed", exc_info=True)
        self._next_expire = time.monotonic() + self.expire_interval_s
