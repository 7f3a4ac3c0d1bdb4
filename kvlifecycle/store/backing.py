"""Where the store server keeps pages: the interface of a backing, and the local one (this
host's DRAM, plus an optional disk tier).

A backing holds pages of one geometry (host page shape ``[L, 2, S, H, D]`` and dtype), keyed
by the page hash chain (``kvlifecycle.hashing.page_keys``). The server makes one per geometry
(``BackingFactory``) and calls, in this order:

1. ``held_prefix(keys) -> int`` (socket thread): how many of ``keys``, from the first, the
   backing holds. Answers from an index or one batched lookup; a backing that cannot reach
   its storage answers 0 (a miss).
2. ``put(copier, pool_pages, keys) -> Status`` (copy thread): copy the pool pages into the
   backing under ``keys``. SUCCESS once the bytes are held (a backing may keep only a prefix
   when full: it is what later lookups match first); FAILED when its storage failed.
3. ``get(copier, pool_pages, keys) -> Status`` (copy thread): copy the pages held under
   ``keys`` into the pool pages. NOTFOUND, with nothing copied, when a page is missing.
4. ``stats() -> dict`` (any thread), ``close()`` once, after the copy thread stopped (flushes
   what is written behind).

A backing whose pages sit in shared memory (the local one, ``slab.SharedSlab``) also answers
``slab_handle()`` and ``locate(requests, pin_s)`` (socket thread): where each request's pages
are, pinned, so that the reader copies them itself. The others answer ``slab_handle() -> None``.

``held_prefix`` may run while the copy thread runs ``put``/``get``: each backing guards its
own indexes. Backings: ``LocalBacking`` here; ``MooncakeBacking`` (``mooncake.py``).
"""

from __future__ import annotations

import abc
import collections
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvlifecycle.store.api import Status
from kvlifecycle.store.key_filter import KeyFilterWriter
from kvlifecycle.store.tiers import DiskTier, DramTier
from kvlifecycle.store.transfer import PageCopier

logger = logging.getLogger(__name__)

__all__ = ["Backing", "BackingFactory", "LocalBacking", "LocalConfig"]

_DISK_FLUSH_TIMEOUT_S = 60.0


