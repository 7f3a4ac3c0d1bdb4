"""OffloadWorker: put -> reap for committed pages, on one background thread.

Used by a process that does not own the page table (kv_offload). Call order:

    worker = OffloadWorker(control, store, ...)   # control: ControlClient to the owner
    worker.start()
    done = control.commit_many(lease_ids)         # per batch of finished requests: pages pinned for offload
    worker.submit(c.namespace, token_ids, c.items)  # per Committed c; returns at once
    ...
    left = worker.stop(flush_timeout_s)           # put what is queued, wait for every put

For each submission the thread submits one `put_async` for the pages (`Offloader.launch`), and
between submissions reaps finished puts (`Offloader.reap`), which reports each put to the owner
(`control.offload_done`) so the pages are unpinned. Store trouble never blocks `submit`: a failed
put is reported `ok=False` (the pages stay cached on the device, only the host copy is missing).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Sequence

from kvlifecycle.hashing import TokenIds
from kvlifecycle.manager import Offloader
from kvlifecycle.page_table import OffloadItem

logger = logging.getLogger(__name__)

_STOP = object()


class OffloadWorker:
    def __init__(self, control, store, page_bytes: int, page_size: int,
                 reap_interval_s: float = 0.005) -> None:
        self.control = control
        self.store = store
        self.page_bytes = page_bytes
        self.reap_interval_s = reap_interval_s
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="offload-worker", daemon=True)
        self._stats = {"offloaded_pages": 0, "offloaded_bytes": 0}
        self.offloader = (Offloader(store, page_size, self._done) if store is not None else None)

    def start(self) -> None:
        self._thread.start()

    def submit(self, namespace: str, token_ids: TokenIds, items: Sequence[OffloadItem]) -> None:
        """Queue the committed pages `items` of the request `token_ids` (keyed in the lease's
        `namespace`) for offload; never blocks."""
        if items:
            self._queue.put((namespace, token_ids, items))

    def stop(self, flush_timeout_s: float) -> int:
        """Put every queued page, wait up to `flush_timeout_s` for every put; returns the
        number of puts still pending (0 when everything reached the host store)."""
        self._queue.put(_STOP)
        self._thread.join()
        left = 0
        if self.offloader is not None:
            self.offloader.flush(flush_timeout_s)
            left = self.offloader.pending
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
                self._put(*item)
            if self.offloader is not None:
                self.offloader.reap()

    def _put(self, namespace: str, token_ids: TokenIds, items: Sequence[OffloadItem]) -> None:
        if self.offloader is None:
            self._done([it.page_id for it in items], False)
        else:
            self.offloader.launch(namespace, token_ids, items)

    def _done(self, page_ids: list[int], ok: bool) -> None:
        if ok:
            self._stats["offloaded_pages"] += len(page_ids)
            self._stats["offloaded_bytes"] += len(page_ids) * self.page_bytes
        self.control.offload_done(page_ids, ok)

    def _pending(self) -> bool:
        return self.offloader is not None and self.offloader.pending > 0
