"""The control plane between the owner of the page table and the other processes.

The owner (``kv_lookup_alloc``) runs ``ControlServer(manager, endpoint)``: a background
thread with a pyzmq ROUTER socket on ``ipc://<dir>/<name>`` where ``<dir>`` has mode 0700
(created if missing; refused if group or others may enter it). Other processes
(``kv_offload``) use ``ControlClient(endpoint)``:

- ``commit_many(lease_ids) -> list[Committed]``: each lease's new full pages become visible, in
  one round trip for the batch; each names the lease's namespace with its pages, pinned until
  ``offload_done``. kv_offload announces its commits without the round trip instead
  (``kvlifecycle.commit_channel``: a datagram to the server's commit inbox, applied by this
  thread and by the owner's ``drain_commits()`` before each lookup; the ``Committed`` go back to
  the endpoint the datagram names) and uses this call only when the inbox cannot take one.
- ``offload_done(page_ids, ok) -> int``: drop offload pins (after the put was reaped).
- ``abort(lease_id) -> bool``: return every page of a lease (failure, cancellation).
- ``onboard_wait(lease_ids) -> list[OnboardOutcome]``: once the onboard of every lease (started
  by the owner with ``manager.onboard_start_many``) is settled, each lease's final cached length
  and page row, or why it is gone. The consumer of the pages (hstu_compute) asks before it reads
  them; the reply is deferred, never blocking other requests.
- ``stats() -> dict`` and ``ping()``.

Promises: the server applies requests one at a time in arrival order, on its own thread, and
does nothing else (announced commits are also applied by whichever thread calls
``drain_commits()`` first). The owner's housekeeping runs on a second thread
(``housekeeping.OwnerHousekeeping``: settling onboards, expiring leases every
``expire_interval_s``), which the owner wakes with ``wake()`` after starting onboards and which
wakes this one when it settled some; the server then answers each ``onboard_wait`` whose leases
are all settled (the manager settles a late copy as a timeout, so every wait is answered within
the store timeout of its launch). Messages are ``kvlifecycle.rpc``
frames (JSON header, never pickle)::

    request: {"op": "commit_many"|"offload_done"|"abort"|"onboard_wait"|"stats"|"ping",
              "args": {...}}
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
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import zmq

from kvlifecycle.commit_channel import CommitInbox
from kvlifecycle.housekeeping import OwnerHousekeeping
from kvlifecycle.leases import Lease
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.page_table import Committed
from kvlifecycle.rpc import TIMEOUTS, RpcClient, RpcStatus, answer, decode, encode, prepare_ipc_dir

logger = logging.getLogger(__name__)

__all__ = ["ControlClient", "ControlError", "ControlServer", "ControlTimeout", "OnboardOutcome"]


@dataclass(frozen=True)
class OnboardOutcome:
    """A lease once its onboard is settled: compute reads ``[0, cached_len)`` through
    ``page_row`` and writes the rest. ``cached_len`` is None when the lease is gone (``error``
    says why): its pages are no longer the request's."""

    lease_id: int
    cached_len: int | None
    page_row: tuple[int, ...] = ()
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"lease_id": self.lease_id, "cached_len": self.cached_len, "page_row": list(self.page_row),
                "error": self.error}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "OnboardOutcome":
        cached_len = d["cached_len"]
        return cls(int(d["lease_id"]), None if cached_len is None else int(cached_len),
                   tuple(int(p) for p in d["page_row"]), str(d.get("error", "")))


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
        self._onboard_waits: list[tuple[list[bytes], list[int]]] = []  # (request frames, lease ids)
        self._bind_error: BaseException | None = None
        self._ctx = zmq.Context()
        self.commits: CommitInbox | None = None  # bound before a sender may look
        try:
            self.commits = CommitInbox(endpoint, manager.commit_many, manager.reader_copied)
        except OSError as e:  # e.g. a path past AF_UNIX's 107 bytes: kv_offload commits by round trip
            logger.warning("control: no commit inbox beside %s (%s); kv_offload commits with a round trip "
                           "(a shorter run dir path serves faster)", endpoint, e)
        self._wake_endpoint = f"inproc://kvlifecycle-control-wake-{id(self)}"
        self._waker: zmq.Socket | None = None  # the owner's side of the wake-up pipe, made on first use
        self._waker_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvlifecycle-control", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._bind_error is not None:
            self._thread.join()
            self._ctx.term()
            if self.commits is not None:
                self.commits.close()
            raise self._bind_error
        self._housekeeping = OwnerHousekeeping(manager, on_settled=self._settled, expire_interval_s=expire_interval_s)

    # -- public API ---------------------------------------------------------------------

    def wake(self) -> None:
        """The owner just started onboards: the housekeeping thread asks the store about them."""
        self._housekeeping.wake()

    def drain_commits(self) -> None:
        """Apply every commit announced so far (the owner calls it before each lookup: a request
        sent after an answer finds that answer's pages); this thread sends their replies."""
        if self.commits is not None and self.commits.drain():
            self._settled()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop both threads (woken, so at once) and remove the socket file; idempotent."""
        with self._waker_lock:
            if self._stop.is_set():
                return
            self._stop.set()
            self._poke()
        self._housekeeping.close(timeout_s)
        self._thread.join(timeout_s)
        with self._waker_lock:
            self._waker.close()
        self._ctx.term()
        if self.commits is not None:
            self.commits.close()

    def __enter__(self) -> "ControlServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers ------------------------------------------------------------------------

    def _settled(self) -> None:
        """Onboards were settled, or commits applied: the control thread answers the waits they
        complete and sends the commits' replies."""
        with self._waker_lock:
            if not self._stop.is_set():
                self._poke()

    def _poke(self) -> None:
        """One message down the wake-up pipe (caller holds ``_waker_lock``)."""
        if self._waker is None:
            self._waker = self._ctx.socket(zmq.PUSH)
            self._waker.setsockopt(zmq.LINGER, 0)
            self._waker.connect(self._wake_endpoint)
        try:
            self._waker.send(b"", zmq.NOBLOCK)
        except zmq.Again:  # wake-ups already queued: the thread is about to poll anyway
            pass

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        wake = self._ctx.socket(zmq.PULL)
        wake.setsockopt(zmq.LINGER, 0)
        try:
            wake.bind(self._wake_endpoint)
            sock.bind(self.endpoint)
        except BaseException as e:  # reported to the constructor
            self._bind_error = e
            sock.close()
            wake.close()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        inbox = self.commits.fileno() if self.commits is not None else None
        if inbox is not None:
            poller.register(inbox, zmq.POLLIN)
        repliers: dict[str, zmq.Socket] = {}  # reply endpoint -> PUSH socket, this thread's
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll())
                if wake in ready:
                    while wake.poll(0):
                        wake.recv()
                if inbox is not None:
                    if inbox in ready:
                        self.commits.drain()
                    self._send_commit_replies(repliers)
                if sock in ready:
                    frames = sock.recv_multipart()
                    waited = self._onboard_wait_leases(frames)
                    if waited is None:
                        sock.send_multipart(answer(frames, self._handle)[0])
                    else:
                        self._onboard_waits.append((frames, waited))
                if self._onboard_waits:
                    self._answer_settled_waits(sock)
        finally:
            sock.close()
            wake.close()
            for replier in repliers.values():
                replier.close()
            path = self.endpoint[len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)

    def _send_commit_replies(self, repliers: dict[str, zmq.Socket]) -> None:
        """Send each applied commit's ``Committed`` to the endpoint its datagram named. A reply
        that cannot be sent now is dropped: its offload pins expire, and the pages stay on the
        device."""
        for endpoint, committed in self.commits.take_replies():
            try:
                replier = repliers.get(endpoint)
                if replier is None:
                    replier = self._ctx.socket(zmq.PUSH)
                    replier.setsockopt(zmq.LINGER, 0)
                    try:
                        replier.connect(endpoint)
                    except zmq.ZMQError:
                        replier.close()
                        raise
                    repliers[endpoint] = replier
                replier.send_multipart(encode({"committed": [c.to_json() for c in committed]}), zmq.NOBLOCK)
            except zmq.ZMQError as e:  # zmq.Again: it does not read; or an endpoint zmq refuses
                logger.warning("commit replies to %s not sent (%s); %d leases' offload pins expire instead",
                               endpoint, e, len(committed))

    @staticmethod
    def _onboard_wait_leases(frames: list[bytes]) -> list[int] | None:
        """The lease ids of an ``onboard_wait`` request, answered once they are settled; None
        for any other request, or a malformed one (``answer`` refuses it at once)."""
        try:
            header, _ = decode(frames[2:])
            if header.get("op") != "onboard_wait":
                return None
            return [_int(i) for i in header["args"]["lease_ids"]]
        except (ValueError, KeyError, TypeError, IndexError):
            return None

    def _answer_settled_waits(self, sock: zmq.Socket) -> None:
        waiting = []
        for frames, lease_ids in self._onboard_waits:
            if any(self.manager.onboard_result(i) is None for i in lease_ids):
                waiting.append((frames, lease_ids))
            else:
                sock.send_multipart(answer(frames, self._handle)[0])
        self._onboard_waits = waiting

    def _onboard_outcome(self, lease_id: int) -> OnboardOutcome:
        result = self.manager.onboard_result(lease_id)
        if isinstance(result, Lease):
            return OnboardOutcome(lease_id, result.cached_len, result.page_row)
        return OnboardOutcome(lease_id, None, error=str(result))

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
        if op == "onboard_wait":  # answered once every lease is settled (_answer_settled_waits)
            return [self._onboard_outcome(_int(i)).to_json() for i in args["lease_ids"]]
        if op == "stats":
            return mgr.stats()
        if op == "ping":
            return "pong"
        raise ValueError(f"unknown op {op!r}; expected commit_many, offload_done, abort, onboard_wait, "
                         "stats or ping")


