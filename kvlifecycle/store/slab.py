"""The local store's DRAM tier in shared memory, mapped by the processes that read its pages.

The store process creates it (``SharedSlab.create``): one anonymous memory file (``memfd``)
holding the page rows ``[capacity_pages, L, 2, S, H, D]`` and, after them, per row an int64
version, the 16-byte key of the page it holds and an int64 "last read" tick, then the index: an
open-addressing table (linear probing) of ``row + 1`` per slot, 0 for empty, homed by the key's
first 8 bytes. A process that onboards host hits (hstu_compute) maps the same memory through
``/proc/<store pid>/fd/<fd>`` (``SharedSlab.attach``), finds a request's pages in that index
itself (``find``: no round trip; ``locate`` asks the store, for what the index does not show)
and copies those rows into its page pool itself: the store copies nothing and nobody polls. A
memfd is bounded by the host's memory, not by the size of /dev/shm (64 MiB in a default
container), and it is freed when the last process that maps it exits: a store killed with
SIGKILL leaves nothing behind.

The store is the one writer, under its index lock; readers take no lock. Why a row a reader
copies holds the page it wanted:

- the store writes a page's bytes into a row, waits for the copy to end, and only then writes the
  row's key and indexes it (``publish``); before it writes another page into a row it first
  clears the row's key and un-indexes it (``withdraw``), then bumps the row's version (``bump``);
- ``find`` reads a row's version first, then checks that the row's key is the one wanted; the
  reader compares the version again after its copy ended (``unchanged``) and recomputes a page
  whose version moved. So a row read mid-write never passes: its key was cleared before the
  version it was read at, or its version moved before the check;
- ``locate`` (the store's answer, kept for pages the index does not show: pages only on disk
  after a restart) also pins each row it names for ``pin_s``, so the store evicts none of them
  meanwhile; ``find`` pins nothing: it stamps each row it found as read (``last read``), and the
  store's eviction passes over a row read since it last looked (a second chance), so a page in
  use is rarely the one evicted, and when it is, the version check says so.

A reader may miss a page the store holds (a probe that crossed a slot the store was moving);
that costs a ``locate`` or a recompute, never a wrong page. The order of the stores above is
what readers rely on: x86-64 keeps stores, and loads, in program order.

On a CUDA host both processes register the mapping with CUDA (``cudaHostRegister``), which maps
it into the device's address space too: the store's own copies write and read the rows there in
place, and the reader's onboard copies read them there (``copy_rows``). Where no memfd can be
made, ``create`` raises ``SlabUnavailable`` and the store keeps its DRAM tier private (the
reader's ``locate`` is then refused and host hits take the store's copy path).
"""

from __future__ import annotations

import logging
import os
import struct
import time
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["SharedSlab", "SlabUnavailable"]


class SlabUnavailable(OSError):
    """No shared memory file could be made; the store keeps a private DRAM tier instead."""


