"""The ``mooncake`` backing of the store server: pages as objects in Mooncake Store (PyPI
``mooncake-transfer-engine``, imported by ``mooncake_loader.load_mooncake``).

The Mooncake client runs in the store server process only (``python -m kvlifecycle.store
--backing mooncake``), never in a Triton model process: the models talk to that process over
the store protocol, like to the local backing. A Mooncake call can hold the Python interpreter
for a long time (``setup`` against a dead master: about 90 s; ``close`` after the master died:
about 6 s), which would stall every thread of the calling process. Kept in the store process, a
stall is a store timeout for the models: they recompute, and the store process can be killed
and restarted.

Key of a page: ``"kv-" + page_key.hex()`` (the hash chain of ``kvlifecycle.hashing``); value:
the page's bytes, page-major ``[num_layers, 2, page_size, num_heads, head_dim]``. Puts gather
pool pages into a registered staging tensor and send it with ``batch_put_from``; gets land in
the staging tensor (``batch_get_into``) and are scattered into the pool. Eviction is Mooncake's
(the master's watermarks), not ours.

Connection: the backing calls ``MooncakeDistributedStore.setup`` (P2PHANDSHAKE metadata, TCP by
default) against ``master_address``, contributing ``segment_bytes`` of this process's memory to
the cluster (0 when memory nodes, ``deploy/mooncake_node.py``, hold the pages). It sets up only
once the master's port accepts a connection, so a master that is down costs a refused connect,
not a 90 s ``setup``; when a call fails, the store is dropped (its ``close`` holds this process
a few seconds: the models see store timeouts meanwhile) and set up afresh after
``retry_interval_s``, so a failure never leaves a half-working client behind.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlifecycle.rpc import split_host_port
from kvlifecycle.store.api import Status
from kvlifecycle.store.backing import Backing, BackingFactory
from kvlifecycle.store.mooncake_loader import load_mooncake
from kvlifecycle.store.transfer import PageCopier

logger = logging.getLogger(__name__)

__all__ = ["MooncakeBacking", "MooncakeConfig"]

_OBJECT_NOT_FOUND = -704  # ErrorCode::OBJECT_NOT_FOUND (mooncake-store types.h)


@dataclass(frozen=True)
class MooncakeConfig:
    """The ``mooncake`` backing: a running ``mooncake_master`` and what this process gives it."""

    master_address: str  # HOST:PORT
    segment_bytes: int = 256 << 20  # memory this process gives the tier (0: memory nodes hold it)
    local_hostname: str = "127.0.0.1"  # the address other Mooncake nodes reach this process on
    protocol: str = "tcp"
    local_buffer_bytes: int = 64 << 20
    staging_pages: int = 64  # pages per batched put/get
    retry_interval_s: float = 1.0  # after a failure, no setup before this

    def __post_init__(self) -> None:
        try:
            split_host_port(self.master_address)
        except ValueError:
            raise ValueError(f"--mooncake-master: expected the master's HOST:PORT, got {self.master_address!r}") from None
        if self.segment_bytes < 0:
            raise ValueError(f"--mooncake-segment-bytes: expected >= 0, got {self.segment_bytes}")
        if self.staging_pages < 1:
            raise ValueError(f"staging_pages: expected >= 1, got {self.staging_pages}")

    def factory(self) -> BackingFactory:
        return lambda page_shape, dtype, pin_memory: MooncakeBacking(self, page_shape, dtype, pin_memory)


class MooncakeBacking(Backing):
    """``Backing`` on Mooncake Store; see the module docstring. ``held_prefix`` (socket
    thread) and ``put``/``get`` (copy thread) may run at once: Mooncake's store is thread-safe,
    the staging tensor is used by the copy thread only, and one lock guards (re)connecting."""

    def __init__(self, config: MooncakeConfig, page_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool) -> None:
        self.config = config
        self._mstore = load_mooncake()
        self._staging = torch.empty((config.staging_pages, *page_shape), dtype=dtype, pin_memory=pin_memory)
        self._page_bytes = self._staging[0].numel() * self._staging.element_size()
        self._connect_lock = threading.Lock()
        self._lock = threading.Lock()  # guards _store, _next_setup, _up and the counters
        self._store: Any = None
        self._next_setup = 0.0
        self._up = True
        self._counters = collections.Counter[str]()

    # -- Backing ------------------------------------------------------------------------

    def held_prefix(self, keys: list[bytes]) -> int:
        store = self._connected()
        if store is None or not keys:
            return 0
        found = store.batch_is_exist(_object_keys(keys))
        if any(exists < 0 for exists in found):
            self._failed(store, "batch_is_exist", f"codes {sorted({e for e in found if e < 0})}")
            return 0
        held = 0
        for exists in found:
            if exists != 1:
                break
            held += 1
        self._count("match_pages", held)
        return held

    def put(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        store = self._connected()
        if store is None:
            return Status.FAILED
        names = _object_keys(keys)
        for start in range(0, len(names), self.config.staging_pages):
            chunk = slice(start, start + self.config.staging_pages)
            n = len(names[chunk])
            copier.gather(pool_pages[chunk], self._staging, np.arange(n, dtype=np.int64))
            ptrs, sizes = self._staging_ptrs(n)
            codes = store.batch_put_from(names[chunk], ptrs, sizes)
            # Existing objects are identical (content-addressed keys): an "exists" refusal is fine.
            refused = [i for i, code in enumerate(codes) if code != 0]
            exists = store.batch_is_exist([names[chunk][i] for i in refused]) if refused else []
            bad = sorted({codes[i] for i, held in zip(refused, exists) if held != 1})
            if bad:
                self._failed(store, "batch_put_from", f"codes {bad}")
                return Status.FAILED
        self._count("put_pages", len(names))
        self._count("put_bytes", len(names) * self._page_bytes)
        return Status.SUCCESS

    def get(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        store = self._connected()
        if store is None:
            return Status.FAILED
        names = _object_keys(keys)
        held = store.batch_is_exist(names)  # all first, so a NOTFOUND copies nothing
        if any(exists < 0 for exists in held):
            self._failed(store, "batch_is_exist", f"codes {sorted({e for e in held if e < 0})}")
            return Status.FAILED
        if any(exists != 1 for exists in held):
            self._count("get_missing_pages", sum(exists != 1 for exists in held))
            return Status.NOTFOUND
        for start in range(0, len(names), self.config.staging_pages):
            chunk = slice(start, start + self.config.staging_pages)
            n = len(names[chunk])
            ptrs, sizes = self._staging_ptrs(n)
            got = store.batch_get_into(names[chunk], ptrs, sizes)
            if any(g != s for g, s in zip(got, sizes)):
                # Evicted since the check (or the master failed): the pool pages are the
                # caller's, leased for this get, so a partial copy is harmless; it recomputes.
                if any(g < 0 and g != _OBJECT_NOT_FOUND for g in got):
                    self._failed(store, "batch_get_into", f"codes {sorted({g for g in got if g < 0})}")
                    return Status.FAILED
                self._count("get_missing_pages", sum(g != s for g, s in zip(got, sizes)))
                return Status.NOTFOUND
            copier.scatter(self._staging, np.arange(n, dtype=np.int64), pool_pages[chunk])
        self._count("get_pages", len(names))
        self._count("get_bytes", len(names) * self._page_bytes)
        return Status.SUCCESS

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"backing": "mooncake", "master": self.config.master_address, "up": self._up,
                    "page_bytes": self._page_bytes, **self._counters}

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            _close_quietly(store)

    # -- helpers ------------------------------------------------------------------------

    def _connected(self) -> Any:
        """The set-up store, or None while the master is unreachable (set up again later)."""
        with self._connect_lock:
            with self._lock:
                if self._store is not None:
                    return self._store
                if time.monotonic() < self._next_setup:
                    return None
                self._next_setup = time.monotonic() + self.config.retry_interval_s
            # setup() against a master that does not answer holds the interpreter ~90 s: ask
            # the port first (a refused connect takes microseconds).
            if not _port_open(self.config.master_address):
                self._down("setup", f"master {self.config.master_address} refuses connections")
                return None
            c = self.config
            store = self._mstore.MooncakeDistributedStore()
            rc = store.setup(c.local_hostname, "P2PHANDSHAKE", c.segment_bytes, c.local_buffer_bytes, c.protocol,
                             "", c.master_address)
            if rc != 0:
                self._down("setup", f"returned {rc}")
                return None
            rc = store.register_buffer(self._staging.data_ptr(), self._staging.numel() * self._staging.element_size())
            if rc != 0:
                self._down("register_buffer", f"returned {rc}")
                _close_quietly(store)
                return None
            with self._lock:
                self._store = store
                was_down, self._up = not self._up, True
                if was_down:
                    self._counters["reconnects"] += 1
            if was_down:
                logger.info("mooncake master %s answers again", c.master_address)
            return store

    def _failed(self, store: Any, what: str, why: str) -> None:
        """Drop a store whose call failed (the master stopped answering); the next call sets up a
        fresh one after the back-off."""
        self._down(what, why)
        with self._lock:
            if self._store is not store:
                return
            self._store = None
            self._next_setup = time.monotonic() + self.config.retry_interval_s
        _close_quietly(store)

    def _down(self, what: str, why: str) -> None:
        with self._lock:
            self._counters["errors"] += 1
            first, self._up = self._up, False
            if first:
                self._counters["outages"] += 1
        if first:
            logger.warning("mooncake master %s unreachable or failing (%s: %s); puts fail and matches miss "
                           "until it answers", self.config.master_address, what, why)

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self._counters[name] += n

    def _staging_ptrs(self, n: int) -> tuple[list[int], list[int]]:
        base = self._staging.data_ptr()
        return [base + i * self._page_bytes for i in range(n)], [self._page_bytes] * n


# ---------------------------------------------------------------------------------------
# helpers


def _object_keys(keys: list[bytes]) -> list[str]:
    return ["kv-" + key.hex() for key in keys]


def _close_quietly(store: Any) -> None:
    try:
        store.close()
    except Exception:
        logger.warning("mooncake: closing a store failed", exc_info=True)


def _port_open(address: str, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection(split_host_port(address), timeout=timeout_s):
            return True
    except OSError:
        return False
