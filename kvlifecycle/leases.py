"""The lease table: which request holds which pages of the page table, and for how long.

A lease is one request's claim on pages: read pins (refs + 1) on the committed prefix it reuses
and the LEASED pages it writes. Operations, in the order a request calls them (invariant 3 of
docs/ARCHITECTURE.md); each takes a batch of requests under one lock acquisition:

1. ``match_prefixes(key_chains)``: for each chain, the committed pages of the longest prefix of
   its keys (no state change but a counter: see "Uncommitted prefixes" below).
2. ``reserve_many(asks, wait_s) -> [Lease | PoolExhausted]``: for each request, pins the device
   prefix and takes pages for the host-hit pages and every new token (free list first, then LRU
   eviction, oldest first). A request that does not fit gets its ``PoolExhausted`` in its place
   and changes nothing; with ``wait_s``, one that would fit once the pages held by other leases
   and by offloads in flight come back first waits up to ``wait_s`` (a long request right
   after another one, on a pool the first one's offload still pins). The lease keeps what the
   request's lookup fixed: its namespace, page keys and token ids (nothing later re-hashes).
3. optional ``begin_onboard`` / ``onboard_launched(task, pages)`` / ``finish_onboard(ok_pages)``:
   while an onboard is in flight the lease neither expires nor is released by ``abort`` (the
   abort is deferred to ``finish_onboard``), so the store never writes into a page someone else
   owns. Onboard pages beyond those the store copies (``pages``), or beyond ``ok_pages``, become
   pages to compute.
4. ``commit_many(lease_ids) -> [Committed | None]``: each lease's full pages become COMMITTED
   under their keys (a key committed meanwhile keeps the existing page; ours is freed), the
   partial last page is freed, read pins are dropped. Pages not known to be in the host tier
   are pinned for offload; each ``Committed`` carries them with the lease's namespace.
   Or ``abort(lease_id)`` / ``expire(now)``: every page of the lease returns.
5. ``offload_done(page_ids, ok)``: drops the offload pins. Offload pins also expire (a crashed
   offloader must not leak pages); a late ``offload_done`` for them is ignored.

Quarantine: a store get that timed out and could not be cancelled may still write into its
onboard pages. ``finish_onboard`` moves those pages into a quarantine lease (user
``QUARANTINE_USER``, a negative lease id no caller ever sees, ``store_task`` the get, never
expiring) and gives the request fresh pages; ``release_quarantine(task)`` frees them once the
get is done. Quarantine leases are not counted as active leases or leased pages.

Uncommitted prefixes: a page is found only once committed. A user's request sent while its
previous request is still computing (both in flight at once) finds the prefix that request is
writing still LEASED: it is never waited for, the request computes those pages itself (the
first commit of a key wins, the second's page is freed: ``duplicate_pages``). The table keeps,
for each request lease, the keys of the pages it writes or onboards (``_writing``), only to
count such lookups (``uncommitted_prefix_lookups``). Both models commit before they answer, so
a client that waits for its answer never meets one.

Promises: a page is handed out only after asserting nobody holds it; a page with refs > 0 is
never evicted; a failed call changes nothing. Thread-safe: one lock around every public method;
no method blocks on I/O. A ``Lease`` is immutable (each change stores a new one), so the one
``get_lease`` returns stays valid to read without the lock.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

import numpy as np

from kvlifecycle.page_table import Committed, OffloadItem, PageTable, PoolExhausted
from kvlifecycle.stats_keys import LEASE_COUNTERS, PAGE_GAUGES

logger = logging.getLogger(__name__)

__all__ = ["QUARANTINE_USER", "Lease", "LeaseTable", "ReserveAsk"]

QUARANTINE_USER = -1  # user of a lease holding pages a timed-out store get may still write
LEASE_TTL_S = 30.0  # a lease not committed or aborted by then returns its pages (> the slowest compute)
OFFLOAD_TTL_S = 120.0  # likewise for a page pinned for offload whose put was never reaped


@dataclass(frozen=True)
class ReserveAsk:
    """One request of ``reserve_many``."""

    user_id: int
    namespace: str
    keys: tuple[bytes, ...]
    tokens: np.ndarray  # int64 [num_tokens]
    host_pages: int
    ttl_s: float
    host_unconfirmed: bool = False  # host_pages are candidates the store has not confirmed yet
    # Fewer onboard pages than this are computed instead: device pages another request evicted
    # since the lookup (1-5, say) cost more to copy back than to recompute (min_host_pages).
    min_onboard_pages: int = 1


@dataclass(frozen=True, eq=False)
class Lease:
    """One request's pages, as of the last change (returned by ``reserve_many`` /
    ``finish_onboard`` / ``get_lease``; the table stores a new one on every change).

    ``page_row[i]`` is the page of token positions ``[i * page_size, (i + 1) * page_size)``:
    ``num_device_pages`` committed pages read as cached prefix, then ``num_onboard_pages``
    pages to be filled from the host store, then pages compute writes (full pages, and the
    partial last page if ``num_tokens % page_size``). ``cached_len`` counts the tokens compute
    may read once ``onboarded`` is true; compute writes ``[cached_len, num_tokens)``."""

    lease_id: int
    user_id: int
    namespace: str  # the request's namespace, fixed at lookup
    keys: tuple[bytes, ...]  # keys of every full page of the request, hashed once at lookup
    tokens: np.ndarray  # int64 token ids of the request (the store's get is keyed by them)
    num_tokens: int
    page_size: int
    page_row: tuple[int, ...]
    num_device_pages: int
    num_onboard_pages: int
    onboarded: bool
    expires_at: float
    onboarding: bool = False  # an onboard is in flight: no expiry, abort deferred
    abort_requested: bool = False
    store_task: object = None  # the store get writing the onboard pages (or, quarantined, that may)
    # The onboard pages are candidates the lookup did not ask the host store about: the onboard's
    # launch asks (one round trip), keeps those it holds and counts the lookup's outcome.
    host_unconfirmed: bool = False
    # The reader (hstu_compute) copies the onboard pages from the store's shared slab itself and
    # computes those it cannot copy. It reports how many leading onboard pages it copied
    # (``reader_copied``, before the answer that leads to the commit): commit offloads only the
    # others. Unreported, commit offloads them all (the store skips the keys it holds).
    onboard_by_reader: bool = False
    reader_copied_pages: int = 0

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
    def partial_page(self) -> int | None:
        return self.page_row[-1] if self.num_tokens % self.page_size else None

    @property
    def new_tokens(self) -> int:
        return self.num_tokens - self.cached_len

    @property
    def quarantined(self) -> bool:
        """A quarantine lease: pages a timed-out store get may still write, not a request's."""
        return self.user_id == QUARANTINE_USER

    @property
    def exclusive_pages(self) -> tuple[int, ...]:
        """The pages this lease owns (LEASED to it): everything but the read-pinned prefix."""
        return self.page_row[self.num_device_pages:]