class SharedSlab:
    """Page rows, their versions, keys and index in one shared file. ``rows`` and ``versions``
    are views of the mapping; ``handle()`` is what a reader needs to ``attach``."""

    def __init__(self, path: str, capacity_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype,
                 pin: bool, fd: int | None = None) -> None:
        self.path = path
        self.capacity_pages = capacity_pages
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self._fd = fd  # the creator's memfd; readers map through the path
        layout = _Layout(capacity_pages, page_shape, dtype)
        flat = torch.from_file(path, shared=True, size=layout.total, dtype=torch.uint8)
        self.rows = flat[:layout.rows_bytes].view(dtype).view(capacity_pages, *page_shape)
        self.versions = layout.part(flat, "versions").view(torch.int64)
        # numpy views: reads and writes of a few rows cost microseconds
        self._versions = self.versions.numpy()
        self._keys = layout.part(flat, "keys").numpy().reshape(capacity_pages, KEY_BYTES)
        self._key_words = self._keys.view("<u8")  # [capacity_pages, 2]: compared a word at a time
        self._read_ticks = layout.part(flat, "read_ticks").numpy().view(np.int64)
        self._table = layout.part(flat, "table").numpy().view(np.int32)
        self._mask = layout.slots - 1
        self._registered = _cuda_register(flat) if pin else None
        self._flat = flat
        # The rows as the copies address them (the store's, `DramTier.copy_rows`, and the reader's): on a
        # CUDA host, the registered rows mapped into the device's address space (`PageCopier`'s kernels
        # read and write them in place), else the host view.
        self.copy_rows = self.rows
        if self._registered is not None:
            mapped = _device_view(flat[:layout.rows_bytes])
            if mapped is not None:
                self.copy_rows = mapped.view(dtype).view(capacity_pages, *page_shape)
        self._inode = os.stat(path).st_ino

    # -- public API ---------------------------------------------------------------------

    @classmethod
    def create(cls, capacity_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> "SharedSlab":
        """A zeroed slab (its memory committed now); ``SlabUnavailable`` when no memfd can be made."""
        total = _Layout(capacity_pages, page_shape, dtype).total
        try:
            fd = os.memfd_create("hstu-kv-dram-tier", 0)
        except (AttributeError, OSError) as e:  # not Linux, or the kernel refuses
            raise SlabUnavailable(f"no memfd for the DRAM tier: {e}") from e
        try:
            os.ftruncate(fd, total)
            slab = cls(f"/proc/{os.getpid()}/fd/{fd}", capacity_pages, page_shape, dtype, pin=pin, fd=fd)
            slab._flat.zero_()  # commit the memory now: the capacity is real, and copies never page-fault
        except BaseException:
            os.close(fd)
            raise
        logger.info("DRAM tier in shared memory %s (%d pages, %d bytes)", slab.path, capacity_pages, total)
        return slab

    @classmethod
    def attach(cls, handle: dict[str, Any], pin: bool) -> "SharedSlab":
        """Map the slab ``handle`` (a ``handle()``) describes; OSError when its file is gone."""
        return cls(str(handle["path"]), int(handle["capacity_pages"]), tuple(int(d) for d in handle["page_shape"]),
                   getattr(torch, str(handle["dtype"])), pin=pin)

    def handle(self) -> dict[str, Any]:
        return {"path": self.path, "capacity_pages": self.capacity_pages, "page_shape": list(self.page_shape),
                "dtype": str(self.dtype).removeprefix("torch.")}

    # The store's side (its index lock held): publish after a page's bytes are in place; withdraw,
    # then bump, before other bytes go into a row.

    def publish(self, keys: list[bytes], rows: list[int]) -> None:
        """``rows`` hold the pages of ``keys`` (their bytes in place): readers may find them now."""
        for key, row in zip(keys, rows):
            self._keys[row] = np.frombuffer(key, dtype=np.uint8)  # the key before the index points here
            slot = self._home(key)
            while self._table[slot]:
                slot = (slot + 1) & self._mask
            self._table[slot] = row + 1

    def withdraw(self, key: bytes, row: int) -> None:
        """``row`` no longer holds ``key``: out of the index, its key cleared."""
        slot = self._home(key)
        while self._table[slot] and self._table[slot] != row + 1:
            slot = (slot + 1) & self._mask
        if self._table[slot]:
            self._delete_slot(slot)
        self._keys[row] = 0

    def bump(self, rows: list[int]) -> None:
        """Before new bytes go into ``rows`` (withdrawn first, if they held a page)."""
        if rows:
            self._versions[rows] += 1

    def read_since(self, row: int, tick: int) -> int | None:
        """The row's last read tick if a reader stamped it after ``tick`` (``find``), else None."""
        last = int(self._read_ticks[row])
        return last if last > tick else None

    # The readers' side.

    def find(self, requests: list[list[bytes]]) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each request's keys, the rows of its leading pages the index shows, and their
        versions (read before the rows' keys were checked): ``locate``'s answer, without a round
        trip and without a pin. The rows found are stamped as read (the store's eviction passes
        over them once)."""
        wanted = [k for keys in requests for k in keys]
        # a usual host hit names a few pages: probed one by one in Python, a fraction of the
        # fixed cost of the numpy calls that probe many keys at once
        rows, versions = self._probe_each(wanted) if len(wanted) <= FEW_KEYS else self._probe_together(wanted)
        self._read_ticks[rows[rows >= 0]] = time.monotonic_ns()
        out, start = [], 0
        for request in requests:
            got = rows[start:start + len(request)]
            n = int(np.argmin(got)) if got.size and got.min() < 0 else got.size  # the leading pages found
            out.append((got[:n].copy(), versions[start:start + n].copy()))
            start += len(request)
        return out

    def current(self) -> bool:
        """Whether the store that made this slab still serves it: a stopped store's memory stays
        mapped (its pages are still right), but its successor indexes its own, so a reader asks it."""
        try:
            return os.stat(self.path).st_ino == self._inode
        except OSError:
            return False

    def versions_of(self, rows: np.ndarray) -> np.ndarray:
        return self._versions[rows].copy()

    def unchanged(self, rows: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """bool per row: still the version ``find`` or ``locate`` answered (read after the copy ended)."""
        return self._versions[rows] == versions

    def close(self) -> None:
        self.copy_rows = self.rows  # the device view is invalid once unregistered
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        if self._fd is not None:  # the memory lives on while a reader maps it
            os.close(self._fd)
            self._fd = None

    # -- helpers ------------------------------------------------------------------------

    def _probe_each(self, wanted: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """``find``'s row (-1: not shown) and version of each key, probing one key at a time.
        As ``_probe_together``: each version is read before its row's key is checked again."""
        table, words, mask = self._table, self._key_words, self._mask
        rows, key_words = [], [_KEY_WORDS.unpack(key) for key in wanted]
        for low, high in key_words:
            slot, row = low & mask, -1
            for _ in range(_MAX_PROBES):
                entry = int(table[slot])
                if entry == 0:
                    break
                if int(words[entry - 1, 0]) == low and int(words[entry - 1, 1]) == high:
                    row = entry - 1
                    break
                slot = (slot + 1) & mask
            rows.append(row)
        versions = [int(self._versions[row]) if row >= 0 else 0 for row in rows]
        for i, ((low, high), row) in enumerate(zip(key_words, rows)):  # the keys again, after the versions
            if row >= 0 and (int(words[row, 0]), int(words[row, 1])) != (low, high):
                rows[i] = -1
        return np.array(rows, dtype=np.int64), np.array(versions, dtype=np.int64)

    def _probe_together(self, wanted: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """``find``'s row (-1: not shown) and version of each key, one probe step of every key at
        a time, over the batch."""
        keys = np.frombuffer(b"".join(wanted), dtype="<u8").reshape(-1, 2)  # a key as two words
        rows = np.full(len(wanted), -1, dtype=np.int64)
        slots = keys[:, 0].astype(np.int64) & self._mask
        probing = np.arange(len(wanted))
        for _ in range(_MAX_PROBES):
            if probing.size == 0:
                break
            candidate = self._table[slots[probing]].astype(np.int64) - 1  # -1: an empty slot
            held = self._key_words[candidate]  # (an empty slot reads the last row: not taken)
            hit = (candidate >= 0) & (held[:, 0] == keys[probing, 0]) & (held[:, 1] == keys[probing, 1])
            rows[probing[hit]] = candidate[hit]
            probing = probing[(candidate >= 0) & ~hit]  # past another key's slot: the next one
            slots[probing] = (slots[probing] + 1) & self._mask
        found = np.flatnonzero(rows >= 0)
        versions = np.zeros(len(wanted), dtype=np.int64)
        versions[found] = self._versions[rows[found]]
        # the keys again, after the versions: a row withdrawn before that version no longer has it
        held = self._key_words[rows[found]]
        gone = found[(held[:, 0] != keys[found, 0]) | (held[:, 1] != keys[found, 1])]
        rows[gone] = -1
        return rows, versions

    def _home(self, key: bytes) -> int:
        return int.from_bytes(key[:8], "little") & self._mask

    def _delete_slot(self, hole: int) -> None:
        """Empty ``hole`` and move back each later entry of its run whose home slot allows it
        (deletion without tombstones: every entry stays reachable from its home)."""
        slot = hole
        while True:
            slot = (slot + 1) & self._mask
            entry = int(self._table[slot])
            if entry == 0:
                break
            home = self._home(self._keys[entry - 1].tobytes())
            if (slot - home) & self._mask >= (slot - hole) & self._mask:  # home at or before the hole
                self._table[hole] = entry
                self._table[slot] = 0
                hole = slot
        self._table[hole] = 0


KEY_BYTES = 16  # a page key (kvlifecycle.hashing: 16 bytes of BLAKE2b, uniformly spread)
_MAX_PROBES = 64  # a longer run is a miss (at a load of at most one half, runs stay short)
_KEY_WORDS = struct.Struct("<QQ")  # a key as two words: the first homes it
# A find of at most this many keys probes them one by one: numpy's fixed cost per call made a
# 2-page find about 0.08 ms on an H100 host; on the CPU machine one by one took 9 / 16 / 45 us at
# 2 / 8 / 32 keys against 27 / 27 / 29 us together.
FEW_KEYS = 16
_ALIGN = 64  # bytes: each part starts on a cache line


class _Layout:
    """Byte offsets of the file's parts: rows, then versions, keys, read ticks and the index."""

    def __init__(self, capacity_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.rows_bytes = capacity_pages * int(np.prod(page_shape)) * torch.empty((), dtype=dtype).element_size()
        self.slots = 1 << max(3, (2 * capacity_pages - 1).bit_length())  # at least twice the rows
        sizes = {"versions": 8 * capacity_pages, "keys": KEY_BYTES * capacity_pages,
                 "read_ticks": 8 * capacity_pages, "table": 4 * self.slots}
        self._offsets, offset = {}, _align(self.rows_bytes)
        for name, size in sizes.items():
            self._offsets[name] = (offset, size)
            offset = _align(offset + size)
        self.total = offset

    def part(self, flat: torch.Tensor, name: str) -> torch.Tensor:
        offset, size = self._offsets[name]
        return flat[offset:offset + size]


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


_REGISTER_PORTABLE, _REGISTER_MAPPED = 1, 2  # cudaHostRegister flags: pinned for every device, and mapped


def _cuda_register(flat: torch.Tensor) -> int | None:
    """Page-lock the mapping for CUDA copies; its address, or None where it could not be (logged:
    copies then run at pageable speed)."""
    if not torch.cuda.is_available():
        return None
    ptr = flat.data_ptr()
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, flat.numel(), _REGISTER_PORTABLE | _REGISTER_MAPPED))
    except Exception as e:  # a torch build without the binding
        err = repr(e)
    if err != 0:
        logger.warning("cudaHostRegister of the shared DRAM slab failed (%s); its copies run unpinned", err)
        return None
    return ptr


def _device_view(flat: torch.Tensor) -> torch.Tensor | None:
    """``flat`` (host memory registered mapped) as a CUDA tensor at the same address: with unified
    addressing a registered mapping has one address on the host and on the device. None (logged:
    copies then stage through a device buffer) where torch does not take it."""

    class _Mapped:  # torch builds CUDA tensors from this interface, keeping the object alive
        __cuda_array_interface__ = {"shape": (flat.numel(),), "typestr": "|u1", "data": (flat.data_ptr(), False),
                                    "strides": None, "version": 3}

    try:
        return torch.as_tensor(_Mapped(), device="cuda")
    except Exception as e:  # not mapped into this device's address space
        logger.warning("the shared DRAM slab is not addressable from the device (%s); its copies stage "
                       "through device memory", e)
        return None
