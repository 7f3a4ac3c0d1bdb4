"""Storage tiers of the embedded store: DRAM (byte capacity, LRU) and disk (write-behind).

DramTier: one preallocated slab of page rows ``[capacity_pages, L, 2, S, H, D]`` (pinned on a
GPU host; in shared memory when asked, ``slab.SharedSlab``, so readers copy rows themselves) and
an LRU index key -> row. ``reserve`` hands out rows, evicting least recently used pages that are
not pinned (``pin``: rows a reader was told to copy); ``insert`` publishes them (in a shared
slab's index too, where readers find them without asking). A page readers stamped as read since
the tier last looked (``SharedSlab.find``) gets a second chance: it moves to the recent end instead
of being evicted. The caller holds the store's index lock around every call.

DiskTier: one file per page under ``<dir>/<geometry>/<key[:1]>/<key>.kvp``. ``write_behind``
queues pages for a background thread that writes each to a temporary file and renames it into
place; ``flush`` waits for the queue. The index is rebuilt at start by scanning the directory
(a restart finds every page written before). Each file carries a CRC32 of its payload, the
pool geometry and its key: ``read`` returns None (a miss) for a torn, corrupt or foreign file
and deletes it, never wrong data.

File layout (little-endian)::

    magic b"KVP1" | geometry digest (16 B) | key length u16 | key | payload length u64 |
    crc32(payload) u32 | payload (one host page, raw bytes)
"""

from __future__ import annotations

import collections
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import torch

from kvlifecycle.store.slab import SharedSlab, SlabUnavailable

logger = logging.getLogger(__name__)

__all__ = ["DramTier", "DiskTier", "geometry_digest"]

_MAGIC = b"KVP1"
_PREFIX = struct.Struct("<4s16sH")
_SUFFIX = struct.Struct("<QI")
_FILE_EXT = ".kvp"


def geometry_digest(page_shape: tuple[int, ...], dtype: torch.dtype) -> bytes:
    """16 bytes naming a page geometry; pages of another geometry never match."""
    text = f"{tuple(page_shape)}|{dtype}".encode("utf-8")
    return hashlib.blake2b(text, digest_size=16).digest()


