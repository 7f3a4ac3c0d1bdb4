"""Offloading committed pages to the host store: ``Offloader`` (put -> reap, driven by its
caller) and ``OffloadWorker`` (commits for its caller, puts and reaps on one background thread).

``Offloader`` is used directly by a process that owns the page table (hstu_monolithic, the
torch ops: ``done`` is ``KVCacheManager.offload_done``). ``OffloadWorker`` is used by a process
that does not own the page table (kv_offload). Call order, per batch of computed requests:

    worker = OffloadWorker(control, store, ...)   # control: ControlClient to the owner
    worker.start()
    worker.launch(lease_ids, token_ids)           # commit announced (no round trip); puts follow
    ... answer the requests ...
    left = worker.stop(flush_timeout_s)           # put what is queued, wait for every put

``launch`` announces the batch's commit to the owner as one datagram (``kvlifecycle.commit_channel``)
and returns: the owner applies it before its next lookup, so the user's next request, sent once
this answer arrived, finds the pages, and nothing on the request's path waits for the owner.
The owner sends the commits' ``Committed`` (the pages it pinned for offload) back to this
worker's reply socket. Where the owner's inbox cannot take the datagram, ``launch`` commits with
a round trip (``commit``) and queues the puts (``submit``) itself, as before the channel.

The puts are off the request's path: the worker thread submits one ``put_async`` per request
for its pages (``Offloader.launch``), and between turns reaps finished puts (``Offloader.reap``),
reporting their pages to the owner in one call (``control.offload_done``) so they are unpinned.
A put waits up to the store's RPC timeout when the store is slow or down; it never holds up a
request. A failed commit leaves the leases to expire on the owner (the answer stands: the scores
are right); a failed put is reported ``ok=False`` (the pages stay cached on the device, only the
host copy is missing).
"""
from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import zmq

from kvlifecycle.commit_channel import CommitSender
from kvlifecycle.hashing import TokenIds, tokens_as_int64
from kvlifecycle.page_table import Committed, OffloadItem
from kvlifecycle.pool import slots_for_pages
from kvlifecycle.queues import STOP, drain
from kvlifecycle.rpc import decode
from kvlifecycle.store.api import Status

if TYPE_CHECKING:
    from kvlifecycle.store.api import HostStoreClient

logger = logging.getLogger(__name__)



