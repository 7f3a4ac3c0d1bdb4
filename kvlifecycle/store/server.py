"""The embedded host store server: ``python -m kvlifecycle.store`` (see ``__main__``).

One process serving many clients over a zmq ROUTER socket (protocol in ``protocol.py``):

- the socket thread answers every RPC at once: ``match`` reads the tier indexes, ``put`` and
  ``get`` only queue a task, ``poll`` reports task statuses;
- one copy thread runs the queued tasks in arrival order (FIFO, so a client's tasks run in
  the order it sent them), moving pages between the task's device page pool and the DRAM
  tier with batched gathers/scatters (``transfer.PageCopier``, one per pool);
- the disk tier (optional) writes pages behind on its own thread.

Pools. Several processes may own page pools (the ensemble's ``kv_lookup_alloc`` and the
baseline ``hstu_monolithic``, each its own pool). The server keeps a registry of attached
pools keyed by ``protocol.pool_id(handle)``; ``register_pool`` attaches a pool (or finds it
attached) and every put/get names the pool it copies to/from (``pool`` in the request, sent
by a client built with ``pool_handle=`` or after its ``register_pool``). A put/get naming no
pool uses the server's own pool (``--pool-handle``: JSON, or a file that may appear later),
never "whichever pool was registered last". An unknown pool id (or no pool at all) is
answered ``NO_POOL`` and the client registers its handle and retries.

Pages are keyed by content (the hash chain over tokens and namespace), so all pools share one
DRAM tier and one disk tier. They must therefore have one page geometry (layers, page size,
heads, head dim, dtype; the number of pages may differ): ``register_pool`` of another
geometry is refused (``BAD_REQUEST`` naming both) while a pool of the current geometry is
attached. Once none is (see detaching), the next registration sets the geometry and starts a
fresh DRAM tier. Detaching: a shared-memory pool whose file its creator unlinked
(``PagePool.close``) is detached by the housekeeping pass; CUDA pools stay attached until the
server exits (their owner's exit cannot be observed from here).

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
from kvlifecycle.store.protocol import Op, RpcStatus, decode, encode, pool_id
from kvlifecycle.store.tiers import DiskTier, DramTier
from kvlifecycle.store.transfer import PageCopier, host_page_shape

logger = logging.getLogger(__name__)

__all__ = ["ServerConfig", "StoreServer", "prepare_ipc_endpoint"]

_DONE_TASK_TTL_S = 300.0  # a finished task nobody polled is forgotten after this


@dataclass
class ServerConfig:
    endpoint: str
    dram_bytes: int = 2 << 30  # the DRAM tier: 2 GiB, hstu-serve's default too
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
class _Tiers:
    """The host tiers, shared by every attached pool of their page geometry."""

    geometry: tuple[tuple[int, ...], str]  # (host page shape [L, 2, S, H, D], dtype name)
    dram: DramTier
    disk: DiskTier | None
    counters: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass
class _Pool:
    """One attached device page pool; its copier is used by the copy thread only."""

    pool_id: str
    pool: PagePool
    copier: PageCopier
    tiers: _Tiers
    shm_path: str | None  # creator's file, for shm pools: gone means the pool is closed
    counters: collections.Counter[str] = field(default_factory=collections.Counter)  # task outcomes


@dataclass
class _Task:
    client: str
    task_id: int
    op: Op
    pool: _Pool
    namespace: str
    tokens: np.ndarray
    seq_pages: np.ndarray
    pool_pages: np.ndarray
    start_by: float  # CLOCK_MONOTONIC
    status: Status = Status.UNREADY
    started: bool = False
    finished_at: float = 0.0


class StoreServer:
    """See the module docstring. ``serve_forever`` in the main thread, ``stop`` from anywhere."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _tasks, tier indexes, _tiers and _pools
        self._tasks: dict[tuple[str, int], _Task] = {}
        self._queue: queue.Queue[_Task | None] = queue.Queue()
        self._tiers: _Tiers | None = None    # set by the first attach; one geometry at a time
        self._pools: dict[str, _Pool] = {}   # pool_id -> attached pool (socket thread mutates)
        self._own_pool: str | None = None    # pool_id of --pool-handle: for puts/gets naming none
        self._pending_handle_file: Path | None = None
        self._counters = collections.Counter[str]()
        self._started_at = time.monotonic()
        if isinstance(config.pool_handle, dict):
            self._own_pool = self._attach(config.pool_handle)
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
            return {"pool": bool(self._pools), "pools": len(self._pools)}
        if op is Op.STATS:
            return {"stats": self.stats()}
        if op is Op.REGISTER_POOL:
            handle = header["handle"]
            if not isinstance(handle, dict):
                raise ValueError("register_pool 'handle': expected a PagePool.handle() dict")
            return {"pool": self._attach(handle)}
        if op is Op.POLL:
            return {"tasks": self._poll(client, [int(t) for t in header["tasks"]])}
        if op is Op.CANCEL:
            self._cancel(client, [int(t) for t in header["tasks"]])
            return {}
        if op is Op.MATCH:
            tiers = self._require_tiers(int(header["page_size"]))
            return {"pages": self._match(tiers, arrays["tokens"], str(header["ns"]))}
        assert op in (Op.PUT, Op.GET), f"_dispatch: unhandled op {op}"
        pool = self._require_pool(header.get("pool"), int(header["page_size"]))
        if self._stop.is_set():
            raise _Reply(RpcStatus.BUSY, "the store is stopping")
        if time.monotonic() > float(header["accept_by"]):
            self._counters["late_requests"] += 1
            raise _Reply(RpcStatus.BUSY, "request arrived after the client's accept deadline")
        task = _Task(client=client, task_id=int(header["task"]), op=op, pool=pool,
                     namespace=str(header["ns"]), tokens=arrays["tokens"], seq_pages=arrays["seq_pages"],
                     pool_pages=arrays["pool_pages"], start_by=float(header["start_by"]))
        self._check_task(task)
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
        tiers_page_size = tiers.geometry[0][2]
        if page_size != tiers_page_size:
            raise ValueError(f"page_size: the store's pools have {tiers_page_size}, got {page_size}")
        return tiers

    def _require_pool(self, named: Any, page_size: int) -> _Pool:
        """The pool a put/get copies to/from: the one it names, else the server's own."""
        self._try_attach_file()
        if named is not None and not isinstance(named, str):
            raise ValueError(f"pool: expected a pool id string (protocol.pool_id), got {named!r}")
        key = named if named is not None else self._own_pool
        pool = self._pools.get(key) if key is not None else None
        if pool is None:
            if named is None:
                raise _Reply(RpcStatus.NO_POOL, "the request names no pool and the server has none of "
                             "its own (--pool-handle); build the client with pool_handle= or call register_pool")
            raise _Reply(RpcStatus.NO_POOL, f"pool {named} is not attached; call register_pool")
        if page_size != pool.pool.spec.page_size:
            raise ValueError(f"page_size: pool {pool.pool_id} has {pool.pool.spec.page_size}, got {page_size}")
        return pool

    def _check_task(self, task: _Task) -> None:
        page_size = task.pool.pool.spec.page_size
        num_full = task.tokens.size // page_size
        if task.seq_pages.shape != task.pool_pages.shape:
            raise ValueError("seq_pages/pool_pages: expected the same length")
        if task.seq_pages.size and (task.seq_pages.min() < 0 or task.seq_pages.max() >= num_full):
            raise ValueError(f"seq_pages: expected page indices in [0, {num_full})")
        num_pages = task.pool.pool.spec.num_pages
        if task.pool_pages.size and (task.pool_pages.min() < 0 or task.pool_pages.max() >= num_pages):
            raise ValueError(f"pool_pages: expected pool page ids in [0, {num_pages})")
        if np.unique(task.seq_pages).size != task.seq_pages.size:
            raise ValueError("seq_pages: expected distinct pages")

    def _match(self, tiers: _Tiers, tokens: np.ndarray, namespace: str) -> int:
        keys = page_keys(tokens, namespace, tiers.geometry[0][2])
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
        self._detach_closed_pools()
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
                "pool": bool(self._pools),
                "pools": len(self._pools),
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
                out["by_pool"] = {key: {"num_pages": p.pool.spec.num_pages, **p.counters}
                                  for key, p in self._pools.items()}
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
            if self.config.debug_copy_delay_s:
                time.sleep(self.config.debug_copy_delay_s)
            tiers = task.pool.tiers
            try:
                status = self._put(task.pool, task) if task.op is Op.PUT else self._get(task.pool, task)
            except Exception:
                logger.error("task %s %d of client %s failed", task.op.value, task.task_id,
                             task.client, exc_info=True)
                status = Status.FAILED
            with self._lock:
                task.status, task.finished_at = status, time.monotonic()
                tiers.counters[f"{task.op.value}_{status.value.lower()}"] += 1
                task.pool.counters[f"{task.op.value}_{status.value.lower()}"] += 1

    def _put(self, pool: _Pool, task: _Task) -> Status:
        tiers = pool.tiers
        all_keys = page_keys(task.tokens, task.namespace, pool.pool.spec.page_size)
        keys = [all_keys[i] for i in task.seq_pages]
        with self._lock:
            fresh = [i for i, key in enumerate(keys) if tiers.dram.row(key) is None]
            rows = tiers.dram.reserve(len(fresh), keep=set(keys))
        if len(rows) < len(fresh):
            tiers.counters["put_pages_over_capacity"] += len(fresh) - len(rows)
            fresh = fresh[: len(rows)]  # keep the prefix: it is what later lookups match first
        try:
            pool.copier.gather(task.pool_pages[fresh], tiers.dram.slab, np.asarray(rows, dtype=np.int64))
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

    def _get(self, pool: _Pool, task: _Task) -> Status:
        tiers = pool.tiers
        all_keys = page_keys(task.tokens, task.namespace, pool.pool.spec.page_size)
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
        pool.copier.scatter(tiers.dram.slab, np.asarray([rows[i] for i in present], dtype=np.int64),
                            task.pool_pages[present])
        if loaded:
            from_disk = torch.stack(loaded)  # [m, L, 2, S, H, D]
            if pool.copier.pool.is_cuda:
                from_disk = from_disk.pin_memory()
            pool.copier.scatter(from_disk, np.arange(len(loaded), dtype=np.int64), task.pool_pages[missing])
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
            self._own_pool = self._attach(handle)
        except Exception:
            logger.warning("could not attach the pool from %s; will retry", path, exc_info=True)
            return
        self._pending_handle_file = None

    def _attach(self, handle: dict[str, Any]) -> str:
        """Attach the pool ``handle`` describes, or find it attached; returns its pool id.
        Raises ValueError for a page geometry other than the attached pools' (socket thread
        and constructor only: they are the only writers of ``_pools`` and ``_tiers``)."""
        key = pool_id(handle)
        if key in self._pools:
            return key
        pool = PagePool.attach(handle)
        geometry = (host_page_shape(pool.spec.shape), pool.spec.dtype)
        tiers = self._tiers
        if tiers is not None and tiers.geometry != geometry:
            if self._pools:
                pool.close()
                raise ValueError(
                    f"register_pool: the store holds pages of geometry {_describe(tiers.geometry)} for "
                    f"{len(self._pools)} attached pool(s); got a pool of {_describe(geometry)}. Pools of "
                    "another geometry need their own store server (or this one restarted)")
            tiers = None  # no pool of the old geometry is left: start over with this one
        if tiers is None:
            tiers = self._new_tiers(pool)
            old, self._tiers = self._tiers, tiers
            if old is not None and old.disk is not None:
                old.disk.close()
        attached = _Pool(pool_id=key, pool=pool, copier=PageCopier(pool.tensor), tiers=tiers,
                         shm_path=handle.get("path") if handle.get("kind") == "shm" else None)
        with self._lock:
            self._pools[key] = attached
        logger.info("attached page pool %s as %s (%d pools attached; DRAM tier: %d pages of %d bytes)",
                    pool.spec, key, len(self._pools), tiers.dram.capacity_pages, tiers.dram.page_bytes)
        return key

    def _new_tiers(self, pool: PagePool) -> _Tiers:
        page_shape = host_page_shape(pool.spec.shape)
        dtype = pool.spec.torch_dtype
        dram = DramTier(self.config.dram_bytes, page_shape, dtype, pin_memory=pool.tensor.is_cuda)
        disk = (DiskTier(self.config.disk_dir, page_shape, dtype, capacity_bytes=self.config.disk_bytes)
                if self.config.disk_dir is not None else None)
        return _Tiers(geometry=(page_shape, pool.spec.dtype), dram=dram, disk=disk)

    def _detach_closed_pools(self) -> None:
        """Forget shm pools whose creator unlinked the file. Queued tasks keep their ``_Pool``
        (its copier holds the mapping), so the memory is unmapped when the last one is done."""
        gone = [p for p in self._pools.values() if p.shm_path is not None and not os.path.exists(p.shm_path)]
        for attached in gone:
            with self._lock:
                del self._pools[attached.pool_id]
                if self._own_pool == attached.pool_id:
                    self._own_pool = None
            logger.info("detached page pool %s (its file %s is gone; %d pools attached)",
                        attached.pool_id, attached.shm_path, len(self._pools))

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


def _describe(geometry: tuple[tuple[int, ...], str]) -> str:
    (num_layers, _two, page_size, num_heads, head_dim), dtype = geometry
    return (f"(num_layers={num_layers}, page_size={page_size}, num_heads={num_heads}, "
            f"head_dim={head_dim}, dtype={dtype})")


class _Reply(Exception):
    """An expected non-OK RPC outcome."""

    def __init__(self, status: RpcStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
