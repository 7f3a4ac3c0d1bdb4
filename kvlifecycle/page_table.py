"""The page table: the state of every page of the device pool (like vLLM's ``block_pool.py``).

Every page is in exactly one state:

- FREE: on the free list; nobody may read or write it.
- LEASED: owned by one lease (``kvlifecycle.leases``), which writes it. Invisible to lookups.
- COMMITTED: visible under its chain key (``kvlifecycle.hashing``). ``refs`` counts holders:
  one per lease reading it as cached prefix, plus one offload pin while an offload to the host
  store reads it (a pin is a ref with a deadline, so a crashed offloader cannot leak pages).
  A committed page with ``refs == 0`` is on the LRU list, oldest first, and may be evicted
  (returned to FREE and handed out again).

Pages are taken from the free list first, then by evicting from the LRU. This class knows
pages, keys, refs, the LRU, the free list and the offload pins; it knows nothing of requests.
It has no lock: ``LeaseTable`` owns the one lock and calls every method with it held.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Committed", "OffloadItem", "PageState", "PageTable", "PoolExhausted"]


class PoolExhausted(RuntimeError):
    """No pages can be freed for a request right now (everything else is pinned or leased)."""


class PageState(enum.IntEnum):
    FREE = 0
    LEASED = 1
    COMMITTED = 2


@dataclass(frozen=True)
class OffloadItem:
    """A committed page the host store does not have yet: the offloader puts the tokens
    ``[prefix_len - page_size, prefix_len)`` of the request from slot range of ``page_id``,
    then calls ``offload_done([page_id], ok)``."""

    page_id: int
    prefix_len: int
    key: bytes

    def to_json(self) -> dict:
        return {"page_id": self.page_id, "prefix_len": self.prefix_len, "key": self.key.hex()}

    @classmethod
    def from_json(cls, data: dict) -> "OffloadItem":
        return cls(int(data["page_id"]), int(data["prefix_len"]), bytes.fromhex(data["key"]))


@dataclass(frozen=True)
class Committed:
    """One committed lease: the namespace its keys were made in (fixed at lookup, carried by the
    lease) and its pages to offload, pinned until ``offload_done``. ``items`` is empty for a
    lease that was unknown (expired or aborted) or had no new full page."""

    lease_id: int
    namespace: str
    items: tuple[OffloadItem, ...]

    def to_json(self) -> dict:
        return {"lease_id": self.lease_id, "namespace": self.namespace,
                "items": [item.to_json() for item in self.items]}

    @classmethod
    def from_json(cls, data: dict) -> "Committed":
        return cls(int(data["lease_id"]), str(data["namespace"]),
                   tuple(OffloadItem.from_json(item) for item in data["items"]))


class PageTable:
    """See the module docstring. ``owner`` arguments are lease ids (never 0)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        assert num_pages > 0 and page_size > 0, (
            f"PageTable: expected positive sizes, got num_pages={num_pages} page_size={page_size}"
        )
        self.num_pages = num_pages
        self.page_size = page_size
        self._state = [PageState.FREE] * num_pages
        self._refs = [0] * num_pages
        self._owner = [0] * num_pages  # lease id of a LEASED page, 0 otherwise
        self._in_host = [False] * num_pages  # committed page known to be in the host tier
        self._free: deque[int] = deque(range(num_pages))
        self._committed: dict[bytes, int] = {}
        self._page_key: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # committed, refs == 0; oldest first
        self._offload_deadline: dict[int, float] = {}  # page -> expiry of its offload pin

    # -- counts ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    @property
    def num_evictable(self) -> int:
        return len(self._lru)

    @property
    def num_offload_pinned(self) -> int:
        return len(self._offload_deadline)

    def num_pinned(self) -> int:
        """Committed pages with refs > 0 (read by a lease or being offloaded). O(1): a committed
        page is in the LRU exactly when its refs are 0 (``check_invariants``), so the metrics
        snapshot never walks the pool under the table lock."""
        return len(self._committed) - len(self._lru)

    def in_host(self, page: int) -> bool:
        """Whether a committed page is known to be in the host tier (then it needs no offload)."""
        return self._in_host[page]

    def num_available(self, keep: set[int]) -> int:
        """Pages ``take`` can hand out without evicting any page of ``keep``."""
        return len(self._free) + len(self._lru) - sum(1 for p in keep if p in self._lru)

    # -- lookups --------------------------------------------------------------------------

    def match(self, keys: Sequence[bytes]) -> list[int]:
        """The committed pages of the longest prefix of ``keys`` (walks until the first miss)."""
        pages: list[int] = []
        for key in keys:
            page = self._committed.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    # -- FREE <-> LEASED -> COMMITTED -----------------------------------------------------

    def take(self, owner: int, n: int, keep: set[int]) -> tuple[list[int], int]:
        """Lease ``n`` pages to ``owner``: free pages first, then the oldest evictable pages not
        in ``keep``. Returns the pages and how many were evicted. The caller checked
        ``num_available(keep) >= n``."""
        pages: list[int] = []
        evicted = 0
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                self._evict(next(p for p in self._lru if p not in keep))
                evicted += 1
                page = self._free.pop()
            assert self._state[page] == PageState.FREE and self._refs[page] == 0, (
                f"take: page {page} expected FREE with refs 0, got {self._state[page].name} "
                f"refs {self._refs[page]}"
            )
            self._state[page] = PageState.LEASED
            self._owner[page] = owner
            pages.append(page)
        return pages, evicted

    def free(self, page: int, owner: int) -> None:
        """Return a page leased to ``owner`` to the free list."""
        self._assert_owned(page, owner, "free")
        assert self._refs[page] == 0, f"free: page {page} expected refs 0, got {self._refs[page]}"
        self._state[page] = PageState.FREE
        self._owner[page] = 0
        self._free.append(page)

    def transfer(self, page: int, owner: int, new_owner: int) -> None:
        """Hand a leased page to another lease (a quarantine lease) without freeing it."""
        self._assert_owned(page, owner, "transfer")
        self._owner[page] = new_owner

    def commit(self, page: int, owner: int, key: bytes, in_host: bool) -> int:
        """Publish a page leased to ``owner`` under ``key``; returns the page now under ``key``.
        When another lease committed ``key`` meanwhile, that page stays and ours is freed."""
        self._assert_owned(page, owner, "commit")
        existing = self._committed.get(key)
        if existing is not None:
            self.free(page, owner)
            return existing
        self._state[page] = PageState.COMMITTED
        self._owner[page] = 0
        self._committed[key] = page
        self._page_key[page] = key
        self._in_host[page] = in_host
        return page

    # -- refs, LRU, offload pins ----------------------------------------------------------

    def pin(self, page: int) -> None:
        self.pin_many((page,))

    def unpin(self, page: int) -> None:
        self.unpin_many((page,))

    def pin_many(self, pages: Iterable[int]) -> None:
        """Take a ref on each committed page (a lease reads it, or an offload copies it): a page
        with refs > 0 is never evicted. One loop for a request's pages (it runs per page on every
        request)."""
        refs, lru, state = self._refs, self._lru, self._state
        for page in pages:
            assert state[page] == PageState.COMMITTED, f"pin: expected a committed page, page {page} is {state[page].name}"
            refs[page] += 1
            lru.pop(page, None)

    def unpin_many(self, pages: Iterable[int]) -> None:
        refs, lru = self._refs, self._lru
        for page in pages:
            assert refs[page] > 0, f"unpin: expected refs > 0 on page {page}, got {refs[page]}"
            refs[page] -= 1
            if refs[page] == 0:
                lru[page] = None

    def unpin_and_touch(self, pinned: Iterable[int], used: Iterable[int]) -> None:
        """``unpin_many(pinned)`` then ``touch(used)``, where ``used`` holds every page of
        ``pinned`` (a commit: the lease's device pages, then its whole row): each page moves in
        the LRU once, by ``touch``, instead of once more by the unpin."""
        refs = self._refs
        for page in pinned:
            assert refs[page] > 0, f"unpin: expected refs > 0 on page {page}, got {refs[page]}"
            refs[page] -= 1
        self.touch(used)

    def touch(self, pages: Iterable[int]) -> None:
        """Mark unreferenced committed pages as used now, in order (the last is the most recent)."""
        refs, lru, state, committed = self._refs, self._lru, self._state, PageState.COMMITTED
        for page in pages:
            if refs[page] == 0 and state[page] == committed:
                lru.pop(page, None)
                lru[page] = None

    def pin_for_offload(self, page: int, deadline: float) -> None:
        self.pin(page)
        self._offload_deadline[page] = deadline

    def offload_pinned(self, pages: Iterable[int]) -> list[int]:
        """Those of ``pages`` that hold an offload pin."""
        return [p for p in pages if p in self._offload_deadline]

    def expired_offload_pins(self, now: float) -> list[int]:
        return [page for page, deadline in self._offload_deadline.items() if deadline <= now]

    def drop_offload_pins(self, pages: Sequence[int], ok: bool) -> None:
        """Unpin offload-pinned pages; ``ok`` records them as present in the host tier."""
        for page in pages:
            del self._offload_deadline[page]
            if ok:
                self._in_host[page] = True
            self.unpin(page)

    # -- checks ---------------------------------------------------------------------------

    def check_invariants(self, owners: dict[int, int], read_refs: Sequence[int]) -> None:
        """Assert every page's state agrees with the leases: ``owners`` maps each leased page to
        its lease, ``read_refs[page]`` counts the leases reading it (O(num_pages))."""
        free = list(self._free)
        free_set = set(free)
        assert len(free) == len(free_set), f"free list has duplicates: {sorted(free)}"
        expected_refs = list(read_refs)
        for page in self._offload_deadline:
            expected_refs[page] += 1
        for page in range(self.num_pages):
            state = self._state[page]
            if state == PageState.FREE:
                assert page in free_set, f"page {page}: expected on the free list (FREE)"
                assert self._refs[page] == 0 and page not in self._page_key, (
                    f"free page {page}: expected refs 0 and no key, got refs {self._refs[page]}"
                )
                assert page not in owners, f"free page {page} held by lease {owners.get(page)}"
            elif state == PageState.LEASED:
                assert owners.get(page) == self._owner[page], (
                    f"leased page {page}: expected owner {self._owner[page]}, got {owners.get(page)}"
                )
                assert self._refs[page] == 0 and page not in self._page_key, (
                    f"leased page {page}: expected refs 0 and no key"
                )
            else:
                key = self._page_key.get(page)
                assert key is not None and self._committed.get(key) == page, (
                    f"committed page {page}: key table disagrees ({key!r})"
                )
                assert page not in owners, f"committed page {page} leased to {owners[page]}"
            assert self._refs[page] == expected_refs[page], (
                f"page {page}: expected refs {expected_refs[page]} (leases + offload), got {self._refs[page]}"
            )
            in_lru = page in self._lru
            should = state == PageState.COMMITTED and self._refs[page] == 0
            assert in_lru == should, f"page {page}: expected in LRU={should}, got {in_lru}"
        assert len(free) + len(owners) + len(self._committed) == self.num_pages, (
            f"pages lost: free {len(free)} + leased {len(owners)} + committed "
            f"{len(self._committed)} != {self.num_pages}"
        )

    # -- helpers --------------------------------------------------------------------------

    def _evict(self, page: int) -> None:
        assert self._refs[page] == 0, f"evict: page {page} expected refs 0, got {self._refs[page]}"
        del self._lru[page]
        key = self._page_key.pop(page)
        del self._committed[key]
        self._in_host[page] = False
        self._state[page] = PageState.FREE
        self._free.append(page)

    def _assert_owned(self, page: int, owner: int, caller: str) -> None:
        assert self._state[page] == PageState.LEASED and self._owner[page] == owner, (
            f"{caller}: page {page} expected LEASED to lease {owner}, got "
            f"{self._state[page].name} owner {self._owner[page]}"
        )
