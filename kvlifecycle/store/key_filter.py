"""The store's published filter of the page keys it holds, so that a miss costs no round trip.

A request whose history the store never saw (a new user) used to take the onboard path: the
owner reserved pages, asked the store, heard "none held" and only then computed, alone. The
store now publishes which keys it may hold, and the owner reads it before it asks.

The filter is a Bloom filter in a file beside the store's socket (``<socket>.keys``), mapped by
the store process (the one writer) and by every client on the host (readers). It answers "may
hold" for every key the store holds: a key is added before the put that stored it is reported
done, and the file is built from the held keys (DRAM and disk) when the store makes its backing
(its first ``register_pool``), so the disk tier's pages count after a restart. Before that there
is no file, and clients ask. Its errors are one-sided:

- a key evicted since is still "may hold" until the next rebuild: the owner asks, as before;
- a key never stored reads "may hold" with the filter's false-positive rate (at 100,000 keys,
  about 1 in 20,000): the owner asks, as before.

So skipping the store on a "no" never loses a host hit the store could serve. Who wrote the page
does not matter: every process that uses the store (the ranking and monolithic models, several
servers on one host) reads the same file. A client that cannot read one asks the store about
every candidate, as before: a store reached over tcp://, a store not started yet, FlexKV's, and
a Mooncake store (``hstu-cluster``), whose pages other servers' stores put too. A restarted store writes a new file; clients notice the
new file within ``RECHECK_S`` (until then they read the old one, which can only cost a round
trip or a recompute, never a wrong page).

Layout: a 64-byte header (magic ``KVF1``, slots as u64, probes as u32, the active buffer as
u32), then two buffers of ``slots`` bytes, one byte per slot. Readers read the active one; a
rebuild fills the other and then flips ``active``, so a reader never sees a half-built filter.
A key (16 bytes of BLAKE2b) is its own hash: its two little-endian u64 halves h1, h2 give the
probes ``(h1 + i * h2) mod slots``.
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["KeyFilterReader", "KeyFilterWriter", "key_filter_path", "remove_stale_key_filter"]

_MAGIC = b"KVF1"
_HEADER = struct.Struct("<4sQII")  # magic, slots, probes, active
_HEADER_BYTES = 64
SLOTS = 1 << 23  # 8 MiB a buffer: at 1,000,000 held keys, about 1 false "may hold" in 40
PROBES = 3
RECHECK_S = 0.5  # how often a reader looks for a new file (a restarted store)


def key_filter_path(endpoint: str) -> Path | None:
    """The filter file of the store at ``endpoint``; None when it has none a client can map
    (a tcp:// store may be on another host)."""
    if not endpoint.startswith("ipc://"):
        return None
    return Path(endpoint[len("ipc://"):] + ".keys")


def remove_stale_key_filter(endpoint: str) -> None:
    """Remove the filter a previous store at ``endpoint`` left (killed before it could): no one
    updates it, and the store starting there may publish none. Every store process calls it at
    its start."""
    path = key_filter_path(endpoint)
    if path is not None:
        path.unlink(missing_ok=True)


class KeyFilterWriter:
    """The store process's side: ``add`` keys as they are stored, ``rebuild`` from every held
    key now and then (drops the evicted ones). One thread writes; ``close`` removes the file."""

    def __init__(self, path: Path, slots: int = SLOTS, probes: int = PROBES) -> None:
        if slots <= 0 or slots & (slots - 1):
            raise ValueError(f"slots: expected a power of two, got {slots}")
        self.path = path
        self.slots = slots
        self.probes = probes
        self.added_since_rebuild = 0
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        try:
            with open(tmp, "w+b") as f:
                f.truncate(_HEADER_BYTES + 2 * slots)
                f.write(_HEADER.pack(_MAGIC, slots, probes, 0))
                self._map = mmap.mmap(f.fileno(), 0)
                self._inode = (os.fstat(f.fileno()).st_dev, os.fstat(f.fileno()).st_ino)
            os.replace(tmp, path)  # readers see a whole file or the previous one
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._buffers = [np.frombuffer(self._map, dtype=np.uint8, count=slots, offset=_HEADER_BYTES + i * slots)
                         for i in range(2)]
        self._active = 0

    def add(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._buffers[self._active][_probes(keys, self.slots, self.probes)] = 1
            self.added_since_rebuild += len(keys)

    def rebuild(self, held: Iterable[bytes]) -> None:
        """Make the filter exactly ``held`` (plus false positives), without a moment in which a
        reader sees fewer keys than both the old and the new filter hold."""
        spare = self._buffers[1 - self._active]
        spare[:] = 0
        keys = list(held)
        if keys:
            spare[_probes(keys, self.slots, self.probes)] = 1
        self._active = 1 - self._active
        _HEADER.pack_into(self._map, 0, _MAGIC, self.slots, self.probes, self._active)
        self.added_since_rebuild = 0

    def rebuild_due(self) -> bool:
        """Whether the keys added since the last rebuild (some since evicted) fill an eighth of
        the slots, past which false positives grow quickly."""
        return self.added_since_rebuild > self.slots // 8

    def close(self) -> None:
        """Unmap, and remove the file if it is still this writer's (a newer writer, another backing
        or a restarted store, may have replaced it)."""
        self._buffers.clear()
        self._map.close()
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                self.path.unlink()
        except FileNotFoundError:
            pass


class KeyFilterReader:
    """A client's side: ``may_hold(keys)``, how many of ``keys``, from the first, the store may
    hold. Every key counts as held while no filter can be read. Not thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._inode: tuple[int, int] | None = None
        self._checked_at = -RECHECK_S

    def may_hold(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        self._follow_file()
        if self._map is None:
            return len(keys)
        magic, slots, probes, active = _HEADER.unpack_from(self._map, 0)
        buffer = np.frombuffer(self._map, dtype=np.uint8, count=slots, offset=_HEADER_BYTES + active * slots)
        held = buffer[_probes(keys, slots, probes)].reshape(len(keys), probes).all(axis=1)
        return len(keys) if held.all() else int(np.argmin(held))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _follow_file(self) -> None:
        """Map the store's current file: at most every ``RECHECK_S``, look whether it changed."""
        now = time.monotonic()
        if now - self._checked_at < RECHECK_S:
            return
        self._checked_at = now
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.close()
            self._inode = None
            return
        inode = (st.st_dev, st.st_ino)
        if inode == self._inode:
            return
        self.close()
        try:
            with open(self.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError):  # vanished or empty meanwhile: look again next time
            return
        self._inode = inode  # a file that is not a filter is reported once
        magic, slots, probes, _ = _HEADER.unpack_from(mapped, 0)
        if magic != _MAGIC or len(mapped) != _HEADER_BYTES + 2 * slots:
            logger.warning("store key filter %s is not one (magic %r, %d bytes); asking the store about every "
                           "candidate page", self.path, magic, len(mapped))
            mapped.close()
            return
        self._map = mapped


def _probes(keys: Sequence[bytes], slots: int, probes: int) -> np.ndarray:
    """The slots of each key, [len(keys) * probes], key by key."""
    halves = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), -1)
    h1, h2 = halves[:, 0], halves[:, 1] | np.uint64(1)
    steps = np.arange(probes, dtype=np.uint64)
    return ((h1[:, None] + steps[None, :] * h2[:, None]) & np.uint64(slots - 1)).reshape(-1)
