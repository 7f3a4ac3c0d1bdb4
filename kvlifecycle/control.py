"""The control plane between the owner of the page table and the other processes.

The owner (``kv_lookup_alloc``) runs ``ControlServer(manager, endpoint)``: a background
thread with a pyzmq ROUTER socket on ``ipc://<dir>/<name>`` where ``<dir>`` has mode 0700
(created if missing; refused if group or others may enter it). Other processes
(``kv_offload``) use ``ControlClient(endpoint)``:

- ``commit(lease_id) -> list[OffloadItem]``: the lease's new full pages become visible; the
  returned pages are pinned until ``offload_done``.
- ``commit_many(lease_ids) -> list[Committed]``: the same for a batch in one round trip; each
  names the lease's namespace with its pages.
- ``offload_done(page_ids, ok) -> int``: drop offload pins (after the put was reaped).
- ``abort(lease_id) -> bool``: return every page of a lease (failure, cancellation).
- ``stats() -> dict`` and ``ping()``.

Promises: the server applies requests one at a time in arrival order, on its own thread, and
calls ``manager.expire_leases()`` at least every ``expire_interval_s`` (between requests when
busy, on poll timeouts when idle). Messages are ``kvlifecycle.rpc`` frames (JSON header, never
pickle)::

    request: {"op": "commit"|"commit_many"|"offload_done"|"abort"|"stats"|"ping", "args": {...}}
    reply:   {"rpc": RpcStatus value, "result": ..., "error": str}

A client call raises ``ControlTimeout`` when no reply came within ``timeout_s`` (the server
may or may not have applied it; a late reply is discarded), and ``ControlError`` (carrying the
``RpcStatus``) for any status other than OK. A client is thread-safe (one lock per client; one
call at a time).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Sequence

import numpy as np
import zmq

from kvlifecycle.manager import KVCacheManager
from kvlifecycle.page_table import Committed, OffloadItem
from kvlifecycle.rpc import TIMEOUTS, RpcClient, RpcStatus, answer, prepare_ipc_dir

logger = logging.getLogger(__name__)

__all__ = ["ControlClient", "ControlError", "ControlServer", "ControlTimeout"]


class ControlError(RuntimeError):
    def __init__(self, op: str, status: RpcStatus, message: str) -> None:
        super().__init__(f"control {op}: server replied {status.value}: {message}")
        self.op = op
        self.status = status


class ControlTimeout(TimeoutError):
    """No reply within the client's timeout (is the owner process running?)."""


class ControlServer:
    """Serves one ``KVCacheManager`` on ``endpoint`` from a background thread; see the module
    docstring. Started by the constructor (bind errors raise there); ``close()`` stops it."""

    def __init__(self, manager: KVCacheManager, endpoint: str, *, expire_interval_s: float = 1.0) -> None:
        prepare_ipc_dir(endpoint)
        self.manager = manager
        self.endpoint = endpoint
        self.expire_interval_s = expire_interval_s
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._bind_error: BaseException | None = None
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kvlifecycle-control", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._bind_error is not None:
            self._thread.join()
            self._ctx.term()
            raise self._bind_error

    # -- public API ---------------------------------------------------------------------

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and remove the socket file; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout_s)
        self._ctx.term()

    def __enter__(self) -> "ControlServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(self.endpoint)
        except BaseException as e:  # reported to the constructor
            self._bind_error = e
            sock.close()
            self._ready.set()
            return
        self._ready.set()
        poll_ms = max(1, int(self.expire_interval_s * 1000 / 2))
        next_expire = time.monotonic() + self.expire_interval_s
        try:
            while not self._stop.is_set():
                if sock.poll(poll_ms, zmq.POLLIN):
                    reply, _status = answer(sock.recv_multipart(), self._handle)
                    sock.send_multipart(reply)
                if time.monotonic() >= next_expire:
                    self._expire()
                    next_expire = time.monotonic() + self.expire_interval_s
        finally:
            sock.close()
            path = self.endpoint[len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)

    def _expire(self) -> None:
        try:
            self.manager.expire_leases()
        except Exception:
            logger.error("expire_leases failed", exc_info=True)

    def _handle(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """One request's reply body (``rpc.answer`` adds the status)."""
        op, args = header["op"], header.get("args", {})
        if not isinstance(args, dict):
            raise TypeError(f"'args': expected an object, got {type(args).__name__}")
        try:
            return {"result": self._apply(op, args)}
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{op}: {type(e).__name__}: {e}") from e

    def _apply(self, op: str, args: dict[str, Any]) -> Any:
        mgr = self.manager
        if op == "commit":
            return [item.to_json() for item in mgr.commit(_int(args["lease_id"]))]
        if op == "commit_many":
            lease_ids = args["lease_ids"]
            if not isinstance(lease_ids, list):
                raise TypeError(f"'lease_ids': expected a list, got {type(lease_ids).__name__}")
            return [c.to_json() for c in mgr.commit_many([_int(i) for i in lease_ids])]
        if op == "offload_done":
            pages = args["page_ids"]
            if not isinstance(pages, list):
                raise TypeError(f"'page_ids': expected a list, got {type(pages).__name__}")
            return mgr.offload_done([_int(p) for p in pages], bool(args["ok"]))
        if op == "abort":
            return mgr.abort(_int(args["lease_id"]))
        if op == "stats":
            return mgr.stats()
        if op == "ping":
            return "pong"
        raise ValueError(f"unknown op {op!r}; expected commit, commit_many, offload_done, abort, stats or ping")


class ControlClient:
    """Calls a ``ControlServer``; see the module docstring."""

    def __init__(self, endpoint: str, timeout_s: float = TIMEOUTS.control_s) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._client: RpcClient | None = RpcClient(endpoint)  # None once closed

    # -- public API ---------------------------------------------------------------------

    def commit(self, lease_id: int) -> list[OffloadItem]:
        return [OffloadItem.from_json(d) for d in self._call("commit", {"lease_id": int(lease_id)})]

    def commit_many(self, lease_ids: Sequence[int]) -> list[Committed]:
        return [Committed.from_json(d) for d in self._call("commit_many", {"lease_ids": [int(i) for i in lease_ids]})]

    def offload_done(self, page_ids: Sequence[int], ok: bool) -> int:
        return int(self._call("offload_done", {"page_ids": [int(p) for p in page_ids], "ok": bool(ok)}))

    def abort(self, lease_id: int) -> bool:
        return bool(self._call("abort", {"lease_id": int(lease_id)}))

    def stats(self) -> dict[str, int]:
        return dict(self._call("stats", {}))

    def ping(self) -> bool:
        return self._call("ping", {}) == "pong"

    def close(self) -> None:
        with self._lock:
            if self._client is not None:
                self._client.close()
                self._client = None

    def __enter__(self) -> "ControlClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        with self._lock:
            if self._client is None:
                raise RuntimeError(f"control {op}: client is closed")
            answered = self._client.call({"op": op, "args": args}, timeout_s=self.timeout_s)
        if answered is None:
            raise ControlTimeout(f"control {op}: no reply from {self.endpoint} within {self.timeout_s} s "
                                 "(is the owner process running?)")
        reply = answered[0]
        status = RpcStatus(reply["rpc"])
        if status is not RpcStatus.OK:
            raise ControlError(op, status, str(reply.get("error")))
        return reply["result"]


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an int, got {type(value).__name__} {value!r}")
    return value
