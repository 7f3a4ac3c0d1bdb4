"""hstu_compute's onboarding of host hits straight from the store's shared DRAM tier.

kv_lookup_alloc hands a host hit's onboard pages to the process that reads them: the plan names
their keys (`ComputePlan.onboard_keys`). For a whole batch, `OnboardReader.start`:

1. finds where those pages sit in the store's shared slab, in the slab's own index, without
   asking the store (`SharedSlab.find`: the rows and their versions); only a request whose pages
   the index does not all show (pages only on disk after a restart, or before the slab is mapped)
   asks the store (`HostStoreClient.locate`: one round trip for those; the store pins the rows,
   reads disk-only pages into DRAM and answers the rows and their versions);
2. queues the copy of the rows into the pool pages of each lease (`PageCopier.scatter`: on the GPU
   the device reads the slab's rows in place, the slab being mapped into its address space: one
   copy of the ids and two indexed kernels, on the stream that runs the forward) and returns: the
   forward is queued after the copy on the GPU, so the host launches it meanwhile;

and once that forward is launched, `OnboardReader.finish` waits for the copy alone (an event
recorded after it) and keeps, per request, the leading pages whose
slab row still has the version it was found at (`SharedSlab.unchanged`): a row the store
reused meanwhile is never taken as the page; hstu_compute computes such a request again.

A request's pages that were not copied (the store no longer held them, it did not answer, or the
copy failed) are computed with its new tokens, so a failed onboard costs that request a
recompute and nothing else; a row reused before `finish` (the store evicted it during the copy,
which its second chance for rows just read makes rare) costs it the forward it joined as well. In
the common case no round trip at all, no poll, and no host-side wait for the copy before the
forward is launched.

`warm_up` maps the slab before the first host hit, on a thread of its own: mapping it and
registering its GBs with CUDA took about a second on an H100, which the first host hit after a
start paid otherwise.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from deploy.runtime.compute_plan import ComputePlan
from kvlifecycle.pool import PagePool
from kvlifecycle.store import HostStoreClient
from kvlifecycle.store.protocol import keys_from_words
from kvlifecycle.store.slab import SharedSlab
from kvlifecycle.store.transfer import PageCopier

logger = logging.getLogger(__name__)

__all__ = ["OnboardReader", "QueuedOnboard"]

# How long a slab the store was found to serve is taken as still served: the check is a stat of the
# store's memory file (tens of microseconds a batch). A slab whose store stopped meanwhile still
# holds right pages (nothing writes them any more), so reading it that much longer is safe.
SLAB_CHECK_INTERVAL_S = 0.1


class OnboardReader:
    """See the module docstring. One per hstu_compute instance, used by its `execute` thread."""

    STATS_KEYS = ("onboarded_pages", "onboard_failed_pages", "onboard_locates")

    def __init__(self, store: HostStoreClient, pin_s: float) -> None:
        self.store = store
        self.pin_s = pin_s  # how long the store keeps the located rows from eviction
        self._slab: SharedSlab | None = None
        self._slab_lock = threading.Lock()  # the warm-up thread maps it too
        self._slab_served_until = 0.0  # monotonic time until which `_slab` is taken as served
        self._closed = False
        self._copier: PageCopier | None = None
        self._copier_pool: PagePool | None = None
        self._counters = collections.Counter[str]()

    def start(self, pool: PagePool, plans: Sequence[ComputePlan]) -> "QueuedOnboard":
        """Queue the copy of each plan's onboard pages that the store holds into its lease's
        pages; the calling thread's stream reads them after the copy (on the GPU the host does
        not wait for it). ``QueuedOnboard.pages[i]``: the leading onboard pages of plan i to be
        read from the pool; ``finish`` says which of them stayed right."""
        page_size = pool.spec.page_size
        wanted = [keys_from_words(plan.onboard_keys.numpy()) for plan in plans]
        queued = QueuedOnboard(pages=[0] * len(plans), wanted=sum(len(keys) for keys in wanted))
        try:
            slab, located = self._find(wanted, pin=pool.tensor.is_cuda)
            if slab is not None:
                pages = []
                for plan, keys, (found, found_versions) in zip(plans, wanted, located):
                    n = min(len(found), len(keys))
                    first = (plan.cached_len - plan.onboard_len) // page_size  # the first onboard page
                    queued.rows.append(np.asarray(found[:n], dtype=np.int64))
                    queued.versions.append(np.asarray(found_versions[:n], dtype=np.int64))
                    pages.append(plan.page_row[first:first + n].numpy())
                queued.done = self._copier_for(pool).scatter(slab.copy_rows, np.concatenate(queued.rows),
                                                             np.concatenate(pages), wait=False)
                queued.slab = slab
                queued.pages = [len(rows) for rows in queued.rows]
        except Exception:
            logger.warning("onboard from the store's slab failed for %d requests; computing their pages",
                           len(plans), exc_info=True)
            # a copy queued before the failure is on the forward's stream: it lands before the
            # forward writes those pages
            queued.pages, queued.rows, queued.versions, queued.slab = [0] * len(plans), [], [], None
        return queued

    def finish(self, queued: "QueuedOnboard") -> list[int]:
        """Per plan of ``queued``, how many leading onboard pages hold their KV: the copy ended,
        and their slab rows kept the version the store answered (a row it reused meanwhile may
        have been copied half old, half new). The rest are to be computed. Checked and counted at
        the first call; later calls answer the same."""
        if queued.intact is not None:
            return queued.intact
        if queued.done is not None:
            queued.done.synchronize()  # the copy alone, not the forward queued after it
        intact = [0] * len(queued.pages)
        if queued.slab is not None:
            unchanged = queued.slab.unchanged(np.concatenate(queued.rows), np.concatenate(queued.versions))
            start = 0
            for i, segment in enumerate(queued.rows):
                ok = unchanged[start:start + len(segment)]
                intact[i] = len(ok) if ok.all() else int(np.argmin(ok))  # the leading unchanged rows
                start += len(segment)
        self._counters["onboarded_pages"] += sum(intact)
        self._counters["onboard_failed_pages"] += queued.wanted - sum(intact)
        queued.intact = intact
        return intact

    def warm_up(self, owner_registered: Callable[[], bool], pin: bool, timeout_s: float = 120.0) -> None:
        """Map the store's slab once the owner registered its pool with the store (then the store
        has made it); gives up quietly after ``timeout_s`` (the first host hit maps it then)."""
        deadline = time.monotonic() + timeout_s
        while not self._closed and time.monotonic() < deadline:
            if owner_registered():
                located = self.store.locate([], self.pin_s)
                if located is not None:
                    self._map(located.slab, pin)
                return
            time.sleep(0.2)

    def stats(self) -> dict[str, Any]:
        return {key: self._counters[key] for key in self.STATS_KEYS}

    def close(self) -> None:
        self._closed = True
        with self._slab_lock:
            if self._slab is not None:
                self._slab.close()
                self._slab = None
        self.store.close()

    # -- helpers ------------------------------------------------------------------------

    def _find(self, wanted: list[list[bytes]], pin: bool) -> tuple[SharedSlab | None, list[tuple[Any, Any]]]:
        """The slab, and per request the (rows, versions) of its leading pages there: from the
        slab's index; from the store (`locate`, one round trip) for the requests whose pages the
        index does not all show. (None, []) when neither answers."""
        slab = self._slab
        found = slab.find(wanted) if slab is not None and self._served(slab) else None
        short = [i for i, keys in enumerate(wanted) if found is None or len(found[i][0]) < len(keys)]
        if not short:
            return slab, found
        self._counters["onboard_locates"] += 1
        located = self.store.locate([wanted[i] for i in short], self.pin_s)
        mapped = self._map(located.slab, pin) if located is not None else None
        if mapped is None:  # the store did not answer: what the index showed, if anything
            return (slab, found) if found is not None else (None, [])
        if mapped is not slab:  # the first map, or a restarted store's slab: the index's rows were of another
            nothing = np.zeros(0, dtype=np.int64)
            found = [(nothing, nothing)] * len(wanted)
        for i, rows, versions in zip(short, located.rows, located.versions):
            found[i] = (rows, versions)
        return mapped, found

    def _served(self, slab: SharedSlab) -> bool:
        """Whether the store still serves ``slab`` (``SharedSlab.current``), asked at most every
        ``SLAB_CHECK_INTERVAL_S``."""
        now = time.monotonic()
        if now < self._slab_served_until:
            return True
        if not slab.current():
            return False
        self._slab_served_until = now + SLAB_CHECK_INTERVAL_S
        return True

    def _map(self, handle: dict[str, Any], pin: bool) -> SharedSlab | None:
        """The slab ``handle`` names, mapped once (a restarted store names a new one)."""
        with self._slab_lock:
            if self._slab is not None and self._slab.path == handle["path"]:
                return self._slab
            if self._slab is not None:
                self._slab.close()
                self._slab = None
            started = time.perf_counter()
            try:
                self._slab = SharedSlab.attach(handle, pin=pin)
            except (OSError, RuntimeError, ValueError, KeyError):
                logger.warning("cannot map the store's shared slab %s; host hits are computed", handle, exc_info=True)
                return None
            logger.info("mapped the store's shared DRAM slab %s (%d pages) in %.3f s", self._slab.path,
                        self._slab.capacity_pages, time.perf_counter() - started)
            return self._slab

    def _copier_for(self, pool: PagePool) -> PageCopier:
        if self._copier_pool is not pool:  # the owner republished its pool
            self._copier, self._copier_pool = PageCopier(pool.tensor), pool
        return self._copier


@dataclass
class QueuedOnboard:
    """A batch's copy from the slab, queued by ``OnboardReader.start``."""

    pages: list[int]  # per plan: the leading onboard pages queued (read unless `finish` says otherwise)
    wanted: int  # onboard pages the plans named
    rows: list[np.ndarray] = field(default_factory=list)  # per plan: the slab rows copied
    versions: list[np.ndarray] = field(default_factory=list)  # per plan: their versions when located
    slab: SharedSlab | None = None
    done: Any = None  # a CUDA event recorded after the copy (None: nothing pending on the host's side)
    intact: list[int] | None = None  # `OnboardReader.finish`'s answer, once asked
