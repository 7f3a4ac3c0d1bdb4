"""The embedded host store server: ``python -m kvlifecycle.store`` (see ``__main__``).

One process serving many clients over a zmq ROUTER socket (protocol in ``protocol.py``):

- the socket thread answers every RPC at once: ``match`` reads the tier indexes, ``put`` and
  ``get`` only queue a task, ``poll`` reports task statuses;
- one copy thread runs the queued tasks in arrival order (FIFO, so a client's tasks run in
  the order it sent them), moving pages between the attached device page pool and the DRAM
  tier with batched gathers/scatters (``transfer.PageCopier``);
- the disk tier (optional) writes pages behind on its own thread.

The page pool is attached from ``--pool-handle`` (JSON, or a file that may appear later) or
by a client's ``register_pool`` RPC; transfers and matches before that reply ``NO_POOL``.

A task is started only within ``task_start_timeout_s`` of its submission (``sent_at`` in the
request, CLOCK_MONOTONIC, same host); later it fails without touching the pool, so a client
that gave up on a task can release its pages after that deadline. ``stop()`` (SIGTERM) closes
the socket, finishes the queued tasks and flushes the disk write-behind queue.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq

from kvlifecycle.hashing import page_keys
from kvlifecycle.pool import PagePool
from kvlifecycle.store.api import Status
from kvlifecycle.store.protocol import Op, RpcStatus, decode, encode
from kvlifecycle.store.tiers import DiskTier, DramTier
from kvlifecycle.store.transfer import PageCopier, host_page_shape

logger = logging.getLogger(__name__)

__all__ = ["ServerConfig", "StoreServer", "prepare_ipc_endpoint"]

_DONE_TASK_TTL_S = 300.0  # a finished task nobody polled is forgotten after this


@dataclass
class ServerConfig:
    endpoint: str
    dram_bytes: int
    disk_dir: Path | None = None
    disk_bytes: int = 0  # 0: unbounded
    pool_handle: dict[str, Any] | Path | None = None  # a handle, or a file holding one
    task_start_timeout_s: float = 5.0
    debug_copy_delay_s: float = 0.0  # fault injection for tests: sleep before each copy

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"--dram-bytes: expected a positive byte count, got {self.dram_bytes}")
        if self.disk_bytes < 0:
            raise ValueError(f"--disk-bytes: expected >= 0 (0 = unbounded), got {self.disk_bytes}")
        if self.task_start_timeout_s <= 0:
            raise ValueError(f"task_start_timeout_s: expected > 0, got {self.task_start_timeout_s}")
        if not self.endpoint.startswith(("ipc://", "tcp://")):
            raise ValueError(f"--endpoint: expected ipc://PATH or tcp://HOST:PORT, got {self.endpoint!r}")


@dataclass
class _Task:
    client: str
    task_id: int
    op: Op
    namespace: str
    tokens: np.ndarray
    seq_pages: np.ndarray
    pool_pages: np.ndarray
    start_by: float  # CLOCK_MONOTONIC
    status: Status = Status.UNREADY
    started: bool = False
    finished_at: float = 0.0


@dataclass
class _Tiers:
    """Everything that depends on the attached pool's geometry."""

    pool: PagePool
    handle_text: str
    copier: PageCopier
    dram: DramTier
    disk: DiskTier | None
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


