"""The host store server: ``python -m kvlifecycle.store`` (see ``__main__``).

One process serving many clients over a zmq ROUTER socket (protocol in ``protocol.py``). This
module is the socket thread: it answers every RPC at once and never copies a page.

- ``register_pool`` attaches a device page pool (``pools.PoolRegistry``);
- ``put`` and ``get`` are checked and queued for the copy thread (``copy_worker.CopyWorker``),
  which copies between the task's pool and the backing; ``poll`` and ``cancel`` ask it;
- a ``poll`` with ``wait_s`` is answered once one of its tasks is done, or when ``wait_s`` has
  passed: the copy thread rings a pipe this thread polls beside the socket, so a client learns
  that its copy ended one message after it did, with no polling on either side (a poll loop
  with sleeps cost milliseconds per onboard);
- ``get_prefix`` asks the pools' backing which prefix of pages it holds (``backing.Backing``)
  and queues a get of the candidates inside it;
- ``locate`` answers where a batch of requests' held pages sit in the backing's shared slab,
  pinned, for a reader that copies them itself (``slab.py``);
- once a second it detaches closed pools and forgets stale tasks.

Every put/get names the pool it copies to/from (``pool`` in the request, sent by a client built
with ``pool_handle=`` or after its ``register_pool``); an unknown pool (or none) is answered
``NO_POOL``, and the client registers its handle and retries. A put/get arriving after the
client's ``accept_by`` is refused (``BUSY``), so a client whose submit timed out may release
its pages at once.

``stop()`` (SIGTERM) closes the socket, runs the queued tasks and closes the backing (the local
backing flushes its disk write-behind queue).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zmq

from kvlifecycle.hashing import page_keys
from kvlifecycle.rpc import RpcError, RpcStatus, answer, decode, prepare_ipc_dir
from kvlifecycle.store.backing import Backing
from kvlifecycle.store.copy_worker import CopyTask, CopyWorker
from kvlifecycle.store.pools import AttachedPool, PoolRegistry
from kvlifecycle.store.protocol import MAX_PIN_S, Op, check_task_pages, keys_from_words

logger = logging.getLogger(__name__)

__all__ = ["ServerConfig", "StoreServer"]

_HOUSEKEEPING_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ServerConfig:
    endpoint: str

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"--endpoint: expected ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")


class StoreServer:
    """See the module docstring. ``serve_forever`` in the main thread, ``stop`` from anywhere."""

    def __init__(self, config: ServerConfig, pools: PoolRegistry, worker: CopyWorker) -> None:
        self.config = config
        self.pools = pools
        self.worker = worker
        self._stop = threading.Event()
        self._counters: dict[str, int] = {}
        self._waits = WaitingPolls()
        self._started_at = time.monotonic()

    # -- public API ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Bind, answer RPCs until ``stop()``, then run the queued copies and close the backing."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.config.endpoint.startswith("ipc://"):
            prepare_ipc_dir(self.config.endpoint)
        sock.bind(self.config.endpoint)
        done_read, done_write = os.pipe()
        os.set_blocking(done_read, False)
        os.set_blocking(done_write, False)
        self.worker.on_done = lambda: _ring(done_write)
        self.worker.start()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(done_read, zmq.POLLIN)
        logger.info("host store listening on %s", self.config.endpoint)
        last_housekeeping = 0.0
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(self._waits.poll_timeout_ms(time.monotonic())))
                if done_read in ready:
                    _drain(done_read)
                if sock in ready:
                    frames = sock.recv_multipart()
                    if not self._waits.defer(frames, self.worker):
                        self._reply(sock, frames)
                for frames in self._waits.due(time.monotonic(), self.worker):
                    self._reply(sock, frames)
                now = time.monotonic()
                if now - last_housekeeping > _HOUSEKEEPING_INTERVAL_S:
                    last_housekeeping = now
                    self.pools.detach_closed()
                    self.worker.forget_stale(now)
        finally:
            for frames in self._waits.due(math.inf, self.worker):  # stopping: each gets what is done now
                self._reply(sock, frames)
            sock.close(0)
            ctx.term()
            self.worker.stop()
            os.close(done_read)
            os.close(done_write)
            self.pools.close()
            logger.info("host store stopped")

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler)."""
        self._stop.set()

    def stats(self) -> dict[str, Any]:
        backing = self.pools.backing
        out: dict[str, Any] = {"pid": os.getpid(), "uptime_s": round(time.monotonic() - self._started_at, 3),
                               "pool": len(self.pools) > 0, "pools": len(self.pools), **self._counters,
                               **self.worker.stats()}
        if backing is not None:
            out.update(backing.stats())
            out["by_pool"] = self.pools.stats()
        return out

    # -- RPC handling (socket thread) ---------------------------------------------------

    def _reply(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        reply, status = answer(frames, self._dispatch)
        if status is RpcStatus.BAD_REQUEST:
            self._count("bad_requests")
        sock.send_multipart(reply)

    def _dispatch(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        """One request's reply body (``rpc.answer`` adds the status)."""
        op = Op(header.get("op"))
        self._count(f"rpc_{op.value}")
        client = str(header.get("client", ""))
        if op is Op.PING:
            return {"pool": len(self.pools) > 0, "pools": len(self.pools)}
        if op is Op.STATS:
            return {"stats": self.stats()}
        if op is Op.REGISTER_POOL:
            handle = header["handle"]
            if not isinstance(handle, dict):
                raise ValueError("register_pool 'handle': expected a PagePool.handle() dict")
            attached = self.pools.attach(handle)
            return {"pool": attached, "slab": self.pools.backing.slab_handle()}
        if op is Op.LOCATE:
            return self._locate(header, arrays)
        if op is Op.POLL:
            statuses = self.worker.poll(client, [int(t) for t in header["tasks"]])
            return {"tasks": {str(t): s.value for t, s in statuses.items()}}
        if op is Op.CANCEL:
            self.worker.cancel(client, [int(t) for t in header["tasks"]])
            return {}
        assert op in (Op.PUT, Op.GET, Op.GET_PREFIX), f"_dispatch: unhandled op {op}"
        pool = self._require_pool(header.get("pool"), int(header["page_size"]))
        if self._stop.is_set():
            raise RpcError(RpcStatus.BUSY, "the store is stopping")
        if time.monotonic() > float(header["accept_by"]):
            self._count("late_requests")
            raise RpcError(RpcStatus.BUSY, "request arrived after the client's accept deadline")
        task = CopyTask(client=client, task_id=int(header["task"]), op=Op.PUT if op is Op.PUT else Op.GET,
                        pool=pool, namespace=str(header["ns"]), tokens=arrays["tokens"],
                        seq_pages=arrays["seq_pages"], pool_pages=arrays["pool_pages"],
                        start_by=float(header["start_by"]))
        _check_task(task)
        if op is Op.GET_PREFIX:  # copy the candidates inside the held prefix, in the same round trip
            keys = self._page_keys(pool.pool.spec.page_size, task.tokens, task.namespace)
            held = self.pools.backing.held_prefix(keys)
            keep = task.seq_pages < held
            if not keep.any():
                return {"pages": held, "copying": False}
            self.worker.submit(replace(task, seq_pages=task.seq_pages[keep], pool_pages=task.pool_pages[keep],
                                       page_keys=keys))  # hashed once: the copy thread reuses them
            return {"pages": held, "copying": True}
        self.worker.submit(task)
        return {}

    def _locate(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        backing = self._backing(int(header["page_size"]))
        slab = backing.slab_handle()
        if slab is None:
            raise RpcError(RpcStatus.UNSUPPORTED, "this store's DRAM tier is not shared (Mooncake backing, or "
                           "no memfd: see the store's log); onboard through get_prefix")
        pin_s = float(header["pin_s"])
        if not 0 < pin_s <= MAX_PIN_S:
            raise ValueError(f"pin_s: expected (0, {MAX_PIN_S}] seconds, got {pin_s}")
        keys, offsets = arrays["keys"].reshape(-1, 2), arrays["offsets"]
        if offsets.size < 1 or offsets[0] != 0 or offsets[-1] != len(keys) or (np.diff(offsets) < 0).any():
            raise ValueError(f"offsets: expected non-decreasing offsets from 0 to {len(keys)} keys")
        all_keys = keys_from_words(keys)
        located = backing.locate([all_keys[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())], pin_s)
        return {"slab": slab, "rows": [rows.tolist() for rows, _ in located],
                "versions": [versions.tolist() for _, versions in located]}

    def _page_keys(self, page_size: int, tokens: np.ndarray, namespace: str) -> list[bytes]:
        self._backing(page_size)
        return page_keys(tokens, namespace, page_size)

    def _backing(self, page_size: int) -> Backing:
        """The pools' backing, for a request of pages of ``page_size`` tokens."""
        if self.pools.backing is None:
            raise RpcError(RpcStatus.NO_POOL, "no page pool registered yet; call register_pool")
        if page_size != self.pools.page_size:
            raise ValueError(f"page_size: the store's pools have {self.pools.page_size}, got {page_size}")
        return self.pools.backing

    def _require_pool(self, named: Any, page_size: int) -> AttachedPool:
        """The pool a put/get copies to/from."""
        if named is None:
            raise RpcError(RpcStatus.NO_POOL, "the request names no pool; build the client with pool_handle= "
                         "or call register_pool")
        if not isinstance(named, str):
            raise ValueError(f"pool: expected a pool id string (protocol.pool_id), got {named!r}")
        pool = self.pools.get(named)
        if pool is None:
            raise RpcError(RpcStatus.NO_POOL, f"pool {named} is not attached; call register_pool")
        if page_size != pool.pool.spec.page_size:
            raise ValueError(f"page_size: pool {pool.pool_id} has {pool.pool.spec.page_size}, got {page_size}")
        return pool

    def _count(self, name: str) -> None:
        self._counters[name] = self._counters.get(name, 0) + 1


class WaitingPolls:
    """Polls with ``wait_s`` whose tasks are all still in flight (socket thread only): each is
    answered by ``due`` once the copy worker reports one of its tasks done, or at its deadline."""

    MAX_WAIT_S = 60.0  # a client asking for longer is answered by then and polls again

    def __init__(self) -> None:
        self._waiting: list[tuple[list[bytes], str, list[int], float]] = []  # frames, client, tasks, deadline

    def defer(self, frames: list[bytes], worker: CopyWorker) -> bool:
        """True when ``frames`` is a poll to answer later; any other request, a malformed one (the
        normal path refuses it) or a poll with a task already done is answered now."""
        try:
            header, _ = decode(frames[2:])
            if header.get("op") != Op.POLL.value or not float(header.get("wait_s", 0)) > 0:
                return False
            client, tasks = str(header.get("client", "")), [int(t) for t in header["tasks"]]
            wait_s = min(float(header["wait_s"]), self.MAX_WAIT_S)
        except (ValueError, KeyError, TypeError, IndexError):
            return False
        if not tasks or worker.any_done(client, tasks):
            return False
        self._waiting.append((frames, client, tasks, time.monotonic() + wait_s))
        return True

    def due(self, now: float, worker: CopyWorker) -> list[list[bytes]]:
        """The waiting polls to answer now; the others keep waiting."""
        due, waiting = [], []
        for entry in self._waiting:
            frames, client, tasks, deadline = entry
            (due if now >= deadline or worker.any_done(client, tasks) else waiting).append(entry)
        self._waiting = waiting
        return [frames for frames, *_ in due]

    def poll_timeout_ms(self, now: float) -> int:
        """How long the socket thread may sleep: until the nearest deadline, at most 100 ms."""
        nearest = min((deadline for *_, deadline in self._waiting), default=now + 0.1)
        return max(0, min(100, math.ceil((nearest - now) * 1000)))


def _ring(fd: int) -> None:
    try:
        os.write(fd, b"\0")
    except BlockingIOError:  # the pipe is full of rings the socket thread has yet to read
        pass


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _check_task(task: CopyTask) -> None:
    spec = task.pool.pool.spec
    check_task_pages(task.tokens.size, task.seq_pages, task.pool_pages, spec.page_size, spec.num_pages)
    if np.unique(task.seq_pages).size != task.seq_pages.size:
        raise ValueError("seq_pages: expected distinct pages")

