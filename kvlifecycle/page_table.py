"""The page table: who holds each page of the device pool. The one place counts change.

Every page of the pool is in exactly one state:

- FREE: on the free list; nobody may read or write it.
- LEASED: owned by one lease (a request between ``reserve`` and ``commit``/``abort``/expiry);
  the request writes it (onboarding from the host store, or compute). Invisible to lookups.
- COMMITTED: visible under its chain key (``kvlifecycle.hashing``). ``refs`` counts holders:
  one per lease reading it as cached prefix, plus one while an offload to the host store
  reads it. A committed page with ``refs == 0`` is on the LRU list and may be evicted
  (returned to FREE and handed out again).

Operations, in the order a request calls them (invariant 3 of docs/ARCHITECTURE.md):

Every step takes a batch of requests under one lock acquisition.

1. ``match_prefixes(key_chains)``: for each chain, the committed pages of the longest prefix of
   its keys (no state change).
2. ``reserve_many(asks) -> [Allocation | PoolExhausted]``: for each request, pins the device
   prefix (refs + 1) and takes pages for the host-hit pages and every new token (free list
   first, then LRU eviction, oldest first). A request that does not fit gets its
   ``PoolExhausted`` in its place and changes nothing. The lease keeps what the request's
   lookup fixed: its namespace, page keys and token ids (nothing later re-hashes).
3. optional ``begin_onboard`` / ``finish_onboard(ok_pages)``: while an onboard is in flight the
   lease neither expires nor is released by ``abort`` (the abort is deferred to
   ``finish_onboard``), so the store never writes into a page someone else owns.
   Onboard pages beyond ``ok_pages`` become pages to compute.
4. ``commit_many(lease_ids) -> [Committed | None]``: each lease's full pages become COMMITTED
   under their keys (a key committed meanwhile keeps the existing page; ours is freed), the
   partial last page is freed, read pins are dropped. Pages not known to be in the host tier
   are pinned for offload; each ``Committed`` carries them with the lease's namespace.
   Or ``abort(lease_id)`` / ``expire(now)``: every page of the lease returns.
5. ``offload_done(page_ids, ok)``: drops the offload pins. Offload pins also expire (a crashed
   offloader must not leak pages); a late ``offload_done`` for them is ignored.

Promises: a page is handed out only after asserting nobody holds it; a page with refs > 0
is never evicted; a failed call changes nothing. Thread-safe: one lock around every public
method; no method blocks on I/O.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "Allocation",
    "Committed",
    "Lease",
    "OffloadItem",
    "PageState",
    "PageTable",
    "PoolExhausted",
    "ReserveAsk",
]


COUNTERS = (  # always present in stats(), so dashboards see zeros
    "lookups_device_hit", "lookups_host_hit", "lookups_miss", "cached_tokens_served",
    "allocations", "pool_exhausted", "evictions", "commits", "committed_pages",
    "duplicate_pages", "commit_unknown_lease", "aborts", "leases_expired", "onboarded_pages",
    "onboard_failed_pages", "onboard_misses", "quarantined_pages", "store_errors",
    "store_timeouts", "offloads_ok", "offloads_failed", "offload_pins_expired",
    "offload_done_unknown",
)
QUARANTINE_OWNER = -1  # owner of LEASED pages a timed-out store get may still write


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


@dataclass(frozen=True)
class ReserveAsk:
    """One request of ``reserve_many``: the arguments of ``reserve``."""

    user_id: int
    namespace: str
    keys: tuple[bytes, ...]
    tokens: np.ndarray  # int64 [num_tokens]
    host_pages: int
    ttl_s: float


@dataclass(frozen=True)
class Allocation:
    """What a request may use, returned by ``reserve`` / ``finish_onboard``.

    ``page_row[i]`` is the page of token positions ``[i * page_size, (i + 1) * page_size)``:
    ``num_device_pages`` committed pages read as cached prefix, then ``num_onboard_pages``
    pages to be filled from the host store, then pages compute writes (full pages, and the
    partial last page if ``num_tokens % page_size``). ``cached_len`` counts the tokens compute
    may read once ``onboarded`` is true; compute writes ``[cached_len, num_tokens)``."""

    lease_id: int
    user_id: int
    num_tokens: int
    page_size: int
    page_row: tuple[int, ...]
    num_device_pages: int
    num_onboard_pages: int
    onboarded: bool
    expires_at: float

    @property
    def cached_len(self) -> int:
        return (self.num_device_pages + self.num_onboard_pages) * self.page_size

    @property
    def device_tokens(self) -> int:
        return self.num_device_pages * self.page_size

    @property
    def num_full_pages(self) -> int:
        return self.num_tokens // self.page_size

    @property
    def device_pages(self) -> tuple[int, ...]:
        return self.page_row[: self.num_device_pages]

    @property
    def onboard_pages(self) -> tuple[int, ...]:
        return self.page_row[self.num_device_pages: self.num_device_pages + self.num_onboard_pages]

    @property
    def new_full_pages(self) -> tuple[int, ...]:
        return self.page_row[self.num_device_pages + self.num_onboard_pages: self.num_full_pages]

    @property
    def partial_page(self) -> int | None:
        return self.page_row[-1] if self.num_tokens % self.page_size else None

    @property
    def new_tokens(self) -> int:
        return self.num_tokens - self.cached_len


@dataclass
class Lease:
    """Owner-side record of one request's pages (mutable; only PageTable touches it)."""

    lease_id: int
    user_id: int
    namespace: str  # the request's namespace, fixed at lookup
    keys: tuple[bytes, ...]  # keys of every full page of the request, hashed once at lookup
    tokens: np.ndarray  # int64 token ids of the request (the store's get is keyed by them)
    num_tokens: int
    page_row: list[int]
    num_device: int
    num_onboard: int
    expires_at: float
    onboarding: bool = False
    onboarded: bool = False
    abort_requested: bool = False
    store_task: object = None

    @property
    def exclusive_pages(self) -> list[int]:
        return self.page_row[self.num_device:]