class DramTier:
    """Page rows in host memory with LRU eviction at a fixed page capacity."""

    def __init__(self, capacity_bytes: int, page_shape: tuple[int, ...], dtype: torch.dtype,
                 pin_memory: bool, shared: bool = False) -> None:
        page_bytes = int(np.prod(page_shape)) * torch.empty((), dtype=dtype).element_size()
        self.capacity_pages = capacity_bytes // page_bytes
        if self.capacity_pages < 1:
            raise ValueError(
                f"--dram-bytes {capacity_bytes} holds no page of {page_bytes} bytes; "
                f"give at least {page_bytes}")
        self.page_bytes = page_bytes
        self.shared: SharedSlab | None = None
        if shared:
            try:
                self.shared = SharedSlab.create(self.capacity_pages, page_shape, dtype, pin=pin_memory)
            except SlabUnavailable as e:
                logger.warning("DRAM tier kept private (%s): host hits are copied by the store, not by "
                               "their readers", e)
        if self.shared is not None:
            self.slab = self.shared.rows
        else:
            self.slab = torch.empty((self.capacity_pages, *page_shape), dtype=dtype, pin_memory=pin_memory)
            self.slab.zero_()  # commit the memory now: the capacity is real, and copies never page-fault
        self._rows: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._free: list[int] = list(range(self.capacity_pages - 1, -1, -1))  # pop() -> row 0 first
        self._pinned: dict[int, float] = {}  # row -> CLOCK_MONOTONIC until which it is not evicted
        self._read_seen = [0] * self.capacity_pages  # row -> the readers' last read tick eviction saw
        self._held: collections.Counter[int] = collections.Counter()  # rows the store's own copy reads now
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def copy_rows(self) -> torch.Tensor:
        """What the store's own copies address: on a CUDA host, a shared slab's rows mapped into
        the device (the device reads and writes them in place); else ``slab``."""
        return self.shared.copy_rows if self.shared is not None else self.slab

    def holds(self, key: bytes) -> bool:
        return key in self._rows

    def keys(self) -> list[bytes]:
        return list(self._rows)

    def row(self, key: bytes) -> int | None:
        """The key's row, marking it most recently used; None when absent."""
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
        return row

    def reserve(self, count: int, keep: set[bytes]) -> list[int]:
        """Up to ``count`` free rows, evicting least recently used pages not in ``keep`` and not
        pinned. Rows come back ascending when possible, so copies run in few contiguous runs. A
        shared slab's rows get a new version here, before the caller writes into them."""
        if len(self._free) < count:
            now = time.monotonic()
            self._pinned = {row: until for row, until in self._pinned.items() if until > now}
            while len(self._free) < count and self._evict_one(keep):
                pass
        take = min(count, len(self._free))
        rows = sorted(self._free[len(self._free) - take:])
        del self._free[len(self._free) - take:]
        if self.shared is not None:
            self.shared.bump(rows)
        return rows

    def pin(self, rows: list[int], until: float) -> None:
        """Keep ``rows`` from eviction until ``until`` (CLOCK_MONOTONIC): a reader copies them."""
        for row in rows:
            self._pinned[row] = max(until, self._pinned.get(row, 0.0))

    def hold(self, rows: list[int]) -> None:
        """Keep ``rows`` from eviction until ``unhold``: the store's copy thread reads them."""
        self._held.update(rows)

    def unhold(self, rows: list[int]) -> None:
        self._held.subtract(rows)
        for row in rows:
            if self._held[row] <= 0:
                del self._held[row]

    def insert(self, keys: list[bytes], rows: list[int]) -> int:
        """Publish reserved ``rows`` as holding ``keys`` (most recently used); returns how many
        were new. A key inserted since the caller reserved its row (the store's other thread put
        it, or read it back from disk, meanwhile) keeps the row it has, and this row returns free:
        a key names its bytes, so both rows hold the same page."""
        assert len(keys) == len(rows), f"DramTier.insert: {len(keys)} keys for {len(rows)} rows"
        published_keys, published_rows = [], []
        for key, row in zip(keys, rows):
            if key in self._rows:
                self._rows.move_to_end(key)
                self._free.append(row)
                continue
            self._rows[key] = row
            published_keys.append(key)
            published_rows.append(row)
        if self.shared is not None:
            self.shared.publish(published_keys, published_rows)
        return len(published_keys)

    def release(self, rows: list[int]) -> None:
        """Return reserved rows that were not inserted."""
        self._free.extend(rows)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()

    def _evict_one(self, keep: set[bytes]) -> bool:
        for key, row in self._rows.items():
            if key in keep or row in self._pinned or row in self._held:
                continue
            read = self.shared.read_since(row, self._read_seen[row]) if self.shared is not None else None
            if read is not None:  # a reader found it since: a second chance (once per read)
                self._read_seen[row] = read
                self._rows.move_to_end(key)
                return True
            self._free.append(self._rows.pop(key))
            if self.shared is not None:
                self.shared.withdraw(key, row)  # before reserve bumps its version
            self.evictions += 1
            return True
        return False


