"""KVCacheManager: the owner process's KV-cache lifecycle (lookup -> allocate -> onboard ->
compute -> commit -> offload -> offload_done). The ``Offloader`` that puts committed pages into
the host store and reaps the puts lives in ``kvlifecycle.offload_worker``.

Call order for one request (ARCHITECTURE.md)::

    hit   = mgr.lookup(user_id, token_ids)              # LookupResult; never raises for the store
    lease = mgr.allocate(user_id, token_ids, hit)       # Lease; may raise PoolExhausted
    lease = mgr.onboard(lease)                          # host -> device; failures shrink cached_len
    ... compute reads [0, lease.cached_len) and writes [lease.cached_len, num_tokens) ...
    items = mgr.commit(lease.lease_id)                  # list[OffloadItem], pinned for offload
    # or mgr.abort(lease.lease_id); a lease not committed in ttl_s expires (expire_leases)
    offloader.launch(hit.namespace, token_ids, items); offloader.reap()  ->  mgr.offload_done(page_ids, ok)

and for a batch of requests (one table lock per step for the whole batch; per-request outcomes,
never one exception for the batch)::

    hits   = mgr.lookup_many([(user_id, token_ids), ...])   # list[LookupResult]
    leases = mgr.allocate_many(hits)                        # list[Lease | PoolExhausted]
    done   = mgr.commit_many(lease_ids)                     # list[Committed]

Onboarding off the caller's critical path (the ensemble's owner): ``onboard_start_many`` marks
each lease with onboard pages ``onboarding`` and returns at once, without asking the store.
``poll_onboards`` (the owner's housekeeping thread calls it while any is in flight,
``housekeeping.py``) asks the store for each new one (``get_prefix_async``: one round trip) and
settles each one when its copy ends (a store poll that returns when one does), or as a timeout
``onboard_wait_s`` after its start; ``onboard_result`` says whether a lease's onboard is settled,
and how (the consumer of its pages asks before it reads them)::

    leases = mgr.onboard_start_many(leases)   # in flight: lease.onboarding; others settled now
    mgr.poll_onboards(wait_s=0.02)            # repeatedly, until onboards_in_flight() == 0
    lease  = mgr.onboard_result(lease_id)     # None while in flight; Lease, or LeaseGone

The request's namespace, page keys and token ids are fixed once, by ``lookup``: the
``LookupResult`` carries them into ``allocate``, the lease keeps them, and ``commit`` returns the
namespace with the pages to offload. Nothing after ``lookup`` hashes the chain again.

Promises:
- Content addressing (invariant 2 of docs/ARCHITECTURE.md): pages are found only by chain keys over the
  whole prefix and the namespace (``kvlifecycle.hashing``); a changed history or namespace
  misses from the first differing page on.
- Page safety (invariant 3) lives in ``kvlifecycle.leases.LeaseTable`` (over
  ``kvlifecycle.page_table.PageTable``); this class only computes keys and talks to the store,
  never holding the table's lock during I/O.
- Fail open (invariant 6): a store error or timeout in ``lookup`` is a miss and in ``onboard``
  a recompute; both are counted in ``stats()`` and logged, never raised.

Host store: any object with the ``kvlifecycle.store.HostStoreClient`` methods used here
(``get_prefix_async``, ``put_async``, ``wait``, ``try_wait``, ``cancel``), or None
(device cache only, nothing offloaded).

Lookup takes the request's page chain from ``PrefixKeys`` (which hashes only the pages a user's
history added since its last request) and walks the committed table until the first miss:
O(pages) dictionary probes. The per-user memory there is a hashing shortcut, never an index of
what is cached: a page is found only by its chain key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvlifecycle.hashing import PrefixKeys, TokenIds, page_keys, tokens_as_int64
from kvlifecycle.leases import LEASE_TTL_S, OFFLOAD_TTL_S, Lease, LeaseTable, ReserveAsk
from kvlifecycle.page_table import Committed, OffloadItem, PoolExhausted
from kvlifecycle.pool import PoolSpec, slots_for_pages
from kvlifecycle.rpc import TIMEOUTS
from kvlifecycle.stats_keys import DEVICE_HIT, HOST_HIT, MISS, lookups_key
from kvlifecycle.store.api import Status

if TYPE_CHECKING:
    from kvlifecycle.store.api import HostStoreClient

logger = logging.getLogger(__name__)

__all__ = [
    "Committed",
    "KVCacheManager",
    "Lease",
    "LeaseGone",
    "LookupResult",
    "OffloadItem",
    "PoolExhausted",
]


# The fewest full pages beyond the device prefix worth asking the host store about (at the
# onboard's launch). Asking is a round trip to the store process (about
# 0.6 ms on the H200 host); recomputing one page of a device hit (a user's next request, whose last
# page was not full before) costs far less on any device.
MIN_HOST_PAGES = 2


@dataclass(frozen=True, eq=False)
class LookupResult:
    """Where a request's prefix is cached. ``device_tokens`` are on device now (committed
    pages ``device_pages``); ``host_tokens`` follow them in the host store. Both are whole
    pages. ``outcome`` is ``host_hit`` when onboarding is needed, else ``device_hit`` or
    ``miss``. ``namespace``, ``tokens`` and ``keys`` are the request's, fixed here once and
    carried into its lease by ``allocate``."""

    user_id: int
    namespace: str
    tokens: np.ndarray  # int64 [num_tokens]
    keys: tuple[bytes, ...]  # chain keys of the full pages of ``tokens`` in ``namespace``
    device_tokens: int
    host_tokens: int
    device_pages: tuple[int, ...]
    host_unconfirmed: bool = False  # host_tokens are candidates the store was not asked about yet

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def cached_tokens(self) -> int:
        return self.device_tokens + self.host_tokens

    @property
    def outcome(self) -> str:
        if self.host_tokens:
            return HOST_HIT
        return DEVICE_HIT if self.device_tokens else MISS


class KVCacheManager:
    """Owner-process state of the device KV cache; see the module docstring.

    ``lease_ttl_s``: a lease not committed or aborted by then returns its pages (must exceed
    the slowest compute). ``offload_ttl_s``: likewise for offload pins. ``onboard_wait_s``:
    how long an onboard waits for the host store's copy before recomputing instead.
    ``min_host_pages``: the host store is asked only when at least this many full pages follow
    the device prefix (``MIN_HOST_PAGES``). ``pool_wait_s``: how long a request the pool cannot hold now
    waits for pages other requests or offloads in flight still hold, before ``PoolExhausted``
    (0: fail at once). ``onboard_by_reader``: where the store's DRAM tier is shared
    (``store.slab``), ``onboard_start_many`` hands each onboard to the process that reads the pages
    (it copies them from the slab itself) instead of starting a store copy."""

    def __init__(self, pool_spec: PoolSpec, namespace: str, store: "HostStoreClient | None" = None,
                 *, offload: bool | None = None, lease_ttl_s: float = LEASE_TTL_S,
                 offload_ttl_s: float = OFFLOAD_TTL_S, onboard_wait_s: float = TIMEOUTS.onboard_wait_s,
                 min_host_pages: int = MIN_HOST_PAGES, pool_wait_s: float = 0.0,
                 onboard_by_reader: bool = False, clock: Callable[[], float] = time.monotonic) -> None:
        if not namespace:
            raise ValueError("KVCacheManager.namespace: expected a non-empty model fingerprint, got ''")
        self.spec = pool_spec
        self.namespace = namespace
        self.store = store
        self.offload_enabled = store is not None if offload is None else offload
        self.lease_ttl_s = lease_ttl_s
        self.onboard_wait_s = onboard_wait_s
        self.min_host_pages = min_host_pages
        self.pool_wait_s = pool_wait_s
        self.onboard_by_reader = onboard_by_reader
        self.clock = clock
        self.keys = PrefixKeys(pool_spec.page_size)  # a request hashes only the pages its history added
        self.leases = LeaseTable(pool_spec.num_pages, pool_spec.page_size,
                                 offload_ttl_s=offload_ttl_s, clock=clock)
        # Onboards started by onboard_start_many and not settled yet: lease id -> (store task,
        # deadline). Filled by the caller's thread, settled by the one calling poll_onboards.
        self._in_flight: dict[int, tuple[int, float]] = {}
        self._in_flight_lock = threading.Lock()

    @property
    def page_size(self) -> int:
        return self.spec.page_size

    # -- public API ---------------------------------------------------------------------

    def lookup(self, user_id: int, token_ids: TokenIds) -> LookupResult:
        """The cached prefix of ``token_ids``: device pages, then the host store's candidates
        (see ``lookup_many``)."""
        return self.lookup_many([(user_id, token_ids)])[0]

    def use_namespace(self, namespace: str) -> None:
        """Look up and make leases in ``namespace`` from now on (a new model version serves).
        Leases already made keep theirs; the old namespace's pages are never found again and age
        out of the pool through the LRU."""
        if not namespace:
            raise ValueError("KVCacheManager.use_namespace: expected a non-empty model fingerprint, got ''")
        self.namespace = namespace

    def lookup_many(self, requests: Sequence[tuple[int, TokenIds]]) -> list[LookupResult]:
        """``lookup`` of each ``(user_id, token_ids)``: one table lock for every device match.

        The host store is not asked here. The pages after the device prefix that the store may
        hold (``store.may_hold``: its published filter of held keys, read without a round trip)
        are candidates (``host_unconfirmed``) when there are at least ``min_host_pages`` of them:
        ``allocate_many`` reserves them as onboard pages and the onboard's launch asks the store
        to copy the ones it holds, in one round trip instead of a match here and a get there.
        Such a lookup's outcome is counted then; the others' are counted here (a request the
        filter kept from asking is a miss or a device hit, computed with the batch).

        Never waits: pages another request is still writing are not found (see
        ``kvlifecycle.leases``, "Uncommitted prefixes")."""
        tokens = [tokens_as_int64(token_ids) for _, token_ids in requests]
        chains = [self.keys.keys(user_id, t, self.namespace) for (user_id, _), t in zip(requests, tokens)]
        devices = self.leases.match_prefixes(chains)
        results = []
        for (user_id, _), request_tokens, keys, device in zip(requests, tokens, chains, devices):
            candidates = self.store is not None and len(keys) - len(device) >= self.min_host_pages
            may_hold = self.store.may_hold(keys[len(device):]) if candidates else 0
            if candidates and may_hold < self.min_host_pages:
                self.leases.count("host_filtered_lookups")
                candidates = False
            host_pages = len(device) + may_hold if candidates else 0
            results.append(LookupResult(
                user_id=int(user_id),
                namespace=self.namespace,
                tokens=request_tokens,
                keys=keys,
                device_tokens=len(device) * self.page_size,
                host_tokens=max(0, host_pages - len(device)) * self.page_size,
                device_pages=tuple(device),
                host_unconfirmed=candidates,
            ))
        for outcome, n in Counter(r.outcome for r in results if not r.host_unconfirmed).items():
            self.leases.count(lookups_key(outcome), n)
        return results

    def allocate(self, user_id: int, token_ids: TokenIds, hit: LookupResult | None = None,
                 ttl_s: float | None = None) -> Lease:
        """Reserve pages for the request under a new lease. The device prefix is matched again
        (it may have changed since ``hit``); host pages of ``hit`` beyond it are reserved for
        onboarding when there are at least ``min_host_pages`` of them (fewer, say device pages
        evicted since the lookup, are computed; with no store, every page is). With ``hit`` its
        keys are used as they are (``token_ids`` must be the same request's); without one (no
        lookup made) the keys are computed here. Raises ``PoolExhausted`` without changing
        anything."""
        if hit is None:
            hit = self._nothing_cached(int(user_id), tokens_as_int64(token_ids))
        elif hit.user_id != int(user_id) or hit.num_tokens != len(token_ids):
            raise ValueError(
                f"allocate: hit is for user {hit.user_id} with {hit.num_tokens} tokens, got "
                f"user {user_id} with {len(token_ids)} tokens"
            )
        result = self.allocate_many([hit], ttl_s)[0]
        if isinstance(result, PoolExhausted):
            raise result
        return result

    def allocate_many(self, hits: Sequence[LookupResult],
                      ttl_s: float | None = None) -> list[Lease | PoolExhausted]:
        """``allocate`` of each looked-up request, in order, under one table lock. A request the
        pool cannot hold gets its ``PoolExhausted`` in its place and changes nothing."""
        ttl = self.lease_ttl_s if ttl_s is None else ttl_s
        leases = self.leases.reserve_many([
            ReserveAsk(user_id=hit.user_id, namespace=hit.namespace, keys=hit.keys, tokens=hit.tokens,
                       host_pages=hit.cached_tokens // self.page_size if self.store is not None else 0, ttl_s=ttl,
                       host_unconfirmed=hit.host_unconfirmed, min_onboard_pages=self.min_host_pages)
            for hit in hits
        ], wait_s=self.pool_wait_s)
        for hit, lease in zip(hits, leases):
            # A lookup with unconfirmed host pages whose lease has none left to onboard ends here.
            if hit.host_unconfirmed and not (isinstance(lease, Lease) and lease.host_unconfirmed):
                device = lease.num_device_pages if isinstance(lease, Lease) else hit.device_tokens // self.page_size
                self.leases.count(lookups_key(DEVICE_HIT if device else MISS))
        return leases

    def onboard(self, lease: Lease, timeout_s: float | None = None) -> Lease:
        """Copy the host-hit pages into the reserved pages and wait. On any store failure the
        pages not copied become pages to compute: the returned lease's ``cached_len``
        shrinks (same page row). Raises ``LeaseGone`` when the lease was aborted meanwhile."""
        if lease.onboarded:
            return lease
        task = self.onboard_launch(lease.lease_id)
        return self.onboard_wait(lease.lease_id, task, timeout_s)

    def onboard_launch(self, lease_id: int) -> int | None:
        """Start the host -> device copy of a lease's onboard pages; returns the store task id,
        or None when there is nothing to copy (or the store refused: the pages are then
        recomputed once ``onboard_wait`` is called)."""
        lease = self.leases.get_lease(lease_id)
        if lease is None or not self.leases.begin_onboard(lease_id):
            return None
        return self._ask_store(lease)

    def _ask_store(self, lease: Lease) -> int | None:
        """``onboard_launch`` after ``begin_onboard``: one ``get_prefix_async``; the lease keeps
        the onboard pages the store copies; a lookup with unconfirmed host pages is counted."""
        if self.store is None or lease.abort_requested:
            return None
        lease_id = lease.lease_id
        start = lease.num_device_pages
        stop = start + lease.num_onboard_pages
        assert lease.tokens.size >= stop * self.page_size, (
            f"onboard_launch: lease {lease_id} expected its token ids (>= {stop * self.page_size}), "
            f"got {lease.tokens.size}"
        )
        try:  # one round trip: the store copies the onboard pages it holds, says how many it holds
            task, held = self.store.get_prefix_async(lease.tokens[: stop * self.page_size],
                                                     slots_for_pages(lease.onboard_pages, self.page_size),
                                                     lease.namespace, start)
        except Exception:
            logger.warning("host store get_prefix_async failed for lease %d; recomputing %d pages",
                           lease_id, lease.num_onboard_pages, exc_info=True)
            self.leases.count("store_errors")
            task, held = None, start
        copied = max(0, min(held, stop) - start)
        self.leases.onboard_launched(lease_id, task, copied)
        if lease.host_unconfirmed:
            self.leases.count(lookups_key(HOST_HIT if copied else DEVICE_HIT if start else MISS))
        return task

    def onboard_wait(self, lease_id: int, task: int | None,
                     timeout_s: float | None = None) -> Lease:
        """Finish an onboard started by ``onboard_launch`` and return the final lease."""
        statuses = {} if task is None else self._wait(
            [task], self.onboard_wait_s if timeout_s is None else timeout_s)
        return self._settle_onboard(lease_id, task, statuses.get(task))

    def onboard_start_many(self, leases: Sequence[Lease | PoolExhausted]
                           ) -> list[Lease | PoolExhausted | LeaseGone]:
        """Start the onboard of each lease of a batch and return without asking the store: a
        lease with onboard pages comes back ``onboarding``, all of them still claimed (its
        onboard pages may not be read until ``onboard_result`` returns it settled, with the
        ones not copied turned into pages to compute). ``poll_onboards`` asks the store (one
        round trip each, on the poller's thread) and settles them. A lease that cannot start
        (no store, aborted) is settled here. Other entries (``PoolExhausted``) stay in their place."""
        out: list[Lease | PoolExhausted | LeaseGone] = []
        for lease in leases:
            if not isinstance(lease, Lease) or lease.onboarded:
                out.append(lease)
                continue
            if self.onboard_by_reader and self.store is not None and self.store.slab is not None:
                out.append(self._hand_to_reader(lease))
                continue
            if self.store is None or not self.leases.begin_onboard(lease.lease_id):
                try:
                    out.append(self._settle_onboard(lease.lease_id, None, None))
                except (LeaseGone, PoolExhausted) as e:
                    out.append(e)
                continue
            with self._in_flight_lock:  # task None: the store is not asked yet
                self._in_flight[lease.lease_id] = (None, self.clock() + self.onboard_wait_s)
            out.append(self.leases.get_lease(lease.lease_id) or LeaseGone(
                f"onboard_start_many: lease {lease.lease_id} was aborted during its start"))
        return out

    def _hand_to_reader(self, lease: Lease) -> Lease | LeaseGone:
        """``onboard_start_many`` where the store's DRAM tier is shared: the lease is settled with
        its onboard pages, which the reader copies from the slab or computes (``reader_onboard_keys``
        says which keys they hold)."""
        settled = self.leases.hand_onboard_to_reader(lease.lease_id)
        if settled is None:
            return LeaseGone(f"onboard_start_many: lease {lease.lease_id} was aborted during its start")
        if lease.host_unconfirmed:  # the key filter says the store may hold them: counted as a host hit
            self.leases.count(lookups_key(HOST_HIT))
        return settled

    def reader_onboard_keys(self, lease_ids: Sequence[int]) -> list[tuple[bytes, ...]]:
        """The page keys of each lease's onboard pages that its reader copies (``_hand_to_reader``);
        empty for a lease without."""
        out = []
        for lease_id in lease_ids:
            lease = self.leases.get_lease(lease_id)
            if lease is None or not lease.onboard_by_reader:
                out.append(())
            else:
                out.append(lease.keys[lease.num_device_pages: lease.num_device_pages + lease.num_onboard_pages])
        return out

    def reader_copied(self, lease_ids: Sequence[int], pages: Sequence[int]) -> int:
        """The reader's report (``kvlifecycle.commit_channel``): it copied the first ``pages[i]``
        onboard pages of lease ``lease_ids[i]`` from the store, so their commit does not offload
        them again. Returns how many leases took it."""
        return self.leases.reader_copied(lease_ids, pages)

    def onboards_in_flight(self) -> int:
        with self._in_flight_lock:
            return len(self._in_flight)

    def poll_onboards(self, now: float | None = None, wait_s: float = 0.0) -> list[int]:
        """Ask the store for the onboards started since the last poll (``get_prefix_async``
        each: a lease whose store holds none of its onboard pages is settled at once), then
        settle the in-flight onboards whose copy ended (one store ``try_wait`` for all of them,
        which returns once one copy ended or after ``wait_s``, never past the nearest deadline)
        or whose deadline passed (a timeout: the copy is cancelled, and its pages are
        quarantined while it may still write). Returns the lease ids settled."""
        with self._in_flight_lock:
            pending = dict(self._in_flight)
        if not pending:
            return []
        now = self.clock() if now is None else now
        settled = []
        for lease_id, (task, deadline) in list(pending.items()):
            if task is not None:
                continue
            lease = self.leases.get_lease(lease_id)
            task = self._ask_store(lease) if lease is not None and now < deadline else None
            if task is None:  # nothing to copy, refused, gone or late: those pages are computed
                self._settle_started(lease_id, None, None)
                settled.append(lease_id)
                del pending[lease_id]
                continue
            with self._in_flight_lock:
                self._in_flight[lease_id] = pending[lease_id] = (task, deadline)
        if not pending:
            return settled
        try:
            wait_s = min(wait_s, min(deadline for _, deadline in pending.values()) - now)
            statuses = self.store.try_wait([task for task, _ in pending.values()], wait_s=max(0.0, wait_s))
            if wait_s > 0:
                now = self.clock()
        except Exception:
            logger.warning("host store try_wait failed for onboards of leases %s", list(pending), exc_info=True)
            self.leases.count("store_errors")
            statuses = {}
        for lease_id, (task, deadline) in pending.items():
            status = Status(statuses.get(task, Status.UNREADY))
            if not status.done and now < deadline:
                continue
            self._settle_started(lease_id, task, status if status.done else Status.TIMEOUT)
            settled.append(lease_id)
        return settled

    def _settle_started(self, lease_id: int, task: int | None, status: Status | None) -> None:
        """Settle an onboard of ``onboard_start_many`` and forget it."""
        try:
            self._settle_onboard(lease_id, task, status)
        except (LeaseGone, PoolExhausted):
            pass  # aborted meanwhile, or no fresh pages: the lease is released; onboard_result says so
        with self._in_flight_lock:
            del self._in_flight[lease_id]

    def onboard_result(self, lease_id: int) -> Lease | LeaseGone | None:
        """None while the lease's onboard (from ``onboard_start_many``) is in flight; then the
        lease (its ``cached_len`` and ``page_row`` final: a failed copy shrank the one, a
        quarantine changed the other), or ``LeaseGone`` when it was aborted or expired."""
        with self._in_flight_lock:
            if lease_id in self._in_flight:
                return None
        lease = self.leases.get_lease(lease_id)
        if lease is None:
            return LeaseGone(f"lease {lease_id} is unknown (aborted, expired, or its onboard found no fresh pages)")
        return lease

    def commit(self, lease_id: int) -> list[OffloadItem]:
        """Make the lease's new full pages visible; returns those to offload (pinned until
        ``offload_done``). An unknown (expired/aborted) lease commits nothing: []."""
        return list(self.commit_many([lease_id])[0].items)

    def commit_many(self, lease_ids: Sequence[int]) -> list[Committed]:
        """``commit`` of each lease, under one table lock. Each ``Committed`` names the lease's
        namespace (the one its keys were made in) with its pages to offload; an unknown lease
        commits nothing (no items)."""
        out = []
        for lease_id, committed in zip(lease_ids, self.leases.commit_many(lease_ids, offload=self.offload_enabled)):
            if committed is None:
                logger.warning("commit of unknown lease %d (expired or aborted); nothing cached", lease_id)
                committed = Committed(lease_id, self.namespace, ())
            out.append(committed)
        return out

    def abort(self, lease_id: int) -> bool:
        """Return every page of the lease; False when it is unknown."""
        return self.leases.abort(lease_id)

    def expire_leases(self, now: float | None = None) -> list[int]:
        """Release expired leases and offload pins, and quarantined pages whose store task
        finished. Returns the expired lease ids."""
        expired = self.leases.expire(now)
        self._reap_quarantine()
        return expired

    def offload_done(self, page_ids: Sequence[int], ok: bool) -> int:
        """Drop the offload pins of ``page_ids``; ``ok`` records them as held by the host."""
        return self.leases.offload_done(page_ids, ok)

    def stats(self) -> dict[str, int]:
        return self.leases.stats()

    def check_invariants(self) -> None:
        self.leases.check_invariants()

    # -- helpers ------------------------------------------------------------------------

    def _wait(self, tasks: list[int], timeout_s: float) -> dict[int, Status]:
        """Each task's status, from one store ``wait``; TIMEOUT for every task when the wait
        itself failed (the copies may still run: their pages are quarantined)."""
        try:
            statuses = self.store.wait(tasks, timeout_s)
        except Exception:
            logger.warning("host store wait failed for tasks %s", tasks, exc_info=True)
            self.leases.count("store_errors")
            return {task: Status.TIMEOUT for task in tasks}
        return {task: Status(statuses.get(task, Status.FAILED)) for task in tasks}

    def _settle_onboard(self, lease_id: int, task: int | None, status: Status | None) -> Lease:
        """End a lease's onboard given its store task's final ``status`` (None: no task)."""
        lease = self.leases.get_lease(lease_id)
        if lease is None:
            raise LeaseGone(f"onboard_wait: lease {lease_id} is unknown (aborted or expired)")
        if lease.onboarded or not lease.onboarding:
            return self._finish(lease_id, 0, None)
        ok_pages, in_flight = 0, None
        if task is not None:
            if status is Status.SUCCESS:
                ok_pages = lease.num_onboard_pages
            elif not status.done:  # TIMEOUT or UNREADY: the copy may still run
                in_flight = task
                self._cancel(task)
                logger.warning("host store onboard of lease %d timed out; recomputing %d pages",
                               lease_id, lease.num_onboard_pages)
                self.leases.count("store_timeouts")
            else:
                logger.warning("host store onboard of lease %d ended %s; recomputing %d pages",
                               lease_id, status, lease.num_onboard_pages)
                self.leases.count("store_errors" if status is Status.FAILED else "onboard_misses")
        return self._finish(lease_id, ok_pages, in_flight)

    def _nothing_cached(self, user_id: int, tokens: np.ndarray) -> LookupResult:
        """The LookupResult of a request allocated without a lookup: nothing cached claimed."""
        return LookupResult(user_id=user_id, namespace=self.namespace, tokens=tokens,
                            keys=tuple(page_keys(tokens, self.namespace, self.page_size)),
                            device_tokens=0, host_tokens=0, device_pages=())

    def _cancel(self, task: int) -> None:
        try:
            self.store.cancel([task])
        except Exception:
            logger.warning("host store cancel failed for task %s", task, exc_info=True)

    def _finish(self, lease_id: int, ok_pages: int, in_flight: object) -> Lease:
        lease = self.leases.finish_onboard(lease_id, ok_pages, in_flight)
        if lease is None:
            raise LeaseGone(f"onboard: lease {lease_id} was aborted during the onboard")
        return lease

    def _reap_quarantine(self) -> None:
        tasks = self.leases.quarantined_tasks()
        if not tasks or self.store is None:
            return
        try:
            statuses = self.store.try_wait(tasks)
        except Exception:
            logger.warning("host store try_wait failed for quarantined tasks", exc_info=True)
            return
        for task in tasks:
            status = Status(statuses.get(task, Status.UNREADY))
            if status.done:
                freed = self.leases.release_quarantine(task)
                logger.info("store task %s ended %s; %d quarantined pages freed", task, status, freed)


class LeaseGone(RuntimeError):
    """The lease was aborted or expired while the caller still used it."""
