"""The store server's copy thread and the table of its tasks.

Operations, in the order a task meets them:

1. ``submit(task)`` (socket thread): the task is recorded under (client, task id) and queued.
2. The copy thread takes tasks in arrival order (FIFO, so a client's tasks run in the order it
   sent them) and runs each through its pool's backing (``backing.put``/``get``), unless it was
   cancelled or its ``start_by`` (CLOCK_MONOTONIC, set by the client) has passed: a task not
   started by then fails without touching the pool, so a client that gave up on it may reuse
   its pages after that deadline.
3. ``poll(client, task_ids)``: each task's status; a done status is reported once, then the
   task is forgotten. An unknown task is FAILED (lost, e.g. the store restarted).
   ``any_done(client, task_ids)`` says whether such a poll would report one; the worker calls
   ``on_done()`` (from the copy thread) after each task ends, so the server's socket thread can
   answer a poll that waits for one (``server.py``) without polling itself.
4. ``cancel(client, task_ids)``: tasks not started yet end CANCELLED.
5. ``forget_stale(now)``: drop done tasks nobody polled for ``DONE_TASK_TTL_S``.
6. ``stop()``: run what is queued, then end the thread.

Ordering guarantee: one thread runs every task, one at a time, in arrival order; a task is
done (SUCCESS, NOTFOUND, FAILED) only after its backing call returned.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from kvlifecycle.hashing import page_keys
from kvlifecycle.store.api import Status
from kvlifecycle.store.pools import AttachedPool
from kvlifecycle.store.protocol import Op

logger = logging.getLogger(__name__)

__all__ = ["CopyTask", "CopyWorker", "DONE_TASK_TTL_S"]

DONE_TASK_TTL_S = 300.0  # a finished task nobody polled is forgotten after this


@dataclass
class CopyTask:
    client: str
    task_id: int
    op: Op  # Op.PUT or Op.GET
    pool: AttachedPool
    namespace: str
    tokens: np.ndarray      # int64: the prefix whose page keys name the pages
    seq_pages: np.ndarray   # int64 [n]: page indices within the sequence
    pool_pages: np.ndarray  # int64 [n]: page ids in the pool, same order
    start_by: float         # CLOCK_MONOTONIC
    page_keys: list[bytes] | None = None  # the keys of tokens' full pages, when already hashed (get_prefix)
    status: Status = Status.UNREADY
    started: bool = False
    finished_at: float = 0.0


class CopyWorker:
    """See the module docstring. ``start()`` once, ``stop()`` once."""

    def __init__(self) -> None:
        self.on_done: Callable[[], None] = lambda: None  # set by the server before start()
        self._lock = threading.Lock()  # guards _tasks and each task's status/started
        self._tasks: dict[tuple[str, int], CopyTask] = {}
        self._queue: queue.Queue[CopyTask | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvstore-copy", daemon=True)
        self.counters = collections.Counter[str]()

    # -- public API ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Run every queued task, then end the copy thread."""
        self._queue.put(None)
        self._thread.join()

    def submit(self, task: CopyTask) -> None:
        """Queue ``task``; ValueError when this client already submitted that task id."""
        with self._lock:
            if (task.client, task.task_id) in self._tasks:
                raise ValueError(f"task {task.task_id}: already submitted by this client")
            self._tasks[(task.client, task.task_id)] = task
        self._queue.put(task)

    def poll(self, client: str, task_ids: list[int]) -> dict[int, Status]:
        out: dict[int, Status] = {}
        with self._lock:
            for task_id in task_ids:
                task = self._tasks.get((client, task_id))
                if task is None:
                    out[task_id] = Status.FAILED  # unknown: lost (e.g. the store restarted)
                elif task.status.done:
                    out[task_id] = task.status
                    del self._tasks[(client, task_id)]
                else:
                    out[task_id] = Status.UNREADY
        return out

    def any_done(self, client: str, task_ids: list[int]) -> bool:
        """Whether ``poll(client, task_ids)`` would report at least one task done (or unknown)."""
        with self._lock:
            for task_id in task_ids:
                task = self._tasks.get((client, task_id))
                if task is None or task.status.done:
                    return True
        return False

    def cancel(self, client: str, task_ids: list[int]) -> None:
        with self._lock:
            for task_id in task_ids:
                task = self._tasks.get((client, task_id))
                if task is not None and not task.started and not task.status.done:
                    task.status, task.finished_at = Status.CANCELLED, time.monotonic()

    def forget_stale(self, now: float) -> None:
        with self._lock:
            stale = [k for k, t in self._tasks.items() if t.status.done and now - t.finished_at > DONE_TASK_TTL_S]
            for key in stale:
                del self._tasks[key]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"tasks": len(self._tasks), "queued": self._queue.qsize(), **self.counters}

    def copy(self, task: CopyTask) -> Status:
        """One task's copy through its pool's backing (copy thread)."""
        backing = task.pool.backing
        all_keys = task.page_keys or page_keys(task.tokens, task.namespace, task.pool.pool.spec.page_size)
        keys = [all_keys[i] for i in task.seq_pages]
        if task.op is Op.PUT:
            return backing.put(task.pool.copier, task.pool_pages, keys)
        return backing.get(task.pool.copier, task.pool_pages, keys)

    # -- helpers (copy thread) ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            with self._lock:
                if task.status is Status.CANCELLED:
                    continue
                expired = time.monotonic() > task.start_by
                if expired:
                    task.status, task.finished_at = Status.FAILED, time.monotonic()
                    self.counters["expired_tasks"] += 1
                task.started = not expired
            if expired:
                self.on_done()
                continue
            try:
                status = self.copy(task)
            except Exception:
                logger.error("task %s %d of client %s failed", task.op.value, task.task_id, task.client,
                             exc_info=True)
                status = Status.FAILED
            outcome = f"{task.op.value}_{status.value.lower()}"
            with self._lock:
                task.status, task.finished_at = status, time.monotonic()
                self.counters[outcome] += 1
                task.pool.counters[outcome] += 1
            self.on_done()