class PageTable:
    """See the module docstring. ``clock`` is seconds, monotonic (injectable for tests)."""

    def __init__(self, num_pages: int, page_size: int, *, offload_ttl_s: float = 120.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert num_pages > 0 and page_size > 0, (
            f"PageTable: expected positive sizes, got num_pages={num_pages} page_size={page_size}"
        )
        self.num_pages = num_pages
        self.page_size = page_size
        self.offload_ttl_s = offload_ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        self._state = [PageState.FREE] * num_pages
        self._refs = [0] * num_pages
        self._owner = [0] * num_pages  # lease id of a LEASED page, 0 otherwise
        self._in_host = [False] * num_pages  # committed page known to be in the host tier
        self._free: deque[int] = deque(range(num_pages))
        self._committed: dict[bytes, int] = {}
        self._page_key: dict[int, bytes] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # committed, refs == 0; oldest first
        self._leases: dict[int, Lease] = {}
        self._offload_deadline: dict[int, float] = {}  # page -> expiry of its offload pin
        self._quarantine: dict[object, list[int]] = {}  # store task -> pages it may write
        self._lease_ids = itertools.count(1)
        self.counters: Counter = Counter({name: 0 for name in COUNTERS})

    # -- public API ---------------------------------------------------------------------

    def match_prefixes(self, key_chains: Sequence[Sequence[bytes]]) -> list[list[int]]:
        """For each chain, the committed pages of the longest prefix of its keys (walks until the
        first miss)."""
        with self._lock:
            return [self._match(keys) for keys in key_chains]

    def reserve_many(self, asks: Sequence[ReserveAsk]) -> list[Allocation | PoolExhausted]:
        """For each ask in order, pin the committed prefix and take pages for the rest; see the
        module docstring. ``ask.host_pages`` counts pages from position 0 the host store has;
        those beyond the device prefix are reserved for onboarding. A request the pool cannot
        hold gets its ``PoolExhausted`` in its place and changes nothing."""
        out: list[Allocation | PoolExhausted] = []
        with self._lock:
            for ask in asks:
                try:
                    out.append(self._reserve(ask))
                except PoolExhausted as e:
                    out.append(e)
        return out

    def release_quarantine(self, in_flight: object) -> int:
        """Free the pages quarantined for store task ``in_flight`` once it is done."""
        with self._lock:
            pages = self._quarantine.pop(in_flight, [])
            for page in pages:
                self._assert_owned(page, QUARANTINE_OWNER, "release_quarantine")
                self._free_page(page)
            return len(pages)

    def quarantined_tasks(self) -> list[object]:
        with self._lock:
            return list(self._quarantine)

    def get_lease(self, lease_id: int) -> Lease | None:
        with self._lock:
            return self._leases.get(lease_id)

    def begin_onboard(self, lease_id: int, store_task: object = None) -> bool:
        """Mark an onboard in flight (no expiry, abort deferred). False: lease gone, or
        nothing to onboard, or already onboarded."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.onboarded or lease.onboarding or lease.abort_requested:
                return False
            lease.onboarding = True
            lease.store_task = store_task
            return True

    def set_store_task(self, lease_id: int, store_task: object) -> None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None:
                lease.store_task = store_task

    def finish_onboard(self, lease_id: int, ok_pages: int,
                       in_flight: object = None) -> Allocation | None:
        """End an onboard: the first ``ok_pages`` onboard pages hold the host's KV; the rest
        become pages to compute (``cached_len`` shrinks). None when the lease was aborted
        meanwhile (its pages are released now) or is unknown.

        ``in_flight`` names a store task that may still write into the failed pages (a get
        that timed out and could not be cancelled): those pages are quarantined until
        ``release_quarantine(in_flight)`` and the lease gets fresh pages instead. Raises
        ``PoolExhausted`` (after releasing the lease) when no fresh pages are available."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return None
            if lease.onboarding and in_flight is not None and ok_pages < lease.num_onboard:
                start = lease.num_device + ok_pages
                stop = lease.num_device + lease.num_onboard
                stuck = lease.page_row[start:stop]
                for page in stuck:
                    self._assert_owned(page, lease_id, "finish_onboard")
                    self._owner[page] = QUARANTINE_OWNER
                self._quarantine.setdefault(in_flight, []).extend(stuck)
                self.counters["quarantined_pages"] += len(stuck)
                keep = set(lease.page_row[: lease.num_device])
                if len(self._free) + len(self._lru) - sum(1 for p in keep if p in self._lru) < len(stuck):
                    lease.page_row[start:stop] = []
                    lease.num_tokens = min(lease.num_tokens, start * self.page_size)
                    lease.num_onboard = ok_pages
                    lease.onboarding = False
                    self._release(lease)
                    raise PoolExhausted(
                        f"user {lease.user_id}: onboard of lease {lease_id} timed out and no "
                        f"pages are left to recompute {len(stuck)} pages; the request is aborted"
                    )
                lease.page_row[start:stop] = [self._take_page(lease_id, keep) for _ in stuck]
            assert lease.onboarding or lease.onboarded, (
                f"PageTable.finish_onboard: lease {lease_id} has no onboard in flight "
                "(caller must call begin_onboard first)"
            )
            if lease.onboarding:
                assert 0 <= ok_pages <= lease.num_onboard, (
                    f"PageTable.finish_onboard: expected 0 <= ok_pages <= {lease.num_onboard}, "
                    f"got {ok_pages}"
                )
                failed = lease.num_onboard - ok_pages
                if failed:
                    self.counters["onboard_failed_pages"] += failed
                lease.num_onboard = ok_pages
                lease.onboarding = False
                lease.onboarded = True
                lease.store_task = None
                self.counters["onboarded_pages"] += ok_pages
                self.counters["cached_tokens_served"] += ok_pages * self.page_size
            if lease.abort_requested:
                self._release(lease)
                return None
            return self._allocation(lease)

    def commit_many(self, lease_ids: Sequence[int], offload: bool = True) -> list[Committed | None]:
        """Publish each lease's full pages, in order; see the module docstring. None in the place
        of an unknown lease (expired or aborted; nothing changed). With ``offload=False`` no page
        is pinned for offload (no host tier)."""
        with self._lock:
            return [self._commit(lease_id, offload) for lease_id in lease_ids]

    def abort(self, lease_id: int) -> bool:
        """Return every page of the lease. False: unknown lease. During an onboard the
        release is deferred to ``finish_onboard``."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            self.counters["aborts"] += 1
            if lease.onboarding:
                lease.abort_requested = True
                return True
            self._release(lease)
            return True

    def expire(self, now: float | None = None) -> list[int]:
        """Release leases and offload pins whose deadline passed; returns expired lease ids."""
        with self._lock:
            now = self.clock() if now is None else now
            expired = [lid for lid, lease in self._leases.items()
                       if lease.expires_at <= now and not lease.onboarding]
            for lid in expired:
                logger.warning("lease %d of user %d expired; its pages return to the pool",
                               lid, self._leases[lid].user_id)
                self._release(self._leases[lid])
            self.counters["leases_expired"] += len(expired)
            stale = [page for page, deadline in self._offload_deadline.items() if deadline <= now]
            if stale:
                logger.warning("offload pins of %d pages expired without offload_done", len(stale))
                self.counters["offload_pins_expired"] += len(stale)
                self._offload_release(stale, ok=False)
            return expired

    def offload_done(self, page_ids: Iterable[int], ok: bool) -> int:
        """Drop offload pins; ``ok`` marks the pages as present in the host tier. Returns how
        many pins were dropped (pins already expired are ignored)."""
        with self._lock:
            pages = [int(p) for p in page_ids]
            pinned = [p for p in pages if p in self._offload_deadline]
            if len(pinned) != len(pages):
                logger.info("offload_done for %d pages without an offload pin (expired?)",
                            len(pages) - len(pinned))
                self.counters["offload_done_unknown"] += len(pages) - len(pinned)
            self._offload_release(pinned, ok)
            self.counters["offloads_ok" if ok else "offloads_failed"] += len(pinned)
            return len(pinned)

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {
                "pages_total": self.num_pages,
                "pages_free": len(self._free),
                "pages_in_use": self.num_pages - len(self._free),
                "pages_committed": len(self._committed),
                "pages_evictable": len(self._lru),
                "pages_pinned": self._num_pinned(),
                "pages_leased": self._num_leased(),
                "pages_offload_pending": len(self._offload_deadline),
                "leases_active": len(self._leases),
                "pages_quarantined": sum(len(p) for p in self._quarantine.values()),
            }
            out.update(self.counters)
            return out

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def check_invariants(self) -> None:
        """Assert the whole table is consistent (for tests; O(num_pages))."""
        with self._lock:
            free = list(self._free)
            free_set = set(free)
            assert len(free) == len(free_set), f"free list has duplicates: {sorted(free)}"
            expected_refs = [0] * self.num_pages
            exclusive_owner: dict[int, int] = {}
            for lid, lease in self._leases.items():
                assert lease.lease_id == lid, f"lease id mismatch: expected {lid}, got {lease.lease_id}"
                for page in lease.page_row[: lease.num_device]:
                    expected_refs[page] += 1
                for page in lease.exclusive_pages:
                    assert page not in exclusive_owner, (
                        f"page {page} owned by leases {exclusive_owner[page]} and {lid}"
                    )
                    exclusive_owner[page] = lid
            for task, pages in self._quarantine.items():
                for page in pages:
                    assert page not in exclusive_owner, f"quarantined page {page} also held by {exclusive_owner[page]}"
                    exclusive_owner[page] = QUARANTINE_OWNER
            for page in self._offload_deadline:
                expected_refs[page] += 1
            for page in range(self.num_pages):
                state = self._state[page]
                if state == PageState.FREE:
                    assert page in free_set, f"page {page}: expected on the free list (FREE)"
                    assert self._refs[page] == 0 and page not in self._page_key, (
                        f"free page {page}: expected refs 0 and no key, got refs {self._refs[page]}"
                    )
                    assert page not in exclusive_owner, f"free page {page} held by lease {exclusive_owner.get(page)}"
                elif state == PageState.LEASED:
                    assert exclusive_owner.get(page) == self._owner[page], (
                        f"leased page {page}: expected owner {self._owner[page]}, got "
                        f"{exclusive_owner.get(page)}"
                    )
                    assert self._refs[page] == 0 and page not in self._page_key, (
                        f"leased page {page}: expected refs 0 and no key"
                    )
                else:
                    key = self._page_key.get(page)
                    assert key is not None and self._committed.get(key) == page, (
                        f"committed page {page}: key table disagrees ({key!r})"
                    )
                    assert page not in exclusive_owner, f"committed page {page} leased to {exclusive_owner[page]}"
                assert self._refs[page] == expected_refs[page], (
                    f"page {page}: expected refs {expected_refs[page]} (leases + offload), got {self._refs[page]}"
                )
                in_lru = page in self._lru
                should = state == PageState.COMMITTED and self._refs[page] == 0
                assert in_lru == should, f"page {page}: expected in LRU={should}, got {in_lru}"
            assert len(free) + len(exclusive_owner) + len(self._committed) == self.num_pages, (
                f"pages lost: free {len(free)} + leased {len(exclusive_owner)} + committed "
                f"{len(self._committed)} != {self.num_pages}"
            )

    # -- helpers (call with the lock held) -----------------------------------------------

    def _match(self, keys: Sequence[bytes]) -> list[int]:
        pages: list[int] = []
        for key in keys:
            page = self._committed.get(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def _reserve(self, ask: ReserveAsk) -> Allocation:
        num_tokens = int(ask.tokens.size)
        num_full = num_tokens // self.page_size
        assert len(ask.keys) == num_full, (
            f"PageTable.reserve: expected {num_full} keys for {num_tokens} tokens, got {len(ask.keys)}"
        )
        num_pages = -(-num_tokens // self.page_size)
        device = self._match(ask.keys)
        d = len(device)
        h = max(0, min(ask.host_pages, num_full) - d)
        need = num_pages - d
        device_set = set(device)
        evictable = len(self._lru) - sum(1 for p in device if p in self._lru)
        if need > len(self._free) + evictable:
            self.counters["pool_exhausted"] += 1
            raise PoolExhausted(
                f"user {ask.user_id}: need {need} free pages ({num_tokens} tokens, {d} pages "
                f"cached on device) but only {len(self._free)} are free and {evictable} "
                f"evictable of {self.num_pages}; {self._num_pinned()} committed pages are "
                f"pinned by leases or offloads and {self._num_leased()} are leased"
            )
        for page in device:
            self._pin(page)
        lease_id = next(self._lease_ids)
        taken = [self._take_page(lease_id, device_set) for _ in range(need)]
        lease = Lease(
            lease_id=lease_id,
            user_id=ask.user_id,
            namespace=ask.namespace,
            keys=tuple(ask.keys),
            tokens=ask.tokens,
            num_tokens=num_tokens,
            page_row=device + taken,
            num_device=d,
            num_onboard=h,
            expires_at=self.clock() + ask.ttl_s,
            onboarded=h == 0,
        )
        self._leases[lease_id] = lease
        self.counters["allocations"] += 1
        self.counters["cached_tokens_served"] += d * self.page_size
        return self._allocation(lease)

    def _commit(self, lease_id: int, offload: bool) -> Committed | None:
        lease = self._leases.get(lease_id)
        if lease is None:
            self.counters["commit_unknown_lease"] += 1
            return None
        assert not lease.onboarding and lease.onboarded, (
            f"PageTable.commit: lease {lease_id} committed before its onboard finished "
            "(caller must run onboard before compute)"
        )
        del self._leases[lease_id]
        items: list[OffloadItem] = []
        S = self.page_size
        num_full = lease.num_tokens // S
        onboard_end = lease.num_device + lease.num_onboard
        touched: list[int] = []
        for i in range(lease.num_device, num_full):
            page = lease.page_row[i]
            key = lease.keys[i]
            self._assert_owned(page, lease_id, "commit")
            existing = self._committed.get(key)
            if existing is not None:
                self.counters["duplicate_pages"] += 1
                self._free_page(page)
                lease.page_row[i] = existing
                continue
            self._state[page] = PageState.COMMITTED
            self._owner[page] = 0
            self._committed[key] = page
            self._page_key[page] = key
            self._in_host[page] = i < onboard_end
            if offload and not self._in_host[page]:
                self._pin(page)
                self._offload_deadline[page] = self.clock() + self.offload_ttl_s
                items.append(OffloadItem(page, (i + 1) * S, key))
            touched.append(page)
        if lease.num_tokens % S:
            page = lease.page_row[num_full]
            self._assert_owned(page, lease_id, "commit")
            self._free_page(page)
        for page in lease.page_row[: lease.num_device]:
            self._unpin(page)
        # Most recent use last; page 0 of the chain ends up most recent, so leaves are
        # evicted before the prefix they hang on.
        for page in reversed(lease.page_row[:num_full]):
            if self._refs[page] == 0 and self._state[page] == PageState.COMMITTED:
                self._lru.pop(page, None)
                self._lru[page] = None
        self.counters["commits"] += 1
        self.counters["committed_pages"] += len(touched)
        return Committed(lease_id, lease.namespace, tuple(items))

    def _allocation(self, lease: Lease) -> Allocation:
        return Allocation(
            lease_id=lease.lease_id,
            user_id=lease.user_id,
            num_tokens=lease.num_tokens,
            page_size=self.page_size,
            page_row=tuple(lease.page_row),
            num_device_pages=lease.num_device,
            num_onboard_pages=lease.num_onboard,
            onboarded=lease.onboarded,
            expires_at=lease.expires_at,
        )

    def _pin(self, page: int) -> None:
        assert self._state[page] == PageState.COMMITTED, (
            f"pin: expected a committed page, page {page} is {self._state[page].name}"
        )
        self._refs[page] += 1
        self._lru.pop(page, None)

    def _unpin(self, page: int) -> None:
        assert self._refs[page] > 0, f"unpin: expected refs > 0 on page {page}, got {self._refs[page]}"
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._lru[page] = None

    def _take_page(self, lease_id: int, keep: set[int]) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page = next(p for p in self._lru if p not in keep)
            self._evict(page)
            page = self._free.pop()
        assert self._state[page] == PageState.FREE and self._refs[page] == 0, (
            f"take: page {page} expected FREE with refs 0, got {self._state[page].name} refs {self._refs[page]}"
        )
        self._state[page] = PageState.LEASED
        self._owner[page] = lease_id
        return page

    def _evict(self, page: int) -> None:
        assert self._refs[page] == 0, f"evict: page {page} expected refs 0, got {self._refs[page]}"
        del self._lru[page]
        key = self._page_key.pop(page)
        del self._committed[key]
        self._in_host[page] = False
        self._state[page] = PageState.FREE
        self._free.append(page)
        self.counters["evictions"] += 1

    def _free_page(self, page: int) -> None:
        assert self._state[page] == PageState.LEASED and self._refs[page] == 0, (
            f"free: page {page} expected LEASED with refs 0, got {self._state[page].name} refs {self._refs[page]}"
        )
        self._state[page] = PageState.FREE
        self._owner[page] = 0
        self._free.append(page)

    def _assert_owned(self, page: int, lease_id: int, caller: str) -> None:
        assert self._state[page] == PageState.LEASED and self._owner[page] == lease_id, (
            f"{caller}: page {page} expected LEASED to lease {lease_id}, got "
            f"{self._state[page].name} owner {self._owner[page]}"
        )

    def _release(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        for page in lease.exclusive_pages:
            self._assert_owned(page, lease.lease_id, "release")
            self._free_page(page)
        for page in lease.page_row[: lease.num_device]:
            self._unpin(page)

    def _offload_release(self, pages: Sequence[int], ok: bool) -> None:
        for page in pages:
            del self._offload_deadline[page]
            if ok:
                self._in_host[page] = True
            self._unpin(page)

    def _num_pinned(self) -> int:
        return sum(1 for p in self._page_key if self._refs[p] > 0)

    def _num_leased(self) -> int:
        return sum(len(lease.exclusive_pages) for lease in self._leases.values())