class DiskTier:
    """Pages as checksummed files, written behind by a background thread."""

    def __init__(self, root: Path, page_shape: tuple[int, ...], dtype: torch.dtype,
                 capacity_bytes: int = 0, queue_batches: int = 1024) -> None:
        self.geometry = geometry_digest(page_shape, dtype)
        self.dir = Path(root) / self.geometry.hex()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page_shape = page_shape
        self.dtype = dtype
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> file bytes
        self._bytes = 0  # sum of _index's values, kept as it changes (a bounded tier trims on every write)
        self._queued: set[bytes] = set()  # queued for writing: held, not yet on disk
        self._queue: queue.Queue[tuple[list[bytes], torch.Tensor] | None] = queue.Queue(queue_batches)
        self.counters = collections.Counter[str]()
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-disk-writer", daemon=True)
        self._writer.start()

    # -- public API ---------------------------------------------------------------------

    def holds(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index or key in self._queued

    def keys(self) -> list[bytes]:
        """Every key held: on disk, or queued to be written."""
        with self._lock:
            return [*self._index, *self._queued]

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def write_behind(self, keys: list[bytes], pages: torch.Tensor) -> bool:
        """Queue ``pages`` ([n, *page_shape], owned by the tier from now on) for writing.
        Returns False (and drops them) when the queue is full."""
        with self._lock:
            # a page queued already is not queued again: its file would be written twice
            fresh = [i for i, k in enumerate(keys) if k not in self._index and k not in self._queued]
            if not fresh:
                return True
            self._queued.update(keys[i] for i in fresh)
        batch = ([keys[i] for i in fresh], pages[fresh] if len(fresh) < len(keys) else pages)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._unqueue(batch[0])
            self.counters["dropped_pages"] += len(fresh)
            logger.warning("disk write-behind queue full; dropped %d pages", len(fresh))
            return False
        return True

    def read(self, key: bytes) -> torch.Tensor | None:
        """One page [*page_shape], or None for a miss (absent, torn or corrupt: deleted)."""
        with self._lock:
            if key not in self._index:
                return None
            self._index.move_to_end(key)
        path = self._path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(key)
            return None
        payload = self._verify(key, data)
        if payload is None:
            self.counters["corrupt_pages"] += 1
            logger.warning("disk tier: page file %s is torn or corrupt; treating it as a miss", path)
            self._forget(key)
            _unlink(path)
            return None
        self.counters["read_pages"] += 1
        return torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.page_shape)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued page is on disk. True when the queue drained."""
        done = threading.Event()
        threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True).start()
        return done.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush, then stop the writer thread. True when everything queued was written."""
        flushed = self.flush(timeout_s)
        self._queue.put(None)
        self._writer.join(timeout_s)
        return flushed

    # -- helpers ------------------------------------------------------------------------

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.dir / name[:2] / (name + _FILE_EXT)

    def _scan(self) -> None:
        found: list[tuple[float, bytes, int]] = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                if not entry.name.endswith(_FILE_EXT):
                    _unlink(Path(entry.path))  # a temporary file of an interrupted write
                    continue
                try:
                    key = bytes.fromhex(entry.name[: -len(_FILE_EXT)])
                    st = entry.stat()
                except (ValueError, OSError):
                    logger.warning("disk tier: ignoring unexpected file %s", entry.path, exc_info=True)
                    continue
                found.append((st.st_mtime, key, st.st_size))
        for _mtime, key, size in sorted(found):
            self._index[key] = size
            self._bytes += size
        logger.info("disk tier %s: %d pages found", self.dir, len(self._index))

    def _verify(self, key: bytes, data: bytes) -> bytes | None:
        head = _PREFIX.size + len(key) + _SUFFIX.size
        if len(data) < head:
            return None
        magic, geometry, key_len = _PREFIX.unpack_from(data, 0)
        if magic != _MAGIC or geometry != self.geometry or key_len != len(key):
            return None
        if data[_PREFIX.size:_PREFIX.size + key_len] != key:
            return None
        length, crc = _SUFFIX.unpack_from(data, _PREFIX.size + key_len)
        payload = data[head:]
        if len(payload) != length or zlib.crc32(payload) != crc:
            return None
        expected = int(np.prod(self.page_shape)) * torch.empty((), dtype=self.dtype).element_size()
        return payload if length == expected else None

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                keys, pages = item
                for key, page in zip(keys, pages):
                    self._write_one(key, page)
                self._unqueue(keys)
            except Exception:
                logger.error("disk tier: write-behind batch failed", exc_info=True)
                self.counters["write_errors"] += 1
                if item is not None:
                    self._unqueue(item[0])
            finally:
                self._queue.task_done()

    def _write_one(self, key: bytes, page: torch.Tensor) -> None:
        payload = page.contiguous().view(torch.uint8).numpy().tobytes()
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
        header = _PREFIX.pack(_MAGIC, self.geometry, len(key)) + key + _SUFFIX.pack(
            len(payload), zlib.crc32(payload))
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, path)
        with self._lock:
            self._bytes += len(header) + len(payload) - self._index.get(key, 0)
            self._index[key] = len(header) + len(payload)
            self._index.move_to_end(key)
        self.counters["written_pages"] += 1
        self._trim()

    def _trim(self) -> None:
        if not self.capacity_bytes:
            return
        while True:
            with self._lock:
                if self._bytes <= self.capacity_bytes or not self._index:
                    return
                key, size = self._index.popitem(last=False)
                self._bytes -= size
            _unlink(self._path(key))
            self.counters["evicted_pages"] += 1

    def _unqueue(self, keys: list[bytes]) -> None:
        with self._lock:
            self._queued.difference_update(keys)

    def _forget(self, key: bytes) -> None:
        with self._lock:
            self._bytes -= self._index.pop(key, 0)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
