"""The host store interface every backend implements (see the package docstring for the
call order) and the checks shared by all backends."""

from __future__ import annotations

import abc
import enum
import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from kvlifecycle.hashing import TokenIds, tokens_as_int64

logger = logging.getLogger(__name__)

__all__ = ["Status", "HostStoreClient", "Located", "PageSelection", "select_pages"]

DEFAULT_WAIT_TIMEOUT_S = 20.0


class Status(str, enum.Enum):
    """Outcome of a store task (the statuses of FlexKV's ``KVResponse``)."""

    SUCCESS = "SUCCESS"      # every page of the task was copied
    NOTFOUND = "NOTFOUND"    # a get asked for a page the store does not hold; nothing copied
    UNREADY = "UNREADY"      # still queued or copying (try_wait only)
    TIMEOUT = "TIMEOUT"      # wait's deadline passed first; the task is still in flight
    CANCELLED = "CANCELLED"  # cancelled before its copy started
    FAILED = "FAILED"        # the store is down, lost the task, or the copy failed

    @property
    def done(self) -> bool:
        return self not in (Status.UNREADY, Status.TIMEOUT)


class HostStoreClient(abc.ABC):
    """A process's handle on the host KV store. See ``kvlifecycle.store`` for the call order.

    Ordering guarantee: the tasks one client submits are copied in submission order (FIFO per
    client), so a get submitted after a put of the same pages by the same client sees that
    put. Tasks of different clients are not ordered with respect to each other. A task reports
    ``SUCCESS`` only after its last byte is in place (device pool for gets, host store for puts).
    ``wait``/``try_wait`` return each task's status once it is done and then forget the task.
    """

    page_size: int
    # The store's shared DRAM slab (``slab.SharedSlab.handle()``), learnt at ``register_pool``:
    # its readers copy host hits themselves (``locate``). None: the store copies them (get_prefix).
    slab: dict[str, Any] | None = None

    def locate(self, key_lists: Sequence[Sequence[bytes]], pin_s: float) -> "Located | None":
        """Where each request's held pages sit in the shared slab (its held prefix of
        ``key_lists[i]``), pinned for ``pin_s``; None when the store cannot say (unreachable, or
        no shared slab): the caller computes those pages."""
        return None

    @abc.abstractmethod
    def register_pool(self, handle: dict[str, Any]) -> bool:
        """Tell the store which device page pool (``PagePool.handle()``) this client's slots
        refer to; later puts/gets copy to/from that pool, whatever other clients registered.
        Returns False when the store cannot be reached or refuses the pool (it is sent again
        on reconnect)."""

    @abc.abstractmethod
    def put_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds | None = None) -> int:
        """Copy the KV (all layers, K and V) of the whole pages selected by ``token_mask``
        (all full pages when None) from their pool slots into the store. ``slot_mapping`` has
        one slot per selected token (or per token when ``token_mask`` is None)."""

    @abc.abstractmethod
    def get_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds) -> int:
        """Copy the whole pages selected by ``token_mask`` from the store into the pool slots
        ``slot_mapping`` (one per selected token). NOTFOUND if any selected page is missing."""

    @abc.abstractmethod
    def get_prefix_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                         first_page: int) -> tuple[int | None, int]:
        """A lookup and an onboard in one: ``held``, the longest prefix of whole pages of
        ``token_ids`` the store holds, and the task copying pages ``first_page .. held - 1`` of
        it into their slots (None when there are none to copy). ``slot_mapping`` has one slot
        per token of every full page from ``first_page`` on; only the held ones are written.
        Returns ``(task_id | None, held)``; ``(None, 0)`` when the store is unreachable.

        The caller reserves pages for every candidate before it knows how many the store holds,
        and recomputes the rest; the store answers both in one round trip."""

    def may_hold(self, keys: Sequence[bytes]) -> int:
        """How many of the page ``keys``, from the first, the store may hold, read without a
        round trip: never fewer than it holds, so a page beyond the answer is not worth asking
        for. This default, for a store that publishes nothing to read, says all of them."""
        return len(keys)

    @abc.abstractmethod
    def wait(self, task_ids: Sequence[int], timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> dict[int, Status]:
        """Block until every task is done or ``timeout_s`` passed; unfinished ones are TIMEOUT
        (still in flight: wait again or cancel)."""

    @abc.abstractmethod
    def try_wait(self, task_ids: Sequence[int], wait_s: float = 0.0) -> dict[int, Status]:
        """Like ``wait``, but returns as soon as one task is done, or after ``wait_s`` (at once
        by default; a backend may return earlier): unfinished tasks are UNREADY. A caller with
        several copies in flight settles each as it ends."""

    @abc.abstractmethod
    def cancel(self, task_ids: Sequence[int]) -> None:
        """Cancel tasks whose copy has not started (they report CANCELLED); best effort."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters of this client (errors, timeouts, reconnects) and of its backend."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets and threads; idempotent. In-flight tasks are abandoned."""

    def __enter__(self) -> "HostStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class Located:
    """A ``locate`` reply: the slab to map, and per request the rows of its held prefix and
    their versions (``slab.SharedSlab.unchanged`` checks them after the copy)."""

    slab: dict[str, Any]
    rows: list[np.ndarray]
    versions: list[np.ndarray]


@dataclass(frozen=True)
class PageSelection:
    """Which pages of a token sequence a put/get touches, and where they live in the pool."""

    tokens: np.ndarray       # int64 [num_full_pages * page_size]: the prefix that keys them
    seq_pages: np.ndarray    # int64 [n]: page indices within the sequence, ascending
    pool_pages: np.ndarray   # int64 [n]: page ids in the device pool, same order


def select_pages(token_ids: TokenIds, slot_mapping: TokenIds, token_mask: TokenIds | None,
                 page_size: int, caller: str) -> PageSelection:
    """Turn a FlexKV-style (tokens, slot_mapping, token_mask) into whole pages.

    Raises ValueError (naming the argument and the fix) for a mask that cuts a page, a slot
    mapping of the wrong length, or slots that are not one whole pool page per sequence page.
    """
    tokens = tokens_as_int64(token_ids)
    slots = tokens_as_int64(slot_mapping)
    num_full = tokens.size // page_size
    if token_mask is None:
        mask = np.zeros(tokens.size, dtype=bool)
        mask[: num_full * page_size] = True
        if slots.size == tokens.size:
            slots = slots[: num_full * page_size]
        elif slots.size != num_full * page_size:
            raise ValueError(
                f"{caller}: slot_mapping has {slots.size} entries; expected one per token "
                f"({tokens.size}) or per token of a full page ({num_full * page_size})")
    else:
        mask = _as_bool_mask(token_mask, tokens.size, caller)
        if slots.size != int(mask.sum()):
            raise ValueError(
                f"{caller}: slot_mapping has {slots.size} entries; expected one per True entry "
                f"of token_mask ({int(mask.sum())})")
    if mask[num_full * page_size:].any():
        raise ValueError(
            f"{caller}: token_mask selects tokens of the partial last page (tokens "
            f"{num_full * page_size}..{tokens.size - 1}); only full pages are stored")
    per_page = mask[: num_full * page_size].reshape(num_full, page_size)  # [pages, S]
    whole = per_page.all(axis=1)
    if (per_page.any(axis=1) != whole).any():
        bad = int(np.flatnonzero(per_page.any(axis=1) != whole)[0])
        raise ValueError(
            f"{caller}: token_mask selects part of page {bad} (tokens {bad * page_size}.."
            f"{(bad + 1) * page_size - 1}); select whole pages")
    seq_pages = np.flatnonzero(whole).astype(np.int64)
    by_page = slots.reshape(-1, page_size)  # [n, S]
    first = by_page[:, 0]
    expected = first[:, None] + np.arange(page_size, dtype=np.int64)[None, :]
    if (first % page_size != 0).any() or (by_page != expected).any() or (first < 0).any():
        raise ValueError(
            f"{caller}: slot_mapping must give each selected page one whole pool page "
            f"(slots page_id * {page_size} + 0..{page_size - 1}, in order); "
            "build it with kvlifecycle.pool.slots_for_pages")
    return PageSelection(tokens=tokens[: num_full * page_size], seq_pages=seq_pages,
                         pool_pages=first // page_size)


def _as_bool_mask(token_mask: TokenIds, size: int, caller: str) -> np.ndarray:
    if isinstance(token_mask, torch.Tensor):
        mask = token_mask.detach().cpu().numpy()
    else:
        mask = np.asarray(token_mask)
    if mask.shape != (size,):
        raise ValueError(f"{caller}: token_mask has shape {mask.shape}; expected ({size},) like token_ids")
    return mask.astype(bool, copy=False)
