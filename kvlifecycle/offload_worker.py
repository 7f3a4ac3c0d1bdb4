"""OffloadWorker: commit -> put -> reap for finished requests, on one background thread.

Used by a process that does not own the page table (kv_offload). Call order:

    worker = OffloadWorker(control, store, page_bytes)   # control: ControlClient to the owner
    worker.start()
    worker.submit(lease_id, token_ids)     # per finished request, returns at once
    ...
    left = worker.stop(flush_timeout_s)    # commit what is queued, wait for every put

For each submitted lease the thread asks the owner to commit it (`control.commit`, which pins
the new full pages for offload), submits one `put_async` for those pages (`Offloader.launch`),
and between submissions reaps finished puts (`Offloader.reap`), which reports each put to the
owner (`control.offload_done`) so the pages are unpinned. Leases are committed in submission
order. Store trouble never blocks `submit`: a failed put is reported `ok=False` (the pages stay
cached on the device, only the host copy is missing).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

from kvlifecycle.hashing import TokenIds
from kvlifecycle.manager import Offloader

logger = logging.getLogger(__name__)

_STOP = object()


class OffloadWorker:
    def __init__(self, control, store, page_bytes: int, namespace: str, page_size: int,
                 on_stats: Callable[[dict[str, float]], None] | None = None,
                 reap_interval_s: float = 0.005) -> None:
        self.control = control
        self.store = store
        self.page_bytes = page_bytes
        self.on_stats = on_stats
        self.reap_interval_s = reap_interval_s
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="offload-worker", daemon=True)
        self._stats = {"offloaded_pages": 0, "offloaded_bytes": 0, "commit_errors": 0, "commits": 0}
        self.offloader = (Offloader(store, namespace, page_size, self._done) if store is not None else None)

    def start(self) -> None:
        self._thread.start()

    def submit(self, lease_id: int, token_ids: TokenIds) -> None:
        """Queue a finished request's lease for commit and offload; never blocks."""
        self._queue.put((lease_id, token_ids))

    def stop(self, flush_timeout_s: float) -> int:
        """Commit every queued lease, wait up to `flush_timeout_s` for every put; returns the
        number of puts still pending (0 when everything reached the host store)."""
        self._queue.put(_STOP)
        self._thread.join()
        left = 0
        if self.offloader is not None:
            self.offloader.flush(flush_timeout_s)
            left = self.offloader.pending
        self._publish()
        return left

    def stats(self) -> dict[str, float]:
        stats = dict(self._stats)
        stats["offload_queue_depth"] = self._queue.qsize() + (self.offloader.pending if self.offloader else 0)
        if self.offloader is not None:
            stats.update(self.offloader.counters)
        if self.store is not None:
            stats["store_errors"] = self.store.stats().get("errors", 0)
        return stats

    # ---- helpers ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.reap_interval_s if self._pending() else 0.5)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                self._commit_and_put(*item)
            if self.offloader is not None:
                self.offloader.reap()
            self._publish()

    def _commit_and_put(self, lease_id: int, token_ids: TokenIds) -> None:
        try:
            items = self.control.commit(lease_id)
        except Exception:
            # The owner expires the lease; its pages return, only this request's cache is lost.
            self._stats["commit_errors"] += 1
            logger.warning("commit of lease %d failed; its pages return on lease expiry", lease_id, exc_info=True)
            return
        self._stats["commits"] += 1
        if not items:
            return
        if self.offloader is None:
            self._done([it.page_id for it in items], False)
            return
        self.offloader.launch(token_ids, items)

    def _done(self, page_ids: list[int], ok: bool) -> None:
        if ok:
            self._stats["offloaded_pages"] += len(page_ids)
            self._stats["offloaded_bytes"] += len(page_ids) * self.page_bytes
        self.control.offload_done(page_ids, ok)

    def _pending(self) -> bool:
        return self.offloader is not None and self.offloader.pending > 0

    def _publish(self) -> None:
        if self.on_stats is not None:
            try:
                self.on_stats(self.stats())
            except Exception:
                logger.warning("publishing offload stats failed", exc_info=True)
