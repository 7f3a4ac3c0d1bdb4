"""The ``mooncake`` backend: pages as objects in Mooncake Store (PyPI ``mooncake-transfer-engine``).

Key of a page: ``"kv-" + page_key.hex()`` (the hash chain of ``kvlifecycle.hashing``); value:
the page's bytes, page-major ``[num_layers, 2, page_size, num_heads, head_dim]``. Copies run in
the calling process: pool pages are gathered into a registered staging tensor and sent with
``batch_put_from``; gets land in the staging tensor (``batch_get_into``) and are scattered
into the pool. Eviction is Mooncake's (the master's watermarks), not ours.

Each client calls ``MooncakeDistributedStore.setup`` (P2PHANDSHAKE metadata, TCP by default)
against ``master_address``, contributing ``global_segment_bytes`` of its memory to the
cluster. When setup fails (master down) the client fails open and retries setup after
``retry_interval_s``. Every Mooncake call runs on the client's worker threads; a caller waits
at most ``rpc_timeout_s`` for ``get_match``.

CPU hosts: the wheel links ``libcuda.so.1`` and ``libcudart.so.12``. Where the driver is
absent, ``load_mooncake`` preloads a no-device stub ``libcuda.so.1`` (every entry point
returns CUDA_ERROR_NO_DEVICE; built once with the C compiler into ``~/.cache/kvlifecycle``)
and the runtime from ``nvidia-cuda-runtime-cu12``; Mooncake's TCP path then runs.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import ctypes
import itertools
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from kvlifecycle.hashing import TokenIds, page_keys, tokens_as_int64
from kvlifecycle.pool import PagePool
from kvlifecycle.store.api import (DEFAULT_WAIT_TIMEOUT_S, HostStoreClient, PageSelection, Status,
                                   prefix_mask, select_pages)
from kvlifecycle.store.transfer import PageCopier, host_page_shape

logger = logging.getLogger(__name__)

__all__ = ["MooncakeStoreClient", "MasterProcess", "start_master", "load_mooncake", "MooncakeUnavailable"]

# Entry points of libcuda that mooncake's store.so links (nm -D --undefined-only store.so).
_CUDA_DRIVER_SYMBOLS = (
    "cuCtxGetDevice", "cuCtxSetCurrent", "cuDeviceGet", "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRetain", "cuGetErrorName", "cuGetErrorString",
    "cuInit", "cuMemAddressFree", "cuMemAddressReserve", "cuMemCreate", "cuMemExportToShareableHandle",
    "cuMemGetAddressRange_v2", "cuMemGetAllocationGranularity", "cuMemGetHandleForAddressRange",
    "cuMemImportFromShareableHandle", "cuMemMap", "cuMemRelease", "cuMemSetAccess", "cuMemUnmap",
    "cuPointerGetAttribute", "cuPointerSetAttribute",
)
_CUDA_ERROR_NO_DEVICE = 100
_OBJECT_NOT_FOUND = -704  # ErrorCode::OBJECT_NOT_FOUND (mooncake-store types.h)
_STUB_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvlifecycle"


class MooncakeUnavailable(RuntimeError):
    """``mooncake.store`` cannot be imported here; the message says why."""


def load_mooncake() -> Any:
    """The ``mooncake.store`` module, preloading CUDA stand-ins on a host without a driver.
    Raises MooncakeUnavailable naming the cause."""
    try:
        import mooncake.store as mstore
        return mstore
    except ImportError as e:
        if "libcuda.so.1" not in str(e) and "libcudart.so.12" not in str(e):
            raise MooncakeUnavailable(f"import mooncake.store failed: {e}") from e
        first_error = e
    try:
        _preload_cuda_standins()
        import mooncake.store as mstore
        logger.warning("mooncake: no CUDA driver on this host (%s); using a no-device libcuda stub",
                       first_error)
        return mstore
    except (ImportError, OSError, subprocess.CalledProcessError) as e:
        raise MooncakeUnavailable(
            f"import mooncake.store failed ({first_error}); the no-device CUDA stub did not help: {e}") from e


@dataclass
class _Task:
    op: str
    sel: PageSelection
    namespace: str
    copier: PageCopier | None = None  # the pool registered when the task was submitted
    future: cf.Future | None = None
    cancelled: bool = False


class MooncakeStoreClient(HostStoreClient):
    """``HostStoreClient`` on Mooncake Store. Copies run on one worker thread per client.

    Ordering guarantee: the client's tasks run one at a time in submission order (one FIFO
    worker); Mooncake makes a put visible to every client once it returned. Tasks of different
    clients are not ordered.

    Pools: a client copies to and from the pool last given to ``register_pool`` (one per
    process: each server process registers its own pool, or the owner's pool it offloads). A
    task keeps the pool that was registered when it was submitted, so re-registering (the
    owner re-created its pool) never sends a queued task's pages to the other pool.
    """

    def __init__(self, master_address: str, page_size: int, pool_handle: dict[str, Any] | None = None,
                 local_hostname: str = "127.0.0.1", metadata_server: str = "P2PHANDSHAKE",
                 protocol: str = "tcp", global_segment_bytes: int = 256 << 20,
                 local_buffer_bytes: int = 64 << 20, staging_pages: int = 64,
                 rpc_timeout_s: float = 0.5, retry_interval_s: float = 1.0,
                 debug_copy_delay_s: float = 0.0) -> None:
        if page_size <= 0 or page_size % 2:
            raise ValueError(f"page_size: expected a positive even token count, got {page_size}")
        if staging_pages < 1:
            raise ValueError(f"staging_pages: expected >= 1, got {staging_pages}")
        self._mstore = load_mooncake()
        self.page_size = page_size
        self.master_address = master_address
        self._setup_args = (local_hostname, metadata_server, global_segment_bytes, local_buffer_bytes,
                            protocol, "", master_address)
        self.staging_pages = staging_pages
        self.rpc_timeout_s = rpc_timeout_s
        self.retry_interval_s = retry_interval_s
        self.debug_copy_delay_s = debug_copy_delay_s
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._tasks: dict[int, _Task] = {}
        self._prepared: dict[int, tuple[np.ndarray, str, int]] = {}
        self._copy_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="mooncake-copy")
        self._match_pool = cf.ThreadPoolExecutor(1, thread_name_prefix="mooncake-match")
        self._counters = collections.Counter[str]()
        self._store: Any = None
        self._up = True
        self._next_setup = 0.0
        self._pool: PagePool | None = None
        self._copier: PageCopier | None = None
        self._staging: torch.Tensor | None = None
        self._registered = False
        self._closed = False
        if pool_handle is not None:
            self.register_pool(pool_handle)

    # -- public API ---------------------------------------------------------------------

    def register_pool(self, handle: dict[str, Any]) -> bool:
        pool = PagePool.attach(handle)
        if pool.spec.page_size != self.page_size:
            raise ValueError(f"register_pool: pool page_size {pool.spec.page_size} != client page_size "
                             f"{self.page_size}")
        shape = (self.staging_pages, *host_page_shape(pool.spec.shape))
        with self._lock:
            staging = self._staging
            if staging is None or tuple(staging.shape) != shape or staging.dtype != pool.spec.torch_dtype:
                # Registered with the store lazily (after setup); kept across pools of one geometry.
                staging = torch.empty(shape, dtype=pool.spec.torch_dtype, pin_memory=pool.tensor.is_cuda)
                self._registered = False
            self._pool, self._copier, self._staging = pool, PageCopier(pool.tensor), staging
        return True

    def get_match(self, token_ids: TokenIds, namespace: str) -> tuple[int, np.ndarray]:
        tokens = tokens_as_int64(token_ids)
        task_id = next(self._ids)
        future = self._match_pool.submit(self._held_prefix, tokens, namespace)
        try:
            pages = future.result(timeout=self.rpc_timeout_s)
        except cf.TimeoutError:
            self._fail("get_match", "timed out")
            pages = 0
        except Exception as e:
            self._fail("get_match", repr(e), exc_info=True)
            pages = 0
        with self._lock:
            self._prepared[task_id] = (tokens[: pages * self.page_size], namespace, pages)
        return task_id, prefix_mask(tokens.size, pages, self.page_size)

    def put_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds | None = None) -> int:
        sel = select_pages(token_ids, slot_mapping, token_mask, self.page_size, "put_async")
        return self._submit(next(self._ids), _Task("put", sel, namespace))

    def get_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds) -> int:
        sel = select_pages(token_ids, slot_mapping, token_mask, self.page_size, "get_async")
        return self._submit(next(self._ids), _Task("get", sel, namespace))

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[TokenIds]) -> None:
        if len(task_ids) != len(slot_mappings):
            raise ValueError(f"launch: {len(task_ids)} task_ids but {len(slot_mappings)} slot_mappings")
        for task_id, slots in zip(task_ids, slot_mappings):
            with self._lock:
                prep = self._prepared.pop(task_id, None)
            if prep is None:
                raise ValueError(f"launch: task {task_id} is not a get_match task waiting for launch")
            tokens, namespace, _pages = prep
            sel = select_pages(tokens, slots, np.ones(tokens.size, dtype=bool), self.page_size,
                               f"launch (task {task_id})")
            self._submit(task_id, _Task("get", sel, namespace))

    def wait(self, task_ids: Sequence[int], timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> dict[int, Status]:
        deadline = time.monotonic() + timeout_s
        with self._lock:
            futures = [self._tasks[t].future for t in task_ids if t in self._tasks]
        cf.wait([f for f in futures if f is not None], timeout=max(0.0, deadline - time.monotonic()))
        return {t: (Status.TIMEOUT if s is Status.UNREADY else s) for t, s in self.try_wait(task_ids).items()}

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, Status]:
        out: dict[int, Status] = {}
        with self._lock:
            for task_id in task_ids:
                if task_id in self._prepared:
                    out[task_id] = Status.UNREADY
                    continue
                task = self._tasks.get(task_id)
                if task is None:
                    raise ValueError(f"try_wait: unknown task {task_id} (never submitted, or already reaped)")
                assert task.future is not None
                if not task.future.done():
                    out[task_id] = Status.UNREADY
                    continue
                del self._tasks[task_id]
                out[task_id] = task.future.result()
                self._counters[f"task_{out[task_id].value.lower()}"] += 1
        return out

    def cancel(self, task_ids: Sequence[int]) -> None:
        with self._lock:
            for task_id in task_ids:
                if self._prepared.pop(task_id, None) is not None:
                    self._tasks[task_id] = _Task("get", select_pages([], [], None, self.page_size, "cancel"), "")
                    self._tasks[task_id].future = _done(Status.CANCELLED)
                elif task_id in self._tasks:
                    self._tasks[task_id].cancelled = True  # the worker skips it if not started

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"backend": "mooncake", "master": self.master_address, "up": self._up,
                    "pending_tasks": len(self._tasks), **self._counters}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._copy_pool.shutdown(wait=True, cancel_futures=True)
        self._match_pool.shutdown(wait=False, cancel_futures=True)
        if self._store is not None:
            try:
                self._store.close()
            except Exception:
                logger.warning("mooncake: close failed", exc_info=True)
            self._store = None

    # -- helpers (worker threads) -------------------------------------------------------

    def _submit(self, task_id: int, task: _Task) -> int:
        with self._lock:
            task.copier = self._copier
        if task.sel.seq_pages.size == 0:
            task.future = _done(Status.SUCCESS)
        else:
            task.future = self._copy_pool.submit(self._run, task)
        with self._lock:
            self._tasks[task_id] = task
        return task_id

    def _run(self, task: _Task) -> Status:
        if task.cancelled:
            return Status.CANCELLED
        if self.debug_copy_delay_s:
            time.sleep(self.debug_copy_delay_s)
        try:
            store = self._connected()
            if store is None:
                return Status.FAILED
            if task.copier is None or self._staging is None:
                logger.error("mooncake: %s before register_pool; nothing copied", task.op)
                return Status.FAILED
            keys = _object_keys(task.sel, task.namespace, self.page_size)
            for start in range(0, len(keys), self.staging_pages):
                chunk = slice(start, start + self.staging_pages)
                status = (self._put_chunk(store, task.copier, keys[chunk], task.sel.pool_pages[chunk])
                          if task.op == "put"
                          else self._get_chunk(store, task.copier, keys[chunk], task.sel.pool_pages[chunk]))
                if status is not Status.SUCCESS:
                    return status
            self._counters[f"{task.op}_pages"] += len(keys)
            return Status.SUCCESS
        except Exception as e:
            self._fail(task.op, repr(e), exc_info=True)
            return Status.FAILED

    def _put_chunk(self, store: Any, copier: PageCopier, keys: list[str], pool_pages: np.ndarray) -> Status:
        assert self._staging is not None
        n = len(keys)
        copier.gather(pool_pages, self._staging, np.arange(n, dtype=np.int64))
        ptrs, sizes = self._staging_ptrs(n)
        codes = store.batch_put_from(keys, ptrs, sizes)
        # Existing objects are identical (content-addressed keys): an "exists" error is fine.
        refused = [i for i, code in enumerate(codes) if code != 0]
        exists = store.batch_is_exist([keys[i] for i in refused]) if refused else []
        bad = sorted({codes[i] for i, ok in zip(refused, exists) if ok != 1})
        if bad:
            self._fail("put", f"batch_put_from codes {bad}")
            self._reset(store)
            return Status.FAILED
        return Status.SUCCESS

    def _get_chunk(self, store: Any, copier: PageCopier, keys: list[str], pool_pages: np.ndarray) -> Status:
        assert self._staging is not None
        n = len(keys)
        ptrs, sizes = self._staging_ptrs(n)
        got = store.batch_get_into(keys, ptrs, sizes)
        if any(g < 0 and g != _OBJECT_NOT_FOUND for g in got):
            self._fail("get", f"batch_get_into codes {sorted({g for g in got if g < 0})}")
            self._reset(store)
            return Status.FAILED
        if any(g != s for g, s in zip(got, sizes)):
            self._counters["get_missing_pages"] += sum(g != s for g, s in zip(got, sizes))
            return Status.NOTFOUND
        copier.scatter(self._staging, np.arange(n, dtype=np.int64), pool_pages)
        return Status.SUCCESS

    def _held_prefix(self, tokens: np.ndarray, namespace: str) -> int:
        store = self._connected()
        keys = ["kv-" + k.hex() for k in page_keys(tokens, namespace, self.page_size)]
        if store is None or not keys:
            return 0
        found = store.batch_is_exist(keys)
        if any(exists < 0 for exists in found):
            self._fail("get_match", "batch_is_exist failed")
            self._reset(store)
            return 0
        held = 0
        for exists in found:
            if exists != 1:
                break
            held += 1
        return held

    def _staging_ptrs(self, n: int) -> tuple[list[int], list[int]]:
        assert self._staging is not None
        page_bytes = self._staging[0].numel() * self._staging.element_size()
        base = self._staging.data_ptr()
        return [base + i * page_bytes for i in range(n)], [page_bytes] * n

    def _connected(self) -> Any:
        """The set-up store, or None while the master is unreachable (setup retried later)."""
        with self._lock:
            if self._store is not None:
                store = self._store
            elif time.monotonic() < self._next_setup:
                return None
            else:
                store = None
        if store is None:
            candidate = self._mstore.MooncakeDistributedStore()
            rc = candidate.setup(*self._setup_args)
            if rc != 0:
                with self._lock:
                    self._next_setup = time.monotonic() + self.retry_interval_s
                self._fail("setup", f"setup returned {rc} (master {self.master_address} down?)")
                return None
            with self._lock:
                self._store = store = candidate
                self._registered = False
            self._mark_up()
        if not self._registered and self._staging is not None:
            rc = store.register_buffer(self._staging.data_ptr(), self._staging.numel() * self._staging.element_size())
            if rc != 0:
                self._fail("register_buffer", f"returned {rc}")
                return None
            self._registered = True
        return store

    def _reset(self, store: Any) -> None:
        """Drop a store whose master stopped answering; set up a fresh one after the back-off
        (a restarted master knows nothing of the old one's segment). The old one is closed on a
        background thread: its unmount waits for RPC timeouts."""
        with self._lock:
            if self._store is not store:
                return
            self._store = None
            self._next_setup = time.monotonic() + self.retry_interval_s
        threading.Thread(target=_close_quietly, args=(store,), name="mooncake-close", daemon=True).start()

    def _fail(self, what: str, why: str, exc_info: bool = False) -> None:
        with self._lock:
            self._counters["errors"] += 1
            first = self._up
            self._up = False
            if first:
                self._counters["outages"] += 1
        if first:
            logger.warning("mooncake store unreachable or failing (%s: %s); failing open", what, why,
                           exc_info=exc_info)

    def _mark_up(self) -> None:
        with self._lock:
            was_down = not self._up
            self._up = True
            if was_down:
                self._counters["reconnects"] += 1
        if was_down:
            logger.info("mooncake store %s answers again", self.master_address)


@dataclass
class MasterProcess:
    """A ``mooncake_master`` child process (loopback)."""

    proc: subprocess.Popen
    address: str
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_master(port: int | None = None, log_path: Path | None = None, ready_timeout_s: float = 10.0,
                 extra_args: Sequence[str] = ()) -> MasterProcess:
    """Start ``mooncake_master`` on 127.0.0.1 (a free port unless given) and wait for its port."""
    binary = shutil.which("mooncake_master") or str(Path(os.__file__).parent / "mooncake_master")
    venv_bin = Path(__import__("sys").executable).parent / "mooncake_master"
    if venv_bin.exists():
        binary = str(venv_bin)
    port = port or _free_port()
    metrics_port = _free_port()
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    cmd = [binary, f"--rpc_port={port}", f"--metrics_port={metrics_port}", "--rpc_address=127.0.0.1",
           "--enable_metric_reporting=false", *extra_args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    master = MasterProcess(proc, f"127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return master
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                master.stop()
                raise RuntimeError(f"mooncake_master did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------
# helpers


def _object_keys(sel: PageSelection, namespace: str, page_size: int) -> list[str]:
    keys = page_keys(sel.tokens, namespace, page_size)
    return ["kv-" + keys[i].hex() for i in sel.seq_pages]


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception:
        logger.warning("mooncake: closing a stale store failed", exc_info=True)


def _done(status: Status) -> cf.Future:
    future: cf.Future = cf.Future()
    future.set_result(status)
    return future


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _preload_cuda_standins() -> None:
    """Load a no-device libcuda.so.1 and the pip CUDA runtime so store.so's links resolve."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        ctypes.CDLL(str(_build_cuda_stub()), mode=ctypes.RTLD_GLOBAL)
    try:
        ctypes.CDLL("libcudart.so.12", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        import nvidia.cuda_runtime  # PyPI nvidia-cuda-runtime-cu12

        lib = Path(list(nvidia.cuda_runtime.__path__)[0]) / "lib" / "libcudart.so.12"
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)


def _build_cuda_stub() -> Path:
    target = _STUB_DIR / "libcuda.so.1"
    if target.exists():
        return target
    _STUB_DIR.mkdir(parents=True, exist_ok=True)
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (cc/gcc) to build the no-device libcuda.so.1 stub")
    source = "\n".join(f"int {name}(void) {{ return {_CUDA_ERROR_NO_DEVICE}; }}" for name in _CUDA_DRIVER_SYMBOLS)
    with tempfile.TemporaryDirectory() as tmp:
        c_file = Path(tmp) / "cuda_stub.c"
        c_file.write_text(source + "\n")
        built = Path(tmp) / "libcuda.so.1"
        subprocess.run([compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(built), str(c_file)],
                       check=True, capture_output=True)
        os.replace(built, target)  # atomic: concurrent builders agree
    return target
