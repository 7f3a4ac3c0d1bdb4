"""Batched page copies between the device page pool and host page tensors.

Pool: ``[num_layers, num_pages, 2, page_size, num_heads, head_dim]``. Host pages are stored
page-major, ``[n, num_layers, 2, page_size, num_heads, head_dim]``, so one page is one
contiguous run of bytes (a disk file, a Mooncake value).

Every call moves all requested pages at once (``index_select`` / ``index_copy_``), never a
Python loop per page. On CUDA the copies run on the copier's own stream and the call returns
after that stream's event completed (``scatter(..., wait=False)``: queued on the caller's own
stream instead, and returned at once). Host rows come in one of two forms:

- a CUDA tensor over host memory registered and mapped into the device's address space (the
  shared slab's ``copy_rows``, which hstu_compute's reader and the store's own copies address):
  the device reads or writes the rows in place, one copy of the row and page ids and two indexed
  kernels whatever the rows' order, with no staging buffer;
- a host tensor, which should be pinned: the pages are staged in device memory and moved by one
  ``copy_`` per run of consecutive host rows (usually one).

On the CPU a page of one layer is copied as one row of 64-bit words (``_word_rows``), straight
between the pool and the host rows, one indexed copy per layer and run of host rows: torch's
CPU index copies of bfloat16 elements ran 2-6x slower than of int64 words, and staging the
pages first allocated (and page-faulted) a buffer of their size per call.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["PageCopier", "host_page_shape"]


def host_page_shape(pool_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[num_layers, 2, page_size, num_heads, head_dim] of one page in host memory."""
    num_layers, _num_pages, two, page_size, num_heads, head_dim = pool_shape
    return (num_layers, two, page_size, num_heads, head_dim)


