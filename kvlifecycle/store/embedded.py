"""Client of the store server (``python -m kvlifecycle.store``, whatever its backing: local or
Mooncake; ``processes.start_store_process`` starts one as a child process).

Every RPC has a timeout. A timeout closes the socket (a fresh one is made on the next call:
the "lazy pirate" pattern) and opens a short back-off window in which calls fail at once
instead of waiting again. While the store is unreachable the client fails open:
``get_prefix_async`` reports nothing held, puts and gets report FAILED, and ``stats()`` counts each error; one
warning is logged per outage and one info line when the store answers again.

Safety of giving up: a put/get request carries ``accept_by`` (the RPC deadline) and
``start_by`` (``task_start_timeout_s`` after sending). The server refuses a request that
arrives after ``accept_by`` and never starts a task after ``start_by``. So a task whose
submit RPC timed out is FAILED at once, and a submitted task is reported FAILED while the
store is unreachable only once ``start_by`` (plus a grace) passed: its pool pages can then
be reused without the store reading or writing them later.

Pools: every put/get names the device page pool it copies to/from (``protocol.pool_id`` of
the client's handle), so several pool owners can share one store. A client knows its pool
from ``pool_handle=`` (a process that only offloads from another process's pool, e.g.
``kv_offload``, passes the owner's published handle) or from its last ``register_pool``. It
registers lazily: when the server answers ``NO_POOL`` (first use, store restarted, pool not
yet attached) the client sends ``register_pool`` and retries once. A client with no pool
cannot put or get (the server answers ``NO_POOL``).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from typing import Any, Sequence

import numpy as np

from kvlifecycle.hashing import TokenIds, tokens_as_int64
from kvlifecycle.rpc import TIMEOUTS, RpcClient, RpcStatus
from kvlifecycle.store.api import (DEFAULT_WAIT_TIMEOUT_S, HostStoreClient, Located, PageSelection, Status,
                                  select_pages)
from kvlifecycle.store.key_filter import KeyFilterReader, key_filter_path
from kvlifecycle.store.protocol import Op, keys_to_words, pool_id

logger = logging.getLogger(__name__)

__all__ = ["StoreProcessClient"]

_GRACE_S = 1.0  # after start_by, for a copy that had just started
_EARLY_REPLY_S = 0.0005  # wait's first pause after a poll answered early with nothing done
_MAX_EARLY_REPLY_PAUSE_S = 0.002  # ... doubling up to this (a store that is down answers nothing)
# The longest one waiting poll may ask the server to hold it: a store that dies meanwhile holds the
# caller this long plus one RPC timeout, then the client fails open as for any unanswered RPC.
_MAX_POLL_WAIT_S = 1.0


class StoreProcessClient(HostStoreClient):
    """``HostStoreClient`` over pyzmq (DEALER) to one store process (`python -m kvlifecycle.store`,
    any backing, and FlexKV's store process, which speaks the same protocol). Thread-safe (one lock
    around the socket). Task ids are chosen by the client, increasing from 1.

    Ordering guarantee: tasks are queued by the server in the order their submit RPCs
    arrive, and one client's RPCs are sent one at a time, so a client's tasks are copied in
    submission order.

    ``pool_handle``: the ``PagePool.handle()`` of the pool this client's slots refer to (its
    own, or the one of the process it offloads for); registered with the server on first
    need. ``register_pool`` sets it too; without either, puts and gets are refused (NO_POOL).
    """

    def __init__(self, endpoint: str, page_size: int, rpc_timeout_s: float = TIMEOUTS.store_rpc_s,
                 retry_interval_s: float = TIMEOUTS.store_retry_s, task_start_timeout_s: float = TIMEOUTS.task_start_s,
                 pool_handle: dict[str, Any] | None = None,
                 register_timeout_s: float = TIMEOUTS.store_register_s) -> None:
        if not endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"endpoint: expected ipc://PATH or tcp://HOST:PORT, got {endpoint!r}")
        if not isinstance(page_size, int) or isinstance(page_size, bool) or page_size <= 0:
            raise ValueError(f"page_size: expected a positive int of tokens, got {page_size!r}")
        if rpc_timeout_s <= 0:
            raise ValueError(f"rpc_timeout_s: expected > 0 seconds, got {rpc_timeout_s}")
        if retry_interval_s < 0:
            raise ValueError(f"retry_interval_s: expected >= 0 seconds, got {retry_interval_s}")
        if task_start_timeout_s <= 0:
            raise ValueError(f"task_start_timeout_s: expected > 0 seconds, got {task_start_timeout_s}")
        self.endpoint = endpoint
        self.page_size = page_size
        self.rpc_timeout_s = rpc_timeout_s
        self.retry_interval_s = retry_interval_s
        self.task_start_timeout_s = task_start_timeout_s
        # Attaching a pool is slower than a request's RPC (rpc.Timeouts.store_register_s); a
        # timeout here was counted as a store error on every clean start.
        self.register_timeout_s = register_timeout_s
        self._pool_handle = pool_handle
        self._pool_id = pool_id(pool_handle) if pool_handle is not None else None
        self._client_id = uuid.uuid4().hex
        self._client = RpcClient(endpoint)  # used under self._lock
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._up = True
        self._down_until = 0.0
        self._local: dict[int, Status] = {}           # decided here (empty, refused, unreachable)
        self._remote: dict[int, float] = {}           # submitted: task -> start_by
        self._counters = collections.Counter[str]()
        self._closed = False
        # The store's published filter of held keys (never behind _lock: a waiting poll holds that)
        filter_path = key_filter_path(endpoint)
        self._key_filter = KeyFilterReader(filter_path) if filter_path is not None else None
        self._key_filter_lock = threading.Lock()

    # -- public API ---------------------------------------------------------------------

    def register_pool(self, handle: dict[str, Any]) -> bool:
        """Make ``handle``'s pool the one this client's slots refer to, and attach it in the
        server. False when the store is unreachable or refused it (logged and counted); the
        pool is still this client's, registered again on the next ``NO_POOL``."""
        with self._lock:
            self._pool_handle = handle
            self._pool_id = pool_id(handle)
        reply = self._rpc({"op": Op.REGISTER_POOL.value, "handle": handle}, timeout_s=self.register_timeout_s)
        if reply is not None and reply["rpc"] is not RpcStatus.OK:
            self._count_refusal("register_pool", reply)
        if reply is not None and reply["rpc"] is RpcStatus.OK:
            self.slab = reply.get("slab")
        return reply is not None and reply["rpc"] is RpcStatus.OK

    def locate(self, key_lists: Sequence[Sequence[bytes]], pin_s: float) -> Located | None:
        offsets = np.zeros(len(key_lists) + 1, dtype=np.int64)
        np.cumsum([len(keys) for keys in key_lists], out=offsets[1:])
        keys = keys_to_words([key for keys in key_lists for key in keys])
        reply = self._rpc({"op": Op.LOCATE.value, "page_size": self.page_size, "pin_s": pin_s},
                          {"keys": keys, "offsets": offsets})
        if reply is None:
            return None
        if reply["rpc"] is not RpcStatus.OK:
            self._count_refusal("locate", reply)
            return None
        self.slab = reply["slab"]
        return Located(slab=reply["slab"], rows=[np.asarray(r, dtype=np.int64) for r in reply["rows"]],
                       versions=[np.asarray(v, dtype=np.int64) for v in reply["versions"]])

    def put_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds | None = None) -> int:
        sel = select_pages(token_ids, slot_mapping, token_mask, self.page_size, "put_async")
        return self._submit(Op.PUT, next(self._ids), sel, namespace)

    def get_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds) -> int:
        sel = select_pages(token_ids, slot_mapping, token_mask, self.page_size, "get_async")
        return self._submit(Op.GET, next(self._ids), sel, namespace)

    def get_prefix_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                         first_page: int) -> tuple[int | None, int]:
        tokens = tokens_as_int64(token_ids)
        S = self.page_size
        candidates = np.zeros(tokens.size, dtype=bool)
        candidates[first_page * S: tokens.size // S * S] = True
        sel = select_pages(tokens, slot_mapping, candidates, S, "get_prefix_async")
        if sel.seq_pages.size == 0:
            raise ValueError(f"get_prefix_async: first_page {first_page} leaves no full page of "
                             f"{tokens.size} tokens to copy; ask only for pages past the device prefix")
        task_id = next(self._ids)
        reply, start_by = self._send_task(Op.GET_PREFIX, task_id, sel, namespace)
        if reply is None or reply["rpc"] is not RpcStatus.OK:
            if reply is not None:
                self._count_refusal(Op.GET_PREFIX.value, reply)
            self._counters["get_prefix_failed"] += 1
            return None, 0
        held = int(reply["pages"])
        assert 0 <= held <= tokens.size // S, f"get_prefix_async: store claims {held} of {tokens.size // S} pages"
        self._counters["match_pages"] += held
        if not reply["copying"]:
            return None, held
        with self._lock:
            self._remote[task_id] = start_by
            self._counters["get_submitted"] += 1
        return task_id, held

    def may_hold(self, keys: Sequence[bytes]) -> int:
        """From the filter the store publishes beside its ipc:// socket (``key_filter.py``); all of
        ``keys`` when it publishes none there (tcp://, a Mooncake or FlexKV store, not started)."""
        if self._key_filter is None:
            return len(keys)
        with self._key_filter_lock:
            return self._key_filter.may_hold(keys)

    def wait(self, task_ids: Sequence[int], timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> dict[int, Status]:
        deadline = time.monotonic() + timeout_s
        out: dict[int, Status] = {}
        pending = list(task_ids)
        pause = _EARLY_REPLY_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            done = {t: s for t, s in self.try_wait(pending, wait_s=left).items() if s.done}
            if not done and time.monotonic() < deadline - pause:
                # a server that answers polls at once (FlexKV's store), or none while it is down
                time.sleep(pause)
                pause = min(2 * pause, _MAX_EARLY_REPLY_PAUSE_S)
            out.update(done)
            pending = [t for t in pending if t not in out]
        out.update({t: Status.TIMEOUT for t in pending})
        return {t: out[t] for t in task_ids}

    def try_wait(self, task_ids: Sequence[int], wait_s: float = 0.0) -> dict[int, Status]:
        out: dict[int, Status] = {}
        remote: list[int] = []
        with self._lock:
            for task_id in task_ids:
                if task_id in self._local:
                    out[task_id] = self._local.pop(task_id)
                elif task_id in self._remote:
                    remote.append(task_id)
                else:
                    raise ValueError(f"try_wait: unknown task {task_id} (never submitted, or already reaped)")
        if not remote:
            return out
        if out or wait_s <= 0:  # one is done already: answer now
            reply = self._rpc({"op": Op.POLL.value, "tasks": remote})
        else:  # the server answers once one of them is done, or after wait_s
            wait_s = min(wait_s, _MAX_POLL_WAIT_S)
            reply = self._rpc({"op": Op.POLL.value, "tasks": remote, "wait_s": wait_s},
                              timeout_s=wait_s + self.rpc_timeout_s)
        now = time.monotonic()
        with self._lock:
            for task_id in remote:
                if reply is not None and reply["rpc"] is RpcStatus.OK:
                    status = Status(reply["tasks"][str(task_id)])
                elif now > self._remote[task_id] + _GRACE_S:
                    status = Status.FAILED  # unreachable past start_by: it will never run
                else:
                    status = Status.UNREADY
                if status.done:
                    del self._remote[task_id]
                    self._counters[f"task_{status.value.lower()}"] += 1
                out[task_id] = status
        return out

    def cancel(self, task_ids: Sequence[int]) -> None:
        remote: list[int] = []
        with self._lock:
            for task_id in task_ids:
                if task_id in self._remote:
                    remote.append(task_id)
        if remote:
            self._rpc({"op": Op.CANCEL.value, "tasks": remote})

    def ping(self) -> bool:
        reply = self._rpc({"op": Op.PING.value})
        return reply is not None and reply["rpc"] is RpcStatus.OK

    def server_stats(self) -> dict[str, Any] | None:
        """The server's counters (``stats`` RPC), or None when unreachable."""
        reply = self._rpc({"op": Op.STATS.value})
        return reply["stats"] if reply is not None and reply["rpc"] is RpcStatus.OK else None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"backend": "embedded", "endpoint": self.endpoint, "up": self._up,
                    "pending_tasks": len(self._remote), **self._counters, **self._client.counters}

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._client.close()
        with self._key_filter_lock:
            if self._key_filter is not None:
                self._key_filter.close()

    # -- helpers ------------------------------------------------------------------------

    def _submit(self, op: Op, task_id: int, sel: PageSelection, namespace: str) -> int:
        if sel.seq_pages.size == 0:
            with self._lock:
                self._local[task_id] = Status.SUCCESS
            return task_id
        reply, start_by = self._send_task(op, task_id, sel, namespace)
        with self._lock:
            if reply is not None and reply["rpc"] is RpcStatus.OK:
                self._remote[task_id] = start_by
                self._counters[f"{op.value}_submitted"] += 1
            else:
                if reply is not None:
                    self._count_refusal(op.value, reply)
                self._local[task_id] = Status.FAILED
                self._counters[f"{op.value}_failed"] += 1
        return task_id

    def _send_task(self, op: Op, task_id: int, sel: PageSelection,
                   namespace: str) -> tuple[dict[str, Any] | None, float]:
        """Submit a copy task; its reply (None: unreachable) and the time it must start by."""
        start_by = time.monotonic() + self.task_start_timeout_s
        header = {"op": op.value, "task": task_id, "ns": namespace, "page_size": self.page_size,
                  "start_by": start_by}
        if self._pool_id is not None:
            header["pool"] = self._pool_id
        arrays = {"tokens": sel.tokens, "seq_pages": sel.seq_pages, "pool_pages": sel.pool_pages}
        return self._rpc(header, arrays, accept_deadline=True), start_by

    def _rpc(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None,
             accept_deadline: bool = False, retried: bool = False,
             timeout_s: float | None = None) -> dict[str, Any] | None:
        """One request/reply within ``timeout_s`` (default ``rpc_timeout_s``); its header, with
        ``rpc`` an ``RpcStatus``. None when the store is unreachable (counted and logged)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("StoreProcessClient: used after close()")
            now = time.monotonic()
            if now < self._down_until:
                self._counters["rpc_skipped_while_down"] += 1
                return None
            request = {**header, "client": self._client_id}
            if accept_deadline:
                # The server refuses the request after this, so the caller may give up at the deadline.
                request["accept_by"] = now + self.rpc_timeout_s / 2
            answered = self._client.call(request, arrays, timeout_s or self.rpc_timeout_s)
            if answered is None:
                self._mark_down(header["op"], timeout_s or self.rpc_timeout_s)
                return None
            self._mark_up()
        reply = answered[0]
        reply["rpc"] = RpcStatus(reply["rpc"])
        if reply["rpc"] is RpcStatus.NO_POOL and self._pool_handle is not None and not retried:
            if self.register_pool(self._pool_handle):
                return self._rpc(header, arrays, accept_deadline, retried=True)
        return reply

    def _mark_down(self, op: str, timeout_s: float) -> None:
        self._counters["errors"] += 1
        self._counters["rpc_timeouts"] += 1
        self._down_until = time.monotonic() + self.retry_interval_s
        if self._up:
            self._up = False
            self._counters["outages"] += 1
            logger.warning("host store %s unreachable (%s timed out after %.3f s); failing open "
                           "(misses, FAILED tasks) until it answers", self.endpoint, op, timeout_s)

    def _mark_up(self) -> None:
        if not self._up:
            self._up = True
            self._counters["reconnects"] += 1
            logger.info("host store %s answers again", self.endpoint)

    def _count_refusal(self, what: str, reply: dict[str, Any]) -> None:
        self._counters["errors"] += 1
        self._counters[f"rpc_{reply['rpc'].value}"] += 1
        logger.warning("host store refused %s: %s (%s)", what, reply["rpc"].value, reply.get("error", ""))