class StoreServer:
    """See the module docstring. ``serve_forever`` in the main thread, ``stop`` from anywhere."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _tasks, tier indexes and _tiers
        self._tasks: dict[tuple[str, int], _Task] = {}
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._tiers: _Tiers | None = None
        self._pending_handle_file: Path | None = None
        self._counters = collections.Counter[str]()
        self._started_at = time.monotonic()
        if isinstance(config.pool_handle, dict):
            self._attach(config.pool_handle)
        elif config.pool_handle is not None:
            self._pending_handle_file = Path(config.pool_handle)
            self._try_attach_file()

    # -- public API ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        """Bind, answer RPCs until ``stop()``, then drain the copy queue and flush the disk."""
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        prepare_ipc_endpoint(self.config.endpoint)
        sock.bind(self.config.endpoint)
        worker = threading.Thread(target=self._copy_loop, name="kvstore-copy", daemon=True)
        worker.start()
        logger.info("host store listening on %s (dram %d bytes, disk %s)", self.config.endpoint,
                    self.config.dram_bytes, self.config.disk_dir or "off")
        last_housekeeping = 0.0
        try:
            while not self._stop.is_set():
                if sock.poll(100, zmq.POLLIN):
                    frames = sock.recv_multipart()
                    reply = self._handle(frames)
                    sock.send_multipart([frames[0], *encode(reply)])
                now = time.monotonic()
                if now - last_housekeeping > 1.0:
                    last_housekeeping = now
                    self._housekeeping(now)
        finally:
            sock.close(0)
            ctx.term()
            self._queue.put(None)
            worker.join()
            self._close_tiers()
            logger.info("host store stopped")

    def stop(self) -> None:
        """Ask ``serve_forever`` to return (safe from a signal handler)."""
        self._stop.set()

    # -- RPC handling (socket thread) ---------------------------------------------------

    def _handle(self, frames: list[bytes]) -> dict[str, Any]:
        try:
            if len(frames) < 3 or frames[1] != b"":
                raise ValueError("message: expected [identity, b'', header, arrays...]")
            header, arrays = decode(frames[2:])
        except ValueError as e:
            self._counters["bad_requests"] += 1
            return {"seq": None, "rpc": RpcStatus.BAD_REQUEST.value, "error": str(e)}
        seq = header.get("seq")
        try:
            op = Op(header.get("op"))
            body = self._dispatch(op, header, arrays)
        except _Reply as r:
            body = {"rpc": r.status.value, "error": r.message}
        except (ValueError, KeyError, TypeError) as e:
            self._counters["bad_requests"] += 1
            body = {"rpc": RpcStatus.BAD_REQUEST.value, "error": f"{type(e).__name__}: {e}"}
        except Exception as e:
            logger.error("request %r failed", header.get("op"), exc_info=True)
            body = {"rpc": RpcStatus.ERROR.value, "error": f"{type(e).__name__}: {e}"}
        body.setdefault("rpc", RpcStatus.OK.value)
        body["seq"] = seq
        return body

    def _dispatch(self, op: Op, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        self._counters[f"rpc_{op.value}"] += 1
        client = str(header.get("client", ""))
        if op is Op.PING:
            return {"pool": self._tiers is not None}
        if op is Op.STATS:
            return {"stats": self.stats()}
        if op is Op.REGISTER_POOL:
            handle = header["handle"]
            if not isinstance(handle, dict):
                raise ValueError("register_pool 'handle': expected a PagePool.handle() dict")
            self._attach(handle)
            return {}
        if op is Op.POLL:
            return {"tasks": self._poll(client, [int(t) for t in header["tasks"]])}
        if op is Op.CANCEL:
            self._cancel(client, [int(t) for t in header["tasks"]])
            return {}
        tiers = self._require_tiers(int(header["page_size"]))
        if op is Op.MATCH:
            return {"pages": self._match(tiers, arrays["tokens"], str(header["ns"]))}
        assert op in (Op.PUT, Op.GET), f"_dispatch: unhandled op {op}"
        if self._stop.is_set():
            raise _Reply(RpcStatus.BUSY, "the store is stopping")
        if time.monotonic() > float(header["accept_by"]):
            self._counters["late_requests"] += 1
            raise _Reply(RpcStatus.BUSY, "request arrived after the client's accept deadline")
        task = _Task(client=client, task_id=int(header["task"]), op=op, namespace=str(header["ns"]),
                     tokens=arrays["tokens"], seq_pages=arrays["seq_pages"],
                     pool_pages=arrays["pool_pages"], start_by=float(header["start_by"]))
        self._check_task(tiers, task)
        with self._lock:
            if (client, task.task_id) in self._tasks:
                raise ValueError(f"task {task.task_id}: already submitted by this client")
            self._tasks[(client, task.task_id)] = task
        self._queue.put(task)
        return {}

    def _require_tiers(self, page_size: int) -> _Tiers:
        self._try_attach_file()
        tiers = self._tiers
        if tiers is None:
            raise _Reply(RpcStatus.NO_POOL, "no page pool registered yet; call register_pool")
        if page_size != tiers.pool.spec.page_size:
            raise ValueError(f"page_size: the store's pool has {tiers.pool.spec.page_size}, got {page_size}")
        return tiers

    def _check_task(self, tiers: _Tiers, task: _Task) -> None:
        page_size = tiers.pool.spec.page_size
        num_full = task.tokens.size // page_size
        if task.seq_pages.shape != task.pool_pages.shape:
            raise ValueError("seq_pages/pool_pages: expected the same length")
        if task.seq_pages.size and (task.seq_pages.min() < 0 or task.seq_pages.max() >= num_full):
            raise ValueError(f"seq_pages: expected page indices in [0, {num_full})")
        num_pages = tiers.pool.spec.num_pages
        if task.pool_pages.size and (task.pool_pages.min() < 0 or task.pool_pages.max() >= num_pages):
            raise ValueError(f"pool_pages: expected pool page ids in [0, {num_pages})")
        if np.unique(task.seq_pages).size != task.seq_pages.size:
            raise ValueError("seq_pages: expected distinct pages")

    def _match(self, tiers: _Tiers, tokens: np.ndarray, namespace: str) -> int:
        keys = page_keys(tokens, namespace, tiers.pool.spec.page_size)
        held = 0
        with self._lock:
            for key in keys:
                if not (tiers.dram.holds(key) or (tiers.disk is not None and tiers.disk.holds(key))):
                    break
                held += 1
        tiers.counters["match_pages"] += held
        return held

    def _poll(self, client: str, task_ids: list[int]) -> dict[str, str]:
        out: dict[str, str] = {}
        with self._lock:
            for task_id in task_ids:
                task = self._tasks.get((client, task_id))
                if task is None:
                    out[str(task_id)] = Status.FAILED.value  # unknown: lost (e.g. store restarted)
                elif task.status.done:
                    out[str(task_id)] = task.status.value
                    del self._tasks[(client, task_id)]
                else:
                    out[str(task_id)] = Status.UNREADY.value
        return out

    def _cancel(self, client: str, task_ids: list[int]) -> None:
        with self._lock:
            for task_id in task_ids:
                task = self._tasks.get((client, task_id))
                if task is not None and not task.started and not task.status.done:
                    task.status = Status.CANCELLED
                    task.finished_at = time.monotonic()

    def _housekeeping(self, now: float) -> None:
        self._try_attach_file()
        with self._lock:
            stale = [k for k, t in self._tasks.items() if t.status.done and now - t.finished_at > _DONE_TASK_TTL_S]
            for k in stale:
                del self._tasks[k]

    def stats(self) -> dict[str, Any]:
        with self._lock:
            tiers = self._tiers
            out: dict[str, Any] = {
                "pid": os.getpid(),
                "uptime_s": round(time.monotonic() - self._started_at, 3),
                "pool": tiers is not None,
                "tasks": len(self._tasks),
                "queued": self._queue.qsize(),
                **self._counters,
            }
            if tiers is not None:
                out.update({
                    "page_bytes": tiers.dram.page_bytes,
                    "dram_capacity_pages": tiers.dram.capacity_pages,
                    "dram_pages": len(tiers.dram),
                    "dram_evictions": tiers.dram.evictions,
                    **tiers.counters,
                })
                if tiers.disk is not None:
                    out["disk_pages"] = len(tiers.disk)
                    out.update({f"disk_{k}": v for k, v in tiers.disk.counters.items()})
        return out

    # -- copies (copy thread) -----------------------------------------------------------

    def _copy_loop(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            with self._lock:
                if task.status is Status.CANCELLED:
                    continue
                if time.monotonic() > task.start_by:
                    task.status, task.finished_at = Status.FAILED, time.monotonic()
                    self._counters["expired_tasks"] += 1
                    continue
                task.started = True
                tiers = self._tiers
            if self.config.debug_copy_delay_s:
                time.sleep(self.config.debug_copy_delay_s)
            try:
                assert tiers is not None, "_copy_loop: a task was accepted without a pool"
                status = self._put(tiers, task) if task.op is Op.PUT else self._get(tiers, task)
            except Exception:
                logger.error("task %s %d of client %s failed", task.op.value, task.task_id,
                             task.client, exc_info=True)
                status = Status.FAILED
            with self._lock:
                task.status, task.finished_at = status, time.monotonic()
                tiers.counters[f"{task.op.value}_{status.value.lower()}"] += 1

    def _put(self, tiers: _Tiers, task: _Task) -> Status:
        all_keys = page_keys(task.tokens, task.namespace, tiers.pool.spec.page_size)
        keys = [all_keys[i] for i in task.seq_pages]
        with self._lock:
            fresh = [i for i, key in enumerate(keys) if tiers.dram.row(key) is None]
            rows = tiers.dram.reserve(len(fresh), keep=set(keys))
        if len(rows) < len(fresh):
            tiers.counters["put_pages_over_capacity"] += len(fresh) - len(rows)
            fresh = fresh[: len(rows)]  # keep the prefix: it is what later lookups match first
        try:
            tiers.copier.gather(task.pool_pages[fresh], tiers.dram.slab, np.asarray(rows, dtype=np.int64))
        except BaseException:
            with self._lock:
                tiers.dram.release(rows)
            raise
        fresh_keys = [keys[i] for i in fresh]
        with self._lock:
            tiers.dram.insert(fresh_keys, rows)
        tiers.counters["put_pages"] += len(fresh)
        tiers.counters["put_bytes"] += len(fresh) * tiers.dram.page_bytes
        if tiers.disk is not None and fresh:
            pages = tiers.dram.slab.index_select(0, torch.as_tensor(rows, dtype=torch.int64))
            tiers.disk.write_behind(fresh_keys, pages)
        return Status.SUCCESS

    def _get(self, tiers: _Tiers, task: _Task) -> Status:
        all_keys = page_keys(task.tokens, task.namespace, tiers.pool.spec.page_size)
        keys = [all_keys[i] for i in task.seq_pages]
        with self._lock:
            rows = [tiers.dram.row(key) for key in keys]
        missing = [i for i, row in enumerate(rows) if row is None]
        loaded: list[torch.Tensor] = []
        for i in missing:
            page = tiers.disk.read(keys[i]) if tiers.disk is not None else None
            if page is None:
                tiers.counters["get_missing_pages"] += 1
                return Status.NOTFOUND
            loaded.append(page)
        present = [i for i, row in enumerate(rows) if row is not None]
        tiers.copier.scatter(tiers.dram.slab, np.asarray([rows[i] for i in present], dtype=np.int64),
                             task.pool_pages[present])
        if loaded:
            from_disk = torch.stack(loaded)  # [m, L, 2, S, H, D]
            if tiers.pool.tensor.is_cuda:
                from_disk = from_disk.pin_memory()
            tiers.copier.scatter(from_disk, np.arange(len(loaded), dtype=np.int64), task.pool_pages[missing])
            self._promote(tiers, [keys[i] for i in missing], from_disk, keep=set(keys))
        tiers.counters["get_pages"] += len(keys)
        tiers.counters["get_bytes"] += len(keys) * tiers.dram.page_bytes
        return Status.SUCCESS

    def _promote(self, tiers: _Tiers, keys: list[bytes], pages: torch.Tensor, keep: set[bytes]) -> None:
        """Put pages read from disk back into DRAM (they are hot)."""
        with self._lock:
            new = [i for i, key in enumerate(keys) if not tiers.dram.holds(key)]
            rows = tiers.dram.reserve(len(new), keep=keep)
        new = new[: len(rows)]
        if new:
            tiers.dram.slab.index_copy_(0, torch.as_tensor(rows, dtype=torch.int64),
                                        pages.index_select(0, torch.as_tensor(new, dtype=torch.int64)))
        with self._lock:
            tiers.dram.insert([keys[i] for i in new], rows)

    # -- pool attachment ----------------------------------------------------------------

    def _try_attach_file(self) -> None:
        path = self._pending_handle_file
        if path is None or not path.exists():
            return
        try:
            handle = json.loads(path.read_text())
            self._attach(handle)
        except Exception:
            logger.warning("could not attach the pool from %s; will retry", path, exc_info=True)
            return
        self._pending_handle_file = None

    def _attach(self, handle: dict[str, Any]) -> None:
        text = json.dumps(handle, sort_keys=True)
        with self._lock:
            if self._tiers is not None and self._tiers.handle_text == text:
                return
        pool = PagePool.attach(handle)
        page_shape = host_page_shape(pool.spec.shape)
        dtype = pool.spec.torch_dtype
        old = self._tiers
        if old is not None and old.pool.spec.shape[:1] + old.pool.spec.shape[2:] == \
                pool.spec.shape[:1] + pool.spec.shape[2:] and old.pool.spec.dtype == pool.spec.dtype:
            # Same page geometry (a new pool, e.g. a model reload): keep the stored pages.
            new = _Tiers(pool=pool, handle_text=text, copier=PageCopier(pool.tensor), dram=old.dram,
                         disk=old.disk, counters=old.counters)
        else:
            pinned = pool.tensor.is_cuda
            dram = DramTier(self.config.dram_bytes, page_shape, dtype, pin_memory=pinned)
            disk = (DiskTier(self.config.disk_dir, page_shape, dtype, capacity_bytes=self.config.disk_bytes)
                    if self.config.disk_dir is not None else None)
            new = _Tiers(pool=pool, handle_text=text, copier=PageCopier(pool.tensor), dram=dram, disk=disk)
            if old is not None and old.disk is not None:
                old.disk.close()
        with self._lock:
            self._tiers = new
        logger.info("attached page pool %s (DRAM tier: %d pages of %d bytes)", pool.spec,
                    new.dram.capacity_pages, new.dram.page_bytes)

    def _close_tiers(self) -> None:
        tiers = self._tiers
        if tiers is not None and tiers.disk is not None:
            if tiers.disk.close(timeout_s=60.0):
                logger.info("disk write-behind queue flushed (%d pages on disk)", len(tiers.disk))
            else:
                logger.error("disk write-behind queue did not drain within 60 s; pages lost")


def prepare_ipc_endpoint(endpoint: str) -> None:
    """For ``ipc://PATH``: create PATH's directory 0700, or refuse one others can enter."""
    if not endpoint.startswith("ipc://"):
        return
    directory = Path(endpoint.removeprefix("ipc://")).parent
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o077:
        raise PermissionError(
            f"--endpoint: directory {directory} has mode {mode:o}; the store's socket needs a private "
            f"directory (chmod 700 {directory})")


class _Reply(Exception):
    """An expected non-OK RPC outcome."""

    def __init__(self, status: RpcStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