class PageCopier:
    """Copies pages between one pool tensor and host page tensors. Not thread-safe: one
    copier per copying thread. Calls are synchronous and ordered: when a call returns, its
    bytes are in place (``scatter`` can return earlier: see there)."""

    def __init__(self, pool: torch.Tensor) -> None:
        assert pool.dim() == 6 and pool.shape[2] == 2, (
            f"PageCopier: expected a pool [L, P, 2, S, H, D], got shape {tuple(pool.shape)}")
        self.pool = pool
        self.page_shape = host_page_shape(tuple(pool.shape))
        self._cuda = pool.is_cuda
        self._stream = torch.cuda.Stream(device=pool.device) if self._cuda else None
        self._pool_words = _word_rows(pool)  # [L, P, W]: each page of each layer one row of words

    # -- public API ---------------------------------------------------------------------

    def gather(self, pool_pages: np.ndarray, out: torch.Tensor, rows: np.ndarray) -> None:
        """Offload: ``out[rows[i]] = pool[:, pool_pages[i]]`` for every i."""
        if len(pool_pages) == 0:
            return
        pages = _pages_tensor(pool_pages)
        if not self._cuda:
            pool_words, out_words = self._pool_words, _word_rows(out)  # [L, P, W], [N, L, W]
            for start, row, length in _runs(rows):
                run = pages[start:start + length]
                for layer in range(pool_words.shape[0]):  # into the host rows themselves, no staging
                    torch.index_select(pool_words[layer], 0, run, out=out_words[row:row + length, layer])
            return
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            if out.is_cuda:  # mapped host rows: the device writes them in place
                dev_rows, dev_pages = self._ids_on_device(rows, pages)
                _word_rows(out).index_copy_(0, dev_rows, self._pool_words.index_select(1, dev_pages).transpose(0, 1))
            else:
                dev_pages = pages.to(self.pool.device, non_blocking=True)
                staged = self.pool.index_select(1, dev_pages).transpose(0, 1).contiguous()  # [n, L, 2, S, H, D]
                for start, row, length in _runs(rows):
                    out[row:row + length].copy_(staged[start:start + length], non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def scatter(self, src: torch.Tensor, rows: np.ndarray, pool_pages: np.ndarray,
                wait: bool = True) -> "torch.cuda.Event | None":
        """Onboard: ``pool[:, pool_pages[i]] = src[rows[i]]`` for every i.

        ``wait=False`` on CUDA queues the copy on the calling thread's current stream and returns
        an event recorded right after it: the work the caller queues next on that stream (a
        forward) reads the pages, and the event's ``synchronize()`` waits for the copy alone on the
        host (``src`` must stay mapped until then). No stream of its own: the reader's forward
        waits for the copy anyway. Otherwise the pages are in place on return, and None is
        returned."""
        if len(pool_pages) == 0:
            return None
        pages = _pages_tensor(pool_pages)
        if not self._cuda:
            pool_words, src_words = self._pool_words, _word_rows(src)  # [L, P, W], [N, L, W]
            for start, row, length in _runs(rows):
                run = pages[start:start + length]
                for layer in range(pool_words.shape[0]):
                    pool_words[layer].index_copy_(0, run, src_words[row:row + length, layer])
            return None
        if not wait:
            self._scatter_cuda(src, rows, pages)
            copied = torch.cuda.Event()
            copied.record(torch.cuda.current_stream(self.pool.device))
            return copied
        assert self._stream is not None
        with torch.cuda.stream(self._stream):
            self._scatter_cuda(src, rows, pages)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
        return None

    def _scatter_cuda(self, src: torch.Tensor, rows: np.ndarray, pages: torch.Tensor) -> None:
        """``scatter``'s copies, queued on the current stream. The ids and ``staged`` are freed on
        it: the allocator reuses their blocks only for work queued on it later, so returning
        before the copy ends is safe."""
        if src.is_cuda:  # mapped host rows: the device reads them in place
            dev_rows, dev_pages = self._ids_on_device(rows, pages)
            self._pool_words.index_copy_(1, dev_pages, _word_rows(src).index_select(0, dev_rows).transpose(0, 1))
            return
        staged = torch.empty((len(rows), *self.page_shape), dtype=self.pool.dtype, device=self.pool.device)
        for start, row, length in _runs(rows):
            staged[start:start + length].copy_(src[row:row + length], non_blocking=True)
        dev_pages = pages.to(self.pool.device, non_blocking=True)
        self.pool.index_copy_(1, dev_pages, staged.transpose(0, 1))

    def _ids_on_device(self, rows: np.ndarray, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The host rows and pool pages as device tensors, in one host-to-device copy."""
        ids = torch.cat([torch.from_numpy(np.asarray(rows, dtype=np.int64)), pages]).to(self.pool.device,
                                                                                       non_blocking=True)
        return ids[:len(rows)], ids[len(rows):]


# ---------------------------------------------------------------------------------------
# helpers


def _pages_tensor(pool_pages: np.ndarray) -> torch.Tensor:
    """int64 CPU tensor of the pool pages, copied (RPC frames are read-only)."""
    return torch.from_numpy(np.array(pool_pages, dtype=np.int64))


def _word_rows(pages: torch.Tensor) -> torch.Tensor:
    """``pages`` (the pool ``[L, P, 2, S, H, D]`` or host rows ``[N, L, 2, S, H, D]``, contiguous)
    as ``[dim0, dim1, W]``: each page of each layer one row of the widest integer words that
    tile its bytes (a copy moves bytes; the element type only sets how fast torch moves them)."""
    row_bytes = pages[0, 0].numel() * pages.element_size()
    word = next(dtype for dtype, size in _WORDS if row_bytes % size == 0)
    return pages.view(pages.shape[0], pages.shape[1], -1).view(word)  # view: raises when not contiguous


_WORDS = ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2), (torch.uint8, 1))


def _runs(rows: np.ndarray) -> list[tuple[int, int, int]]:
    """(index into rows, first row, length) for each run of consecutive rows. A Python loop: a
    host hit's few rows cost a fraction of numpy's calls (tens of microseconds a copy on an H100
    host); an offload's hundreds cost about as much, next to a copy of milliseconds."""
    values = np.asarray(rows, dtype=np.int64).tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((start, values[start], i - start))
            start = i
    return runs