class Offloader:
    """Puts committed pages into the host store and reaps the puts, off the request path.

    ``launch(namespace, token_ids, items)`` submits one ``put_async`` for a commit's
    ``OffloadItem``s (under the lease's namespace, ``Committed.namespace``) and
    returns at once; ``reap()`` polls (``try_wait``) or ``flush(timeout_s)`` waits, and reports
    the pages of the puts it found finished with one ``done(page_ids, ok)`` per outcome
    (``KVCacheManager.offload_done`` or ``ControlClient.offload_done``): each put's pages exactly
    once, and one owner round trip per reap rather than one per put (a put per request). A put
    that cannot be submitted is reported ``ok=False`` at once. Puts are reaped in any order.
    Thread-safe (one lock around the pending table; store calls outside it)."""

    def __init__(self, store: "HostStoreClient", page_size: int,
                 done: Callable[[list[int], bool], object]) -> None:
        self.store = store
        self.page_size = page_size
        self.done = done
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[list[int], float]] = {}  # task -> (page ids, submit time)
        self.counters = {"puts": 0, "puts_ok": 0, "puts_failed": 0, "submit_errors": 0,
                         "reaps": 0, "reap_latency_s_sum": 0.0}

    def launch(self, namespace: str, token_ids: TokenIds, items: Sequence[OffloadItem]) -> int | None:
        """Submit the put of ``items`` (pages of the request ``token_ids``, keyed in the lease's
        ``namespace``); the task id, or None when there was nothing to put or the store refused
        (pages reported failed)."""
        if not items:
            return None
        S = self.page_size
        items = sorted(items, key=lambda it: it.prefix_len)
        end = items[-1].prefix_len
        page_ids = [it.page_id for it in items]
        try:
            tokens = tokens_as_int64(token_ids)
            assert end <= tokens.size, (
                f"Offloader.launch: items reach token {end}, got only {tokens.size} token ids"
            )
            mask = np.zeros(end, dtype=bool)
            for it in items:
                mask[it.prefix_len - S: it.prefix_len] = True
            task = self.store.put_async(tokens[:end], slots_for_pages(page_ids, S), namespace, mask)
        except Exception:
            logger.warning("host store put_async failed for %d pages", len(page_ids), exc_info=True)
            self.counters["submit_errors"] += 1
            self._report(page_ids, False)
            return None
        with self._lock:
            self._pending[task] = (page_ids, time.monotonic())
            self.counters["puts"] += 1
        return task

    def reap(self) -> int:
        """Report every finished put without blocking; returns how many were reaped."""
        return self._collect(None)

    def flush(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for every pending put and report them; puts still running
        stay pending. Returns how many were reaped."""
        return self._collect(timeout_s)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    # -- helpers ------------------------------------------------------------------------

    def _collect(self, timeout_s: float | None) -> int:
        with self._lock:
            tasks = list(self._pending)
        if not tasks:
            return 0
        try:
            statuses = self.store.try_wait(tasks) if timeout_s is None else self.store.wait(tasks, timeout_s)
        except Exception:
            logger.warning("host store poll failed for %d puts", len(tasks), exc_info=True)
            return 0
        finished: dict[bool, list[int]] = {True: [], False: []}  # pages by outcome
        reaped = 0
        for task in tasks:
            status = statuses.get(task)
            if status is None or not Status(status).done:
                continue
            with self._lock:
                entry = self._pending.pop(task, None)
                if entry is None:
                    continue
                page_ids, submitted = entry
                ok = Status(status) is Status.SUCCESS
                self.counters["puts_ok" if ok else "puts_failed"] += 1
                self.counters["reaps"] += 1
                self.counters["reap_latency_s_sum"] += time.monotonic() - submitted
            finished[ok].extend(page_ids)
            reaped += 1
        for ok, page_ids in finished.items():
            if page_ids:
                self._report(page_ids, ok)
        return reaped

    def _report(self, page_ids: list[int], ok: bool) -> None:
        try:
            self.done(page_ids, ok)
        except Exception:
            logger.warning("offload_done(%d pages, ok=%s) failed; the pins expire instead",
                           len(page_ids), ok, exc_info=True)


class OffloadWorker:
    """See the module docstring. ``before_put()`` runs before a turn's first put (kv_offload
    registers the owner's pool with the store there); ``on_commit(seconds, leases)`` is told
    each commit's time on the caller's path (an announcement, or a round trip) and size."""

    def __init__(self, control, store, page_bytes: int, page_size: int, reap_interval_s: float = 0.005,
                 before_put: Callable[[], None] = lambda: None,
                 on_commit: Callable[[float, int], None] = lambda seconds, leases: None) -> None:
        self.control = control  # ControlClient: thread-safe, used by the caller and the thread
        self.store = store
        self.page_bytes = page_bytes
        self.reap_interval_s = reap_interval_s
        self.before_put = before_put
        self.on_commit = on_commit
        # lists of (namespace, token_ids, items), or dicts of announced lease id -> token ids; then STOP
        self._to_put: queue.Queue = queue.Queue()
        self._put_thread = threading.Thread(target=self._put_loop, name="offload-worker", daemon=True)
        self._stats = {"offloaded_pages": 0, "offloaded_bytes": 0, "commits_announced": 0,
                       "commits_round_trip": 0, "commit_replies_unmatched": 0}
        self.offloader = (Offloader(store, page_size, self._done) if store is not None else None)
        # Announced commits waiting for their other half (this thread's): the request's token ids,
        # or the owner's Committed, by lease id, with when it came.
        self._tokens: dict[int, tuple[TokenIds, float]] = {}
        self._committed: dict[int, tuple[Committed, float]] = {}
        self._stop_by = float("inf")  # stop(): announced commits are waited for until then
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._ctx = zmq.Context()
        self._sender: CommitSender | None = None
        reply_endpoint = f"{control.endpoint}.offload-{os.getpid()}-{next(_WORKERS)}"
        self._replies: zmq.Socket | None = self._ctx.socket(zmq.PULL)
        self._replies.setsockopt(zmq.LINGER, 0)
        try:
            self._replies.bind(reply_endpoint)
            self._sender = CommitSender(control.endpoint, reply_endpoint)
        except (zmq.ZMQError, ValueError) as e:  # e.g. a path past the ipc limit: commit by round trip
            logger.warning("offload: cannot bind %s (%s); commits take a round trip", reply_endpoint, e)
            self._replies.close()
            self._replies = None

    def start(self) -> None:
        self._put_thread.start()

    def launch(self, lease_ids: Sequence[int], token_ids: Sequence[TokenIds]) -> list[int] | None:
        """Commit ``lease_ids`` (announced, or with a round trip when the owner's inbox cannot
        take it) and have their new pages put, keyed by each request's ``token_ids`` (which must
        not share memory with a request that ends when ``execute`` returns); returns once the
        commit is announced (None: the owner tells the worker the pages) or done (the pages to
        put per lease)."""
        if not lease_ids:
            return []
        started = time.perf_counter()
        if self._sender is not None and self._sender.send(lease_ids):
            # Not woken: the owner's reply wakes the thread. Woken now, it would take this
            # process's GIL while the stub sends the answers.
            self._to_put.put(dict(zip(lease_ids, token_ids)))
            self._stats["commits_announced"] += 1
            self.on_commit(time.perf_counter() - started, len(lease_ids))
            return None
        self._stats["commits_round_trip"] += 1
        committed = self.commit(lease_ids)
        self.submit([(c.namespace, tokens, c.items) for c, tokens in zip(committed, token_ids) if c.items])
        return [len(c.items) for c in committed]

    def commit(self, lease_ids: Sequence[int]) -> list[Committed]:
        """Commit ``lease_ids`` with the owner in one round trip; per lease its ``Committed``
        (no items for an unknown lease, or for every lease when the round trip failed)."""
        if not lease_ids:
            return []
        started = time.perf_counter()
        try:
            committed = self.control.commit_many(lease_ids)
        except Exception:
            logger.warning("commit of leases %s failed; their pages return on expiry", list(lease_ids), exc_info=True)
            return [Committed(lease_id, "", ()) for lease_id in lease_ids]
        self.on_commit(time.perf_counter() - started, len(lease_ids))
        return committed

    def submit(self, puts: Sequence[tuple[str, TokenIds, Sequence[OffloadItem]]]) -> None:
        """Queue committed pages to put, ``(namespace, token_ids, items)`` each (the token ids the
        request's pages are keyed by; they must not share memory with a request that ends when
        ``execute`` returns); never blocks."""
        if puts:
            self._to_put.put(list(puts))
            self._wake()

    def stop(self, flush_timeout_s: float) -> int:
        """Put everything queued (the owner's replies to announced commits waited for up to
        ``REPLY_WAIT_ON_STOP_S``: they come within milliseconds, unless the owner stopped first),
        wait up to `flush_timeout_s` for every put; returns the number of puts still pending (0
        when everything reached the host store)."""
        self._stop_by = time.monotonic() + min(flush_timeout_s, REPLY_WAIT_ON_STOP_S)
        self._to_put.put(STOP)
        self._wake()
        self._put_thread.join()
        left = 0
        if self.offloader is not None:
            self.offloader.flush(flush_timeout_s)
            left = self.offloader.pending
        if self._sender is not None:
            self._sender.close()
        self._ctx.term()
        os.close(self._wake_r)
        os.close(self._wake_w)
        return left

    def stats(self) -> dict[str, float]:
        stats = dict(self._stats)
        # announced commits not yet put count as queued: a bench waits for this to reach 0
        stats["offload_queue_depth"] = (self._to_put.qsize() + len(self._tokens)
                                        + (self.offloader.pending if self.offloader else 0))
        if self.offloader is not None:
            stats.update(self.offloader.counters)
        if self.store is not None:
            stats["store_errors"] = self.store.stats().get("errors", 0)
        return stats

    # ---- helpers ----------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except BlockingIOError:  # wake-ups already pending: the thread is about to look
            pass

    def _put_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if self._replies is not None:
            poller.register(self._replies, zmq.POLLIN)
        stopping = False
        try:
            while True:
                busy = self._pending() or self._tokens or self._committed
                ready = dict(poller.poll(1000 * (self.reap_interval_s if busy else 0.5)))
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                puts, stop = self._take_queued()
                stopping = stopping or stop
                puts += self._matched_replies()
                if puts:
                    self.before_put()
                    for namespace, token_ids, items in puts:
                        try:
                            self._put(namespace, token_ids, items)
                        except Exception:  # a bug: these pages stay on the device only; the thread goes on
                            logger.error("offload: a put failed unexpectedly", exc_info=True)
                            self._done([it.page_id for it in items], False)
                if stopping and (not self._tokens or time.monotonic() > self._stop_by):
                    self._forget_unmatched(0.0)
                    return
                self._forget_unmatched(UNMATCHED_TIMEOUT_S)
                if self.offloader is not None:
                    self.offloader.reap()
        finally:
            if self._replies is not None:
                self._replies.close()

    def _take_queued(self) -> tuple[list, bool]:
        """The puts queued by ``submit`` (announced token ids are kept for their replies), and
        whether STOP came."""
        try:
            first = self._to_put.get_nowait()
        except queue.Empty:
            return [], False
        items, stop = drain(self._to_put, first)
        puts = []
        now = time.monotonic()
        for item in items:
            if isinstance(item, dict):
                self._tokens.update((lease_id, (tokens, now)) for lease_id, tokens in item.items())
            else:
                puts.extend(item)
        return puts, stop

    def _matched_replies(self) -> list:
        """Read the owner's replies to announced commits; the puts of every lease whose reply and
        token ids are both here."""
        now = time.monotonic()
        while self._replies is not None:
            try:
                frames = self._replies.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                header, _ = decode(frames[1:] if frames and frames[0] == b"" else frames)
                for c in (Committed.from_json(d) for d in header["committed"]):
                    self._committed[c.lease_id] = (c, now)
            except (ValueError, KeyError, TypeError):
                logger.error("offload: malformed commit reply from the owner dropped", exc_info=True)
        puts = []
        for lease_id in [i for i in self._committed if i in self._tokens]:
            c, _ = self._committed.pop(lease_id)
            tokens, _ = self._tokens.pop(lease_id)
            if c.items:
                puts.append((c.namespace, tokens, c.items))
        return puts

    def _forget_unmatched(self, older_than_s: float) -> None:
        """Drop halves that waited longer than ``older_than_s``: token ids whose reply the owner
        never sent (it restarted; the leases are gone), and replies without token ids (a bug),
        whose pinned pages are reported failed so they are unpinned now."""
        deadline = time.monotonic() - older_than_s
        for lease_id in [i for i, (_, at) in self._tokens.items() if at <= deadline]:
            del self._tokens[lease_id]
            self._stats["commit_replies_unmatched"] += 1
        for lease_id in [i for i, (_, at) in self._committed.items() if at <= deadline]:
            c, _ = self._committed.pop(lease_id)
            self._stats["commit_replies_unmatched"] += 1
            if c.items:
                self._done([it.page_id for it in c.items], False)

    def _put(self, namespace: str, token_ids: TokenIds, items: Sequence[OffloadItem]) -> None:
        if self.offloader is None:
            self._done([it.page_id for it in items], False)
            return
        self.offloader.launch(namespace, token_ids, items)

    def _done(self, page_ids: list[int], ok: bool) -> None:
        if ok:
            self._stats["offloaded_pages"] += len(page_ids)
            self._stats["offloaded_bytes"] += len(page_ids) * self.page_bytes
        self.control.offload_done(page_ids, ok)

    def _pending(self) -> bool:
        return self.offloader is not None and self.offloader.pending > 0


_WORKERS = itertools.count()  # reply endpoints of this process's workers
# An announced commit's two halves (the request's token ids here, the owner's reply) normally
# meet within milliseconds; one alone this long is left over from an owner restart.
UNMATCHED_TIMEOUT_S = 30.0
REPLY_WAIT_ON_STOP_S = 2.0