class LeaseTable:
    """See the module docstring. ``clock`` is seconds, monotonic (injectable for tests)."""

    def __init__(self, num_pages: int, page_size: int, *, offload_ttl_s: float = OFFLOAD_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pages = PageTable(num_pages, page_size)
        self.num_pages = num_pages
        self.page_size = page_size
        self.offload_ttl_s = offload_ttl_s
        self.clock = clock
        self._lock = threading.Lock()
        # Notified when a lease ends (commit, release) or offload pins drop: what a waiting lookup
        # or reservation waits for.
        self._changed = threading.Condition(self._lock)
        self._leases: dict[int, Lease] = {}  # request leases and quarantine leases
        self._writing: dict[bytes, int] = {}  # key of a page a request lease writes or onboards -> lease id
        self._lease_ids = itertools.count(1)
        self._quarantine_ids = itertools.count(-1, -1)  # negative: never a caller's lease id
        # A plain dict, not a Counter: a key missing from LEASE_COUNTERS raises instead of
        # becoming a stat nobody publishes.
        self.counters: dict[str, float] = dict.fromkeys(LEASE_COUNTERS, 0)

    # -- public API, in the order a request calls it --------------------------------------

    def match_prefixes(self, key_chains: Sequence[Sequence[bytes]]) -> list[list[int]]:
        """For each chain, the committed pages of the longest prefix of its keys; a chain that
        stops at a page some lease is still writing is counted (``uncommitted_prefix_lookups``)."""
        with self._lock:
            matches = [self.pages.match(keys) for keys in key_chains]
            self.counters["uncommitted_prefix_lookups"] += sum(
                1 for keys, m in zip(key_chains, matches) if len(m) < len(keys) and keys[len(m)] in self._writing)
            return matches

    def reserve_many(self, asks: Sequence[ReserveAsk], wait_s: float = 0.0) -> list[Lease | PoolExhausted]:
        """For each ask in order, pin the committed prefix and take pages for the rest; see the
        module docstring. ``ask.host_pages`` counts pages from position 0 the host store has;
        those beyond the device prefix are reserved for onboarding. A request the pool cannot
        hold gets its ``PoolExhausted`` in its place and changes nothing. ``wait_s``: the most
        one call waits (wall time, lock released) for held pages to come back."""
        out: list[Lease | PoolExhausted] = []
        deadline = time.monotonic() + wait_s
        with self._lock:
            for ask in asks:
                while True:
                    try:
                        out.append(self._reserve(ask))
                        break
                    except PoolExhausted as e:
                        left = deadline - time.monotonic()
                        if left <= 0 or not self._fits_once_held_pages_return(ask):
                            self.counters["pool_exhausted"] += 1
                            out.append(e)
                            break
                        self.counters["pool_waits"] += 1
                        self._changed.wait(timeout=left)
        return out

    def get_lease(self, lease_id: int) -> Lease | None:
        with self._lock:
            return self._request_lease(lease_id)

    def begin_onboard(self, lease_id: int, store_task: object = None) -> bool:
        """Mark an onboard in flight (no expiry, abort deferred). False: lease gone, or
        nothing to onboard, or already onboarded."""
        with self._lock:
            lease = self._request_lease(lease_id)
            if lease is None or lease.onboarded or lease.onboarding or lease.abort_requested:
                return False
            self._leases[lease_id] = replace(lease, onboarding=True, store_task=store_task)
            return True

    def onboard_launched(self, lease_id: int, store_task: object, pages: int) -> Lease | None:
        """The store copies the first ``pages`` onboard pages (task ``store_task``); the others,
        which it does not hold, become pages to compute. Called before anyone reads the lease's
        ``cached_len``. None when the lease is unknown."""
        with self._lock:
            lease = self._request_lease(lease_id)
            if lease is None:
                return None
            assert lease.onboarding and 0 <= pages <= lease.num_onboard_pages, (
                f"LeaseTable.onboard_launched: lease {lease_id} expected an onboard in flight and "
                f"0 <= pages <= {lease.num_onboard_pages}, got onboarding={lease.onboarding}, pages={pages}"
            )
            lease = replace(lease, store_task=store_task, num_onboard_pages=pages)
            self._leases[lease_id] = lease
            return lease

    def hand_onboard_to_reader(self, lease_id: int) -> Lease | None:
        """The lease's onboard pages are the reader's to fill (copied from the store's shared slab,
        or computed): the lease is settled now, its ``cached_len`` kept. None: lease gone."""
        with self._lock:
            lease = self._request_lease(lease_id)
            if lease is None:
                return None
            assert not lease.onboarding and not lease.onboarded, (
                f"LeaseTable.hand_onboard_to_reader: lease {lease_id} already onboarding or onboarded")
            lease = replace(lease, onboarded=True, onboard_by_reader=True)
            self._leases[lease_id] = lease
            self.counters["onboard_reader_pages"] += lease.num_onboard_pages
            # Counted as served from the cache now; a page the reader computes instead is counted
            # by it (hstu_kv_onboard_failed_pages_total).
            self.counters["cached_tokens_served"] += lease.num_onboard_pages * self.page_size
            return lease

    def reader_copied(self, lease_ids: Sequence[int], pages: Sequence[int]) -> int:
        """The reader copied the first ``pages[i]`` onboard pages of lease ``lease_ids[i]`` from the
        store: they are in the host tier, so its commit does not offload them. Returns how many
        leases took the report (a lease gone, or not the reader's, ignores it)."""
        taken = 0
        with self._lock:
            for lease_id, n in zip(lease_ids, pages):
                lease = self._request_lease(lease_id)
                if lease is None or not lease.onboard_by_reader:
                    continue
                self._leases[lease_id] = replace(lease, reader_copied_pages=max(0, min(int(n), lease.num_onboard_pages)))
                taken += 1
        return taken

    def finish_onboard(self, lease_id: int, ok_pages: int,
                       in_flight: object = None) -> Lease | None:
        """End an onboard: the first ``ok_pages`` onboard pages hold the host's KV; the rest
        become pages to compute (``cached_len`` shrinks). None when the lease was aborted
        meanwhile (its pages are released now) or is unknown.

        ``in_flight`` names a store task that may still write into the failed pages (a get
        that timed out and could not be cancelled): those pages are quarantined until
        ``release_quarantine(in_flight)`` and the lease gets fresh pages instead. Raises
        ``PoolExhausted`` (after releasing the lease) when no fresh pages are available."""
        with self._lock:
            lease = self._request_lease(lease_id)
            if lease is None:
                return None
            if lease.onboarding and in_flight is not None and ok_pages < lease.num_onboard_pages:
                lease = self._quarantine(lease, ok_pages, in_flight)
            assert lease.onboarding or lease.onboarded, (
                f"LeaseTable.finish_onboard: lease {lease_id} has no onboard in flight "
                "(caller must call begin_onboard first)"
            )
            if lease.onboarding:
                assert 0 <= ok_pages <= lease.num_onboard_pages, (
                    f"LeaseTable.finish_onboard: expected 0 <= ok_pages <= "
                    f"{lease.num_onboard_pages}, got {ok_pages}"
                )
                failed = lease.num_onboard_pages - ok_pages
                if failed:
                    self.counters["onboard_failed_pages"] += failed
                lease = replace(lease, num_onboard_pages=ok_pages, onboarding=False,
                                onboarded=True, store_task=None)
                self.counters["onboarded_pages"] += ok_pages
                self.counters["cached_tokens_served"] += ok_pages * self.page_size
            if lease.abort_requested:
                self._release(lease)
                return None
            self._leases[lease_id] = lease
            return lease

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
            lease = self._request_lease(lease_id)
            if lease is None:
                return False
            self.counters["aborts"] += 1
            if lease.onboarding:
                self._leases[lease_id] = replace(lease, abort_requested=True)
                return True
            self._release(lease)
            return True

    def expire(self, now: float | None = None) -> list[int]:
        """Release leases and offload pins whose deadline passed; returns expired lease ids.
        Quarantine leases never expire (only their store task's end frees them)."""
        with self._lock:
            now = self.clock() if now is None else now
            expired = [lid for lid, lease in self._leases.items()
                       if not lease.quarantined and lease.expires_at <= now
                       and not lease.onboarding]
            for lid in expired:
                logger.warning("lease %d of user %d expired; its pages return to the pool",
                               lid, self._leases[lid].user_id)
                self._release(self._leases[lid])
            self.counters["leases_expired"] += len(expired)
            stale = self.pages.expired_offload_pins(now)
            if stale:
                logger.warning("offload pins of %d pages expired without offload_done", len(stale))
                self.counters["offload_pins_expired"] += len(stale)
                self.pages.drop_offload_pins(stale, ok=False)
                self._changed.notify_all()
            return expired

    def offload_done(self, page_ids: Iterable[int], ok: bool) -> int:
        """Drop offload pins; ``ok`` marks the pages as present in the host tier. Returns how
        many pins were dropped (pins already expired are ignored)."""
        with self._lock:
            pages = [int(p) for p in page_ids]
            pinned = self.pages.offload_pinned(pages)
            if len(pinned) != len(pages):
                logger.info("offload_done for %d pages without an offload pin (expired?)",
                            len(pages) - len(pinned))
                self.counters["offload_done_unknown"] += len(pages) - len(pinned)
            self.pages.drop_offload_pins(pinned, ok)
            self.counters["offloads_ok" if ok else "offloads_failed"] += len(pinned)
            self._changed.notify_all()
            return len(pinned)

    def release_quarantine(self, in_flight: object) -> int:
        """Free the pages quarantined for store task ``in_flight`` once it is done; returns how
        many."""
        with self._lock:
            held = [lease for lease in self._leases.values()
                    if lease.quarantined and lease.store_task == in_flight]
            for lease in held:
                self._release(lease)
            return sum(len(lease.page_row) for lease in held)

    def quarantined_tasks(self) -> list[object]:
        """The store tasks that quarantine leases wait for, oldest first."""
        with self._lock:
            return list(dict.fromkeys(lease.store_task for lease in self._leases.values()
                                      if lease.quarantined))

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = {
                "pages_total": self.num_pages,
                "pages_free": self.pages.num_free,
                "pages_in_use": self.num_pages - self.pages.num_free,
                "pages_committed": self.pages.num_committed,
                "pages_evictable": self.pages.num_evictable,
                "pages_pinned": self.pages.num_pinned(),
                "pages_leased": self._num_leased(),
                "pages_offload_pending": self.pages.num_offload_pinned,
                "leases_active": sum(1 for lease in self._leases.values()
                                     if not lease.quarantined),
                "pages_quarantined": sum(len(lease.page_row) for lease in self._leases.values()
                                         if lease.quarantined),
            }
            out.update(self.counters)
            return out

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def check_invariants(self) -> None:
        """Assert the leases and the page table agree (for tests; O(num_pages)): each page is
        owned by at most one lease (quarantine leases included), refs = the leases' device
        prefixes + offload pins, the LRU holds exactly the committed pages with refs 0, and no
        page is lost."""
        keys = set(self.stats())
        assert keys == set(PAGE_GAUGES) | set(LEASE_COUNTERS), (
            f"stats() keys differ from kvlifecycle.stats_keys: {sorted(keys ^ (set(PAGE_GAUGES) | set(LEASE_COUNTERS)))}")
        with self._lock:
            owners: dict[int, int] = {}
            read_refs = [0] * self.num_pages
            for lid, lease in self._leases.items():
                assert lease.lease_id == lid, f"lease id mismatch: expected {lid}, got {lease.lease_id}"
                for page in lease.device_pages:
                    read_refs[page] += 1
                for page in lease.exclusive_pages:
                    assert page not in owners, f"page {page} owned by leases {owners[page]} and {lid}"
                    owners[page] = lid
            for key, lid in self._writing.items():
                lease = self._leases.get(lid)
                assert lease is not None and not lease.quarantined and key in lease.keys[lease.num_device_pages:], (
                    f"pending key of lease {lid}: the lease is gone or does not write that page")
            self.pages.check_invariants(owners, read_refs)

    # -- helpers (call with the lock held) ------------------------------------------------

    def _request_lease(self, lease_id: int) -> Lease | None:
        """A request's lease; None for an unknown id or a quarantine lease (callers never name
        one, and one must not be released before its store task ends)."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.quarantined:
            return None
        return lease

    def _reserve(self, ask: ReserveAsk) -> Lease:
        S = self.page_size
        num_tokens = int(ask.tokens.size)
        num_full = num_tokens // S
        assert len(ask.keys) == num_full, (
            f"LeaseTable.reserve: expected {num_full} keys for {num_tokens} tokens, got {len(ask.keys)}"
        )
        num_pages = -(-num_tokens // S)
        device = self.pages.match(ask.keys)
        d = len(device)
        h = max(0, min(ask.host_pages, num_full) - d)
        if h < ask.min_onboard_pages:
            h = 0
        need = num_pages - d
        device_set = set(device)
        free = self.pages.num_free
        if need > free:  # evicting: count what may go (a walk over this request's device pages)
            evictable = self.pages.num_available(device_set) - free
            if need > free + evictable:
                raise PoolExhausted(
                    f"user {ask.user_id}: need {need} free pages ({num_tokens} tokens, {d} pages "
                    f"cached on device) but only {free} are free and {evictable} "
                    f"evictable of {self.num_pages}; {self.pages.num_pinned()} committed pages are "
                    f"pinned by leases or offloads and {self._num_leased()} are leased"
                )
        self.pages.pin_many(device)
        lease_id = next(self._lease_ids)
        taken, evicted = self.pages.take(lease_id, need, device_set)
        self.counters["evictions"] += evicted
        lease = Lease(
            lease_id=lease_id,
            user_id=ask.user_id,
            namespace=ask.namespace,
            keys=tuple(ask.keys),
            tokens=ask.tokens,
            num_tokens=num_tokens,
            page_size=S,
            page_row=tuple(device + taken),
            num_device_pages=d,
            num_onboard_pages=h,
            onboarded=h == 0,
            expires_at=self.clock() + ask.ttl_s,
            host_unconfirmed=ask.host_unconfirmed and h > 0,
        )
        self._leases[lease_id] = lease
        for key in lease.keys[d:]:
            self._writing[key] = lease_id
        self.counters["allocations"] += 1
        self.counters["cached_tokens_served"] += d * S
        return lease

    def _quarantine(self, lease: Lease, ok_pages: int, in_flight: object) -> Lease:
        """Move the onboard pages past ``ok_pages`` (which the timed-out get ``in_flight`` may
        still write) into a quarantine lease; return ``lease`` with fresh pages in their place.
        Raises ``PoolExhausted`` after releasing ``lease`` when no fresh pages are left."""
        start = lease.num_device_pages + ok_pages
        stop = lease.num_device_pages + lease.num_onboard_pages
        stuck = lease.page_row[start:stop]
        quarantine_id = next(self._quarantine_ids)
        for page in stuck:
            self.pages.transfer(page, lease.lease_id, quarantine_id)
        self._leases[quarantine_id] = Lease(
            lease_id=quarantine_id, user_id=QUARANTINE_USER, namespace=lease.namespace, keys=(),
            tokens=np.empty(0, dtype=np.int64), num_tokens=0, page_size=self.page_size,
            page_row=stuck, num_device_pages=0, num_onboard_pages=0, onboarded=False,
            expires_at=math.inf, store_task=in_flight,
        )
        self.counters["quarantined_pages"] += len(stuck)
        keep = set(lease.device_pages)
        if self.pages.num_available(keep) < len(stuck):
            self._release(replace(lease, page_row=lease.page_row[:start] + lease.page_row[stop:],
                                  onboarding=False))
            raise PoolExhausted(
                f"user {lease.user_id}: onboard of lease {lease.lease_id} timed out and no "
                f"pages are left to recompute {len(stuck)} pages; the request is aborted"
            )
        fresh, evicted = self.pages.take(lease.lease_id, len(stuck), keep)
        self.counters["evictions"] += evicted
        return replace(lease, page_row=lease.page_row[:start] + tuple(fresh) + lease.page_row[stop:])

    def _commit(self, lease_id: int, offload: bool) -> Committed | None:
        lease = self._request_lease(lease_id)
        if lease is None:
            self.counters["commit_unknown_lease"] += 1
            return None
        assert not lease.onboarding and lease.onboarded, (
            f"LeaseTable.commit: lease {lease_id} committed before its onboard finished "
            "(caller must run onboard before compute)"
        )
        self._end(lease)
        S = self.page_size
        num_full = lease.num_full_pages
        # the onboard pages known to be in the host tier: copied from it, so never offloaded again
        host_end = lease.num_device_pages + (lease.reader_copied_pages if lease.onboard_by_reader
                                             else lease.num_onboard_pages)
        row = list(lease.page_row)  # a duplicate key's page replaces ours, for the LRU below
        items: list[OffloadItem] = []
        committed = 0
        for i in range(lease.num_device_pages, num_full):
            page = row[i]
            key = lease.keys[i]
            kept = self.pages.commit(page, lease_id, key, in_host=i < host_end)
            if kept != page:
                self.counters["duplicate_pages"] += 1
                row[i] = kept
                continue
            if offload and not self.pages.in_host(page):
                self.pages.pin_for_offload(page, self.clock() + self.offload_ttl_s)
                items.append(OffloadItem(page, (i + 1) * S, key))
            committed += 1
        if lease.partial_page is not None:
            self.pages.free(lease.partial_page, lease_id)
        # Most recent use last; page 0 of the chain ends up most recent, so leaves are
        # evicted before the prefix they hang on. The device pages are among them.
        self.pages.unpin_and_touch(lease.device_pages, reversed(row[:num_full]))
        self.counters["commits"] += 1
        self.counters["committed_pages"] += committed
        return Committed(lease_id, lease.namespace, tuple(items))

    def _release(self, lease: Lease) -> None:
        self._end(lease)
        for page in lease.exclusive_pages:
            self.pages.free(page, lease.lease_id)
        self.pages.unpin_many(lease.device_pages)

    def _end(self, lease: Lease) -> None:
        """Forget a lease (commit or release) and wake the lookups and reservations waiting."""
        del self._leases[lease.lease_id]
        for key in lease.keys[lease.num_device_pages:]:
            if self._writing.get(key) == lease.lease_id:
                del self._writing[key]
        self._changed.notify_all()

    def _fits_once_held_pages_return(self, ask: ReserveAsk) -> bool:
        """Whether ``ask`` would fit if every lease but quarantine ones ended and every offload
        pin dropped: only then is waiting worth it."""
        need = -(-int(ask.tokens.size) // self.page_size) - len(self.pages.match(ask.keys))
        held = self._num_leased() + self.pages.num_pinned()
        return need <= self.pages.num_free + self.pages.num_evictable + held

    def _num_leased(self) -> int:
        return sum(len(lease.exclusive_pages) for lease in self._leases.values()
                   if not lease.quarantined)