class ControlClient:
    """Calls a ``ControlServer``; see the module docstring."""

    def __init__(self, endpoint: str, timeout_s: float = TIMEOUTS.control_s) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._client: RpcClient | None = RpcClient(endpoint)  # None once closed

    # -- public API ---------------------------------------------------------------------

    def commit_many(self, lease_ids: Sequence[int]) -> list[Committed]:
        return [Committed.from_json(d) for d in self._call("commit_many", {"lease_ids": [int(i) for i in lease_ids]})]

    def offload_done(self, page_ids: Sequence[int], ok: bool) -> int:
        return int(self._call("offload_done", {"page_ids": [int(p) for p in page_ids], "ok": bool(ok)}))

    def abort(self, lease_id: int) -> bool:
        return bool(self._call("abort", {"lease_id": int(lease_id)}))

    def onboard_wait(self, lease_ids: Sequence[int], timeout_s: float) -> list[OnboardOutcome]:
        """Each lease's outcome once all their onboards are settled; ``timeout_s`` must exceed
        the owner's store timeout (it settles a late copy as a timeout by then)."""
        result = self._call("onboard_wait", {"lease_ids": [int(i) for i in lease_ids]}, timeout_s)
        return [OnboardOutcome.from_json(d) for d in result]

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

    def _call(self, op: str, args: dict[str, Any], timeout_s: float | None = None) -> Any:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            if self._client is None:
                raise RuntimeError(f"control {op}: client is closed")
            answered = self._client.call({"op": op, "args": args}, timeout_s=timeout_s)
        if answered is None:
            raise ControlTimeout(f"control {op}: no reply from {self.endpoint} within {timeout_s} s "
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