class Backing(abc.ABC):
    """See the module docstring for the call order and what each call promises."""

    @abc.abstractmethod
    def held_prefix(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are held (0 when the storage is unreachable)."""

    @abc.abstractmethod
    def put(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        """Copy ``pool_pages`` into the backing under ``keys`` (same order)."""

    @abc.abstractmethod
    def get(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        """Copy the pages held under ``keys`` into ``pool_pages``; NOTFOUND copies nothing."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for the server's ``stats`` reply."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release; called once, after the last ``put``/``get``."""

    def slab_handle(self) -> dict[str, Any] | None:
        """The shared slab readers map (``SharedSlab.handle()``); None: this backing has none."""
        return None

    def locate(self, requests: list[list[bytes]], pin_s: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each request's keys, the slab rows of its held prefix and their versions, pinned
        for ``pin_s``. Only where ``slab_handle()`` is not None."""
        raise NotImplementedError(f"{type(self).__name__} has no shared slab")


# Makes the backing for one page geometry: (host page shape [L, 2, S, H, D], dtype, pin_memory).
BackingFactory = Callable[[tuple[int, ...], torch.dtype, bool], Backing]


@dataclass(frozen=True)
class LocalConfig:
    """The local backing: a DRAM tier (LRU, byte capacity) and an optional disk tier."""

    dram_bytes: int = 2 << 30  # 2 GiB, hstu-serve's default too
    disk_dir: Path | None = None
    disk_bytes: int = 0  # 0: unbounded
    key_filter: Path | None = None  # where to publish the held keys' filter (key_filter.py); None: nowhere
    shared_slab: bool = True  # the DRAM tier in shared memory (a memfd), so readers copy host hits themselves (slab.py)

    def __post_init__(self) -> None:
        if self.dram_bytes <= 0:
            raise ValueError(f"--dram-bytes: expected a positive byte count, got {self.dram_bytes}")
        if self.disk_bytes < 0:
            raise ValueError(f"--disk-bytes: expected >= 0 (0 = unbounded), got {self.disk_bytes}")

    def factory(self) -> BackingFactory:
        return lambda page_shape, dtype, pin_memory: LocalBacking(self, page_shape, dtype, pin_memory)


class LocalBacking(Backing):
    """Pages in a DRAM slab (LRU) and, when configured, written behind to disk. A get of a page
    only on disk reads it and promotes it back into DRAM. With ``config.key_filter`` it publishes
    the keys it holds there (``key_filter.KeyFilterWriter``): each put's keys before the put is
    done, every held key (DRAM and disk) at the start and at each rebuild."""

    def __init__(self, config: LocalConfig, page_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool) -> None:
        self.dram = DramTier(config.dram_bytes, page_shape, dtype, pin_memory=pin_memory, shared=config.shared_slab)
        self.disk = (DiskTier(config.disk_dir, page_shape, dtype, capacity_bytes=config.disk_bytes)
                     if config.disk_dir is not None else None)
        self._pin_memory = pin_memory
        self._lock = threading.Lock()  # guards the DRAM index and the key filter (the disk tier has its own lock)
        self._counters = collections.Counter[str]()
        self.key_filter = KeyFilterWriter(config.key_filter) if config.key_filter is not None else None
        if self.key_filter is not None:
            self.key_filter.rebuild(self._held_keys())  # the disk tier's pages, after a restart

    def held_prefix(self, keys: list[bytes]) -> int:
        held = 0
        with self._lock:
            for key in keys:
                if not (self.dram.holds(key) or (self.disk is not None and self.disk.holds(key))):
                    break
                held += 1
        self._counters["match_pages"] += held
        return held

    def put(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        with self._lock:
            fresh = [i for i, key in enumerate(keys) if self.dram.row(key) is None]
            rows = self.dram.reserve(len(fresh), keep=set(keys))
        if len(rows) < len(fresh):
            self._counters["put_pages_over_capacity"] += len(fresh) - len(rows)
            fresh = fresh[: len(rows)]  # keep the prefix: it is what later lookups match first
        try:
            copier.gather(pool_pages[fresh], self.dram.copy_rows, np.asarray(rows, dtype=np.int64))
        except BaseException:
            with self._lock:
                self.dram.release(rows)
            raise
        fresh_keys = [keys[i] for i in fresh]
        # The disk tier's copy of the pages is taken while the rows are still reserved: once
        # inserted, another thread's reserve (a locate reading disk pages back) may evict and reuse
        # them, and a copy taken then wrote another page's bytes under these keys (seen in stress
        # with a small DRAM tier: wrong scores, once those files were read back).
        for_disk = (self.dram.slab.index_select(0, torch.as_tensor(rows, dtype=torch.int64))
                    if self.disk is not None and fresh else None)
        with self._lock:
            inserted = self.dram.insert(fresh_keys, rows)
            if self.key_filter is not None:
                self.key_filter.add(fresh_keys)
                if self.key_filter.rebuild_due():  # drop the keys evicted since the last one
                    self.key_filter.rebuild(self._held_keys())
                    self._counters["key_filter_rebuilds"] += 1
        self._counters["put_pages"] += inserted
        self._counters["put_bytes"] += inserted * self.dram.page_bytes
        if for_disk is not None:
            self.disk.write_behind(fresh_keys, for_disk)
        return Status.SUCCESS

    def get(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes]) -> Status:
        with self._lock:
            rows = [self.dram.row(key) for key in keys]
            held = [row for row in rows if row is not None]
            self.dram.hold(held)  # not evicted (and reused) by another thread's reserve while copied
        try:
            return self._get(copier, pool_pages, keys, rows)
        finally:
            with self._lock:
                self.dram.unhold(held)

    def _get(self, copier: PageCopier, pool_pages: np.ndarray, keys: list[bytes], rows: list[int | None]) -> Status:
        missing = [i for i, row in enumerate(rows) if row is None]
        loaded: list[torch.Tensor] = []
        for i in missing:
            page = self.disk.read(keys[i]) if self.disk is not None else None
            if page is None:
                self._counters["get_missing_pages"] += 1
                return Status.NOTFOUND
            loaded.append(page)
        present = [i for i, row in enumerate(rows) if row is not None]
        copier.scatter(self.dram.copy_rows, np.asarray([rows[i] for i in present], dtype=np.int64), pool_pages[present])
        if loaded:
            from_disk = torch.stack(loaded)  # [m, L, 2, S, H, D]
            if self._pin_memory:
                from_disk = from_disk.pin_memory()
            copier.scatter(from_disk, np.arange(len(loaded), dtype=np.int64), pool_pages[missing])
            self._promote([keys[i] for i in missing], from_disk, keep=set(keys))
        self._counters["get_pages"] += len(keys)
        self._counters["get_bytes"] += len(keys) * self.dram.page_bytes
        return Status.SUCCESS

    def slab_handle(self) -> dict[str, Any] | None:
        return self.dram.shared.handle() if self.dram.shared is not None else None

    def locate(self, requests: list[list[bytes]], pin_s: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """Pages only on disk are read into DRAM first (on the caller's thread: the restart case)."""
        assert self.dram.shared is not None, "LocalBacking.locate: the DRAM tier is private"
        until = time.monotonic() + pin_s
        out = []
        for keys in requests:
            with self._lock:
                rows = self._pin_held(keys, until)
            if len(rows) < len(keys) and self.disk is not None and self._load_from_disk(keys[len(rows):], set(keys)):
                with self._lock:
                    rows += self._pin_held(keys[len(rows):], until)
            found = np.asarray(rows, dtype=np.int64)
            out.append((found, self.dram.shared.versions_of(found)))  # pinned: no version moves now
            self._counters["located_pages"] += len(rows)
        return out

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = {"backing": "local", "page_bytes": self.dram.page_bytes,
                                   "dram_capacity_pages": self.dram.capacity_pages, "dram_pages": len(self.dram),
                                   "dram_evictions": self.dram.evictions, **self._counters}
        if self.disk is not None:
            out["disk_pages"] = len(self.disk)
            out.update({f"disk_{k}": v for k, v in self.disk.counters.items()})
        return out

    def close(self) -> None:
        if self.key_filter is not None:
            self.key_filter.close()
        if self.disk is not None:
            if self.disk.close(timeout_s=_DISK_FLUSH_TIMEOUT_S):
                logger.info("disk write-behind queue flushed (%d pages on disk)", len(self.disk))
            else:
                logger.error("disk write-behind queue did not drain within %.0f s; pages lost", _DISK_FLUSH_TIMEOUT_S)
        self.dram.close()

    # -- helpers ------------------------------------------------------------------------

    def _held_keys(self) -> list[bytes]:
        return self.dram.keys() + (self.disk.keys() if self.disk is not None else [])

    def _pin_held(self, keys: list[bytes], until: float) -> list[int]:
        """The DRAM rows of the held prefix of ``keys``, pinned (under the index lock)."""
        rows = []
        for key in keys:
            row = self.dram.row(key)
            if row is None:
                break
            rows.append(row)
        self.dram.pin(rows, until)
        return rows

    def _load_from_disk(self, keys: list[bytes], keep: set[bytes]) -> bool:
        """Read the leading ``keys`` held on disk into DRAM; False when the first is not there."""
        pages = []
        for key in keys:
            page = self.disk.read(key)
            if page is None:
                break
            pages.append(page)
        if pages:
            self._promote(keys[:len(pages)], torch.stack(pages), keep=keep)
        return bool(pages)

    def _promote(self, keys: list[bytes], pages: torch.Tensor, keep: set[bytes]) -> None:
        """Put pages read from disk back into DRAM (they are hot)."""
        with self._lock:
            new = [i for i, key in enumerate(keys) if not self.dram.holds(key)]
            rows = self.dram.reserve(len(new), keep=keep)
        new = new[: len(rows)]
        if new:
            self.dram.slab.index_copy_(0, torch.as_tensor(rows, dtype=torch.int64),
                                       pages.index_select(0, torch.as_tensor(new, dtype=torch.int64)))
        with self._lock:
            self.dram.insert([keys[i] for i in new], rows)
