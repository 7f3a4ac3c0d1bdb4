"""The local store's DRAM tier in shared memory, mapped by the processes that read its pages.

The store process creates it (``SharedSlab.create``): one anonymous memory file (``memfd``)
holding the page rows ``[capacity_pages, L, 2, S, H, D]`` and, after them, one int64 version per
row. A process that onboards host hits (hstu_compute) maps the same memory through
``/proc/<store pid>/fd/<fd>`` (``SharedSlab.attach``), asks the store where a request's pages are
(``locate``: one round trip for a batch) and copies those rows into its page pool itself: the
store copies nothing and nobody polls. A memfd is bounded by the host's memory, not by the size of
/dev/shm (64 MiB in a default container), and it is freed when the last process that maps it
exits: a store killed with SIGKILL leaves nothing behind.

Why a row the reader copies holds the page ``locate`` named:

- ``locate`` pins each row it names for ``pin_s``: the store evicts no pinned row;
- before the store writes another page into a row it bumps the row's version (``bump``), and
  ``locate`` answers each row's version; the reader compares them after its copy ended
  (``unchanged``) and recomputes a page whose version moved. So even a reader that copies after
  its pin expired never reads a page other than the one named.

On a CUDA host both processes register the mapping with CUDA (``cudaHostRegister``), so the
store's offload copies and the reader's onboard copies run at pinned speed. Where no memfd can be
made, ``create`` raises ``SlabUnavailable`` and the store keeps its DRAM tier private (the reader's
``locate`` is then refused and host hits take the store's copy path).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["SharedSlab", "SlabUnavailable"]

_VERSIONS_ALIGN = 64  # bytes: the versions start on a cache line after the rows


class SlabUnavailable(OSError):
    """No shared memory file could be made; the store keeps a private DRAM tier instead."""


class SharedSlab:
    """Page rows and their versions in one shared file. ``rows`` and ``versions`` are views of
    the mapping; ``handle()`` is what a reader needs to ``attach``."""

    def __init__(self, path: str, capacity_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype,
                 pin: bool, fd: int | None = None) -> None:
        self.path = path
        self.capacity_pages = capacity_pages
        self.page_shape = tuple(page_shape)
        self.dtype = dtype
        self._fd = fd  # the creator's memfd; readers map through the path
        rows_bytes, total = _layout(capacity_pages, page_shape, dtype)
        flat = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        self.rows = flat[:rows_bytes].view(dtype).view(capacity_pages, *page_shape)
        self.versions = flat[_align(rows_bytes):_align(rows_bytes) + 8 * capacity_pages].view(torch.int64)
        self._versions = self.versions.numpy()  # numpy: reads and bumps of a few rows cost microseconds
        self._registered = _cuda_register(flat) if pin else None
        self._flat = flat

    # -- public API ---------------------------------------------------------------------

    @classmethod
    def create(cls, capacity_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> "SharedSlab":
        """A zeroed slab (its memory committed now); ``SlabUnavailable`` when no memfd can be made."""
        _rows_bytes, total = _layout(capacity_pages, page_shape, dtype)
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

    def bump(self, rows: list[int]) -> None:
        """Before new bytes go into ``rows`` (the store, under its index lock)."""
        if rows:
            self._versions[rows] += 1

    def versions_of(self, rows: np.ndarray) -> np.ndarray:
        return self._versions[rows].copy()

    def unchanged(self, rows: np.ndarray, versions: np.ndarray) -> np.ndarray:
        """bool per row: still the version ``locate`` answered (read after the copy ended)."""
        return self._versions[rows] == versions

    def close(self) -> None:
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        if self._fd is not None:  # the memory lives on while a reader maps it
            os.close(self._fd)
            self._fd = None


def _align(n: int) -> int:
    return -(-n // _VERSIONS_ALIGN) * _VERSIONS_ALIGN


def _layout(capacity_pages: int, page_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
    """(bytes of the rows, bytes of the file)."""
    rows_bytes = capacity_pages * int(np.prod(page_shape)) * torch.empty((), dtype=dtype).element_size()
    return rows_bytes, _align(rows_bytes) + 8 * capacity_pages


def _cuda_register(flat: torch.Tensor) -> int | None:
    """Page-lock the mapping for CUDA copies; its address, or None where it could not be (logged:
    copies then run at pageable speed)."""
    if not torch.cuda.is_available():
        return None
    ptr = flat.data_ptr()
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, flat.numel(), 0))
    except Exception as e:  # a torch build without the binding
        err = repr(e)
    if err != 0:
        logger.warning("cudaHostRegister of the shared DRAM slab failed (%s); its copies run unpinned", err)
        return None
    return ptr
