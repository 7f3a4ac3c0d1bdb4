"""Scenarios of the KV-cache lifecycle on a tiny pool (8 pages of 4 tokens)."""

import threading

import pytest
import torch

from kvlifecycle.hashing import page_keys
from kvlifecycle.leases import Lease
from kvlifecycle.manager import KVCacheManager, LeaseGone
from kvlifecycle.offload_worker import Offloader
from kvlifecycle.page_table import PoolExhausted

from ..helpers import wait_for
from .kvl_fakes import FakeStore

S = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(pool):
    return FakeStore(pool.tensor, S)


@pytest.fixture
def mgr(tiny_spec, clock):
    m = KVCacheManager(tiny_spec, "ns", None, clock=clock, lease_ttl_s=10.0, offload_ttl_s=20.0)
    yield m
    m.check_invariants()


@pytest.fixture
def smgr(tiny_spec, store, clock):
    m = KVCacheManager(tiny_spec, "ns", store, clock=clock, lease_ttl_s=10.0, offload_ttl_s=20.0)
    yield m
    m.check_invariants()


def serve(m, user, tokens):
    """lookup -> allocate -> onboard -> commit; returns (lease, offload items)."""
    alloc = m.onboard(m.allocate(user, tokens, m.lookup(user, tokens)))
    return alloc, m.commit(alloc.lease_id)


def baseline_ok(m):
    s = m.stats()
    assert (s["pages_leased"], s["pages_pinned"], s["leases_active"]) == (0, 0, 0), s
    assert s["pages_free"] + s["pages_committed"] == s["pages_total"], s


@pytest.mark.parametrize("n,pages,full,partial", [
    (0, 0, 0, False),
    (1, 1, 0, True),
    (4, 1, 1, False),
    (6, 2, 1, True),
    (32, 8, 8, False),  # the whole pool
])
def test_allocate_shapes(mgr, n, pages, full, partial):
    alloc = mgr.allocate(1, list(range(n)))
    assert len(alloc.page_row) == pages and len(set(alloc.page_row)) == pages
    assert new_full_pages(alloc) == full
    assert (alloc.partial_page is not None) == partial
    assert alloc.cached_len == 0 and alloc.new_tokens == n
    mgr.check_invariants()
    mgr.commit(alloc.lease_id)
    assert mgr.stats()["pages_committed"] == full
    baseline_ok(mgr)


def test_second_request_hits_the_committed_prefix_and_pins_it(mgr):
    history = list(range(10))
    serve(mgr, 1, history)  # 2 full pages committed, partial freed
    hit = mgr.lookup(1, history + [10, 11])
    assert (hit.outcome, hit.device_tokens, hit.host_tokens) == ("device_hit", 8, 0)

    alloc = mgr.allocate(1, history + [10, 11], hit)
    assert alloc.cached_len == 8 and alloc.device_pages == hit.device_pages
    assert mgr.stats()["pages_pinned"] == 2  # readers pin the prefix while compute runs
    mgr.commit(alloc.lease_id)
    assert mgr.stats()["pages_committed"] == 3
    baseline_ok(mgr)


def test_pinned_prefix_is_not_evicted_and_exhaustion_changes_nothing(mgr):
    serve(mgr, 1, list(range(16)))  # 4 pages committed
    reader = mgr.allocate(1, list(range(16)) + [99])  # pins 4, leases 1
    before = mgr.stats()
    with pytest.raises(PoolExhausted, match="need 4 free pages .* 3 are free and 0 evictable"):
        mgr.allocate(2, list(range(100, 116)))
    after = mgr.stats()
    assert {k: v for k, v in after.items() if k != "pool_exhausted"} == {
        k: v for k, v in before.items() if k != "pool_exhausted"}
    mgr.check_invariants()

    mgr.commit(reader.lease_id)  # pins dropped: now the LRU pages are evictable
    alloc = mgr.allocate(2, list(range(100, 120)))  # 5 pages: 4 free + 1 evicted
    assert mgr.stats()["evictions"] == 1
    mgr.abort(alloc.lease_id)
    baseline_ok(mgr)


def test_eviction_takes_leaves_before_their_prefix(mgr):
    serve(mgr, 1, list(range(16)))  # chain of 4 pages
    mgr.allocate(2, list(range(100, 120)))  # needs 5 pages: 4 free + 1 evicted
    assert mgr.lookup(1, list(range(16))).device_tokens == 12  # the last page went first


def test_pages_of_a_lease_are_invisible_until_commit(mgr):
    tokens = list(range(8))
    alloc = mgr.allocate(1, tokens)
    assert mgr.lookup(2, tokens).outcome == "miss"
    mgr.commit(alloc.lease_id)
    assert mgr.lookup(2, tokens).outcome == "device_hit"


def test_concurrent_duplicate_commit_keeps_the_first_page(mgr):
    tokens = list(range(8))
    a = mgr.allocate(1, tokens)
    b = mgr.allocate(2, tokens)  # both miss: both compute the same pages
    mgr.commit(a.lease_id)
    mgr.commit(b.lease_id)
    assert mgr.lookup(3, tokens).device_pages == a.page_row
    s = mgr.stats()
    assert s["duplicate_pages"] == 2 and s["pages_committed"] == 2
    baseline_ok(mgr)


@pytest.mark.parametrize("how", ["abort", "expire"])
def test_abort_and_expiry_return_every_page(mgr, clock, how):
    serve(mgr, 1, list(range(8)))
    alloc = mgr.allocate(1, list(range(13)))
    assert mgr.stats()["pages_in_use"] == 2 + 2
    if how == "abort":
        assert mgr.abort(alloc.lease_id) is True
        assert mgr.abort(alloc.lease_id) is False
    else:
        clock.now = 9.9
        assert mgr.expire_leases() == []
        clock.now = 10.0
        assert mgr.expire_leases() == [alloc.lease_id]
    assert mgr.commit(alloc.lease_id) == []  # too late: nothing cached, nothing raised
    assert mgr.stats()["pages_in_use"] == 2
    baseline_ok(mgr)


@pytest.mark.parametrize("k", [0, 5, 8, 15])
def test_rewritten_history_reads_only_pages_before_the_change(mgr, k):
    history = list(range(16))
    serve(mgr, 1, history)
    rewritten = list(history)
    rewritten[k] = 999
    assert mgr.lookup(1, rewritten).device_tokens == (k // S) * S


def test_changed_namespace_never_hits(tiny_spec, pool, store):
    a = KVCacheManager(tiny_spec, "weights-a", store)
    b = KVCacheManager(tiny_spec, "weights-b", store)
    tokens = list(range(12))
    _, items = serve(a, 1, tokens)
    Offloader(store, S, a.offload_done).launch("weights-a", tokens, items)
    assert a.lookup(1, tokens).cached_tokens == 12 and store.pages
    lease = b.onboard(b.allocate(1, tokens, b.lookup(1, tokens)))  # the onboard asks the store
    assert lease.cached_len == 0 and b.stats()["lookups_miss"] == 1


def test_offload_pins_until_done_and_only_new_pages(smgr, store):
    tokens = list(range(10))
    alloc, items = serve(smgr, 1, tokens)
    assert [(it.page_id, it.prefix_len) for it in items] == [(alloc.page_row[0], 4), (alloc.page_row[1], 8)]
    assert smgr.stats()["pages_offload_pending"] == 2 and smgr.stats()["pages_pinned"] == 2

    offloader = Offloader(store, S, smgr.offload_done)
    offloader.launch("ns", tokens, items)
    assert smgr.stats()["pages_offload_pending"] == 2  # launched, not reaped yet
    assert offloader.reap() == 1 and offloader.pending == 0
    assert smgr.stats()["pages_offload_pending"] == 0
    baseline_ok(smgr)

    _, again = serve(smgr, 1, tokens + [10, 11, 12, 13])
    assert [it.prefix_len for it in again] == [12]  # pages already offloaded are not offloaded again


def test_a_reap_reports_every_finished_put_in_one_call(smgr, store):
    """Two users' puts reaped together: their pages reach the owner in one ``done`` call (one
    control round trip per reap in kv_offload, not one per put), each page once."""
    calls = []
    offloader = Offloader(store, S, lambda ids, ok: calls.append((sorted(ids), ok)) or smgr.offload_done(ids, ok))
    pages = []
    for user in (1, 2):
        tokens = list(range(100 * user, 100 * user + 8))
        _, items = serve(smgr, user, tokens)
        offloader.launch("ns", tokens, items)
        pages += [it.page_id for it in items]

    assert offloader.reap() == 2 and offloader.pending == 0
    assert calls == [(sorted(pages), True)]
    assert smgr.stats()["pages_offload_pending"] == 0
    baseline_ok(smgr)


@pytest.mark.parametrize("reported", [None, 0, 2, 3])
def test_a_readers_onboard_pages_it_reported_copied_are_not_offloaded_again(tiny_spec, store, clock, reported):
    """A host hit handed to the reader (hstu_compute copies from the store's shared slab): the
    onboard pages it reports copied are in the store, so the commit offloads only the others;
    unreported, it offloads them all (the store skips the keys it holds)."""
    tokens = list(range(14))  # 3 full pages and a partial one
    offloader = Offloader(store, S, lambda ids, ok: 0)
    first = KVCacheManager(tiny_spec, "ns", store, clock=clock)
    _, items = serve(first, 1, tokens)
    offloader.launch("ns", tokens, items)
    assert offloader.reap() == 1
    store.slab = object()  # a store whose DRAM tier is shared (the reader's copy is not run here)
    m = KVCacheManager(tiny_spec, "ns", store, clock=clock, onboard_by_reader=True)  # another pool: a host hit
    [lease] = m.onboard_start_many([m.allocate(2, tokens, m.lookup(2, tokens))])
    assert lease.onboard_by_reader and lease.num_onboard_pages == 3 and len(m.reader_onboard_keys([lease.lease_id])[0]) == 3
    if reported is not None:
        assert m.reader_copied([lease.lease_id, 999], [reported, 1]) == 1  # an unknown lease ignores it
    offloaded = [it.prefix_len // S - 1 for it in m.commit(lease.lease_id)]  # page positions
    assert offloaded == list(range(reported or 0, 3))


def test_offload_pin_expires_when_offloader_dies(smgr, clock):
    _, items = serve(smgr, 1, list(range(8)))
    clock.now = 20.0
    smgr.expire_leases()
    assert smgr.stats()["offload_pins_expired"] == 2
    assert smgr.offload_done([it.page_id for it in items], True) == 0  # late: ignored
    baseline_ok(smgr)


def fill_host(smgr, store, tokens, value=7.0):
    """Commit + offload ``tokens``, then evict them from the device (host-only)."""
    alloc, items = serve(smgr, 1, tokens)
    for page in alloc.page_row[: len(tokens) // S]:
        store.pool[:, page] = value
    offloader = Offloader(store, S, smgr.offload_done)
    offloader.launch("ns", tokens, items)
    assert offloader.reap() == 1
    evictor = smgr.allocate(9, list(range(500, 532)))  # evicts everything
    smgr.abort(evictor.lease_id)


def test_host_hit_is_onboarded(smgr, store):
    tokens = list(range(12))
    fill_host(smgr, store, tokens)
    hit = smgr.lookup(1, tokens + [1, 2])
    assert (hit.outcome, hit.device_tokens, hit.host_tokens) == ("host_hit", 0, 12)
    alloc = smgr.allocate(1, tokens + [1, 2], hit)
    assert not alloc.onboarded and len(alloc.onboard_pages) == 3
    alloc = smgr.onboard(alloc)
    assert alloc.onboarded and alloc.cached_len == 12
    assert all(torch.all(store.pool[:, p] == 7.0) for p in alloc.onboard_pages)
    assert smgr.commit(alloc.lease_id) == []  # onboarded pages are in the host already
    assert smgr.lookup(1, tokens).outcome == "device_hit"
    s = smgr.stats()
    assert s["lookups_host_hit"] == 1 and s["onboarded_pages"] == 3


@pytest.mark.parametrize("min_host_pages,host_tokens", [(2, 0), (1, S)])
def test_host_store_is_asked_only_for_min_host_pages_beyond_the_device_prefix(smgr, store, min_host_pages,
                                                                           host_tokens):
    """A device hit one page short of the host's prefix recomputes that page by default: a store
    round trip costs more than one page of compute."""
    tokens = list(range(12))
    fill_host(smgr, store, tokens)  # 3 pages on the host, none on the device
    serve(smgr, 1, tokens[:8])  # 2 of them onboarded: the device holds pages 1-2
    smgr.min_host_pages = min_host_pages
    hit = smgr.lookup(1, tokens + [1, 2])
    assert (hit.device_tokens, hit.host_tokens) == (8, host_tokens)


LOOKUP_COUNTERS = ("lookups_device_hit", "lookups_host_hit", "lookups_miss", "onboard_failed_pages", "store_errors")


def counted(m, before):
    """The lookup counters that moved since ``before`` (a stats() dict)."""
    now = m.stats()
    return {k: now[k] - before[k] for k in LOOKUP_COUNTERS if now[k] != before[k]}


def test_lookup_with_unconfirmed_host_pages_onboards_the_candidates_the_store_holds_in_one_call(smgr, store):
    """The serving path: lookup does not ask the store; the onboard's launch does (one call) and
    keeps the candidate pages the store holds, here 2 of the history's 4 full pages."""
    fill_host(smgr, store, list(range(8)))  # pages 0-1 on the host only
    history = list(range(8)) + list(range(100, 110))  # 4 full pages and 2 tokens
    before = smgr.stats()
    hit = smgr.lookup(1, history)
    assert hit.host_unconfirmed and (hit.device_tokens, hit.host_tokens) == (0, 16)
    lease = smgr.onboard(smgr.allocate(1, history, hit))
    assert (lease.cached_len, len(lease.onboard_pages), new_full_pages(lease)) == (8, 2, 2)
    assert all(torch.all(store.pool[:, p] == 7.0) for p in lease.onboard_pages)
    assert counted(smgr, before) == {"lookups_host_hit": 1}  # counted once, when the store answered
    assert len(smgr.commit(lease.lease_id)) == 2  # only the pages the store lacked are offloaded
    smgr.check_invariants()


@pytest.mark.parametrize("case,device_pages,outcome", [
    ("nothing stored", 0, {"lookups_miss": 1}),
    ("device prefix only", 2, {"lookups_device_hit": 1}),
    ("store down", 0, {"lookups_miss": 1, "store_errors": 1}),
])
def test_lookup_with_unconfirmed_host_pages_the_store_cannot_serve_recomputes_and_counts_no_failure(smgr, store, case, device_pages,
                                                                              outcome):
    history = list(range(16))
    if device_pages:
        serve(smgr, 1, history[: device_pages * S])
    if case == "store down":
        store.raise_on.add("get_prefix_async")
    before = smgr.stats()
    lease = smgr.onboard(smgr.allocate(1, history, smgr.lookup(1, history)))
    assert (lease.cached_len, lease.new_tokens) == (device_pages * S, 16 - device_pages * S), case
    assert counted(smgr, before) == outcome, case
    assert len(smgr.commit(lease.lease_id)) == 4 - device_pages, "the recomputed pages are offloaded"
    smgr.check_invariants()


def test_lookup_with_unconfirmed_host_pages_refused_by_a_full_pool_is_counted_once(smgr, store):
    before = smgr.stats()
    [refused] = smgr.allocate_many([smgr.lookup(1, list(range(4 * 64)))])
    assert isinstance(refused, PoolExhausted)
    assert counted(smgr, before) == {"lookups_miss": 1}


@pytest.mark.parametrize("failure,counter", [
    ("FAILED", "store_errors"),
    ("NOTFOUND", "onboard_misses"),
    ("raise", "store_errors"),
])
def test_onboard_failure_downgrades_to_recompute(smgr, store, failure, counter):
    tokens = list(range(12))
    fill_host(smgr, store, tokens)
    alloc = smgr.allocate(1, tokens, smgr.lookup(1, tokens))
    if failure == "raise":
        store.raise_on.add("get_async")
    else:
        store.get_status = failure
    done = smgr.onboard(alloc)
    assert done.page_row == alloc.page_row
    assert (done.cached_len, done.new_tokens, new_full_pages(done)) == (0, 12, 3)
    assert smgr.stats()[counter] == 1
    assert len(smgr.commit(done.lease_id)) == 3  # recomputed pages are offloaded again
    smgr.check_invariants()


def test_onboard_timeout_quarantines_pages_until_the_store_task_ends(smgr, store):
    tokens = list(range(8))
    fill_host(smgr, store, tokens)
    alloc = smgr.allocate(1, tokens, smgr.lookup(1, tokens))
    store.get_status = "TIMEOUT"
    done = smgr.onboard(alloc)
    assert done.cached_len == 0
    assert not set(done.page_row) & set(alloc.onboard_pages)  # fresh pages to compute into
    s = smgr.stats()
    assert s["pages_quarantined"] == 2 and store.cancelled
    # the quarantine is no request's lease: only the request's own pages count as leased
    assert (s["leases_active"], s["pages_leased"]) == (1, len(done.page_row))
    smgr.check_invariants()
    smgr.expire_leases()
    assert smgr.stats()["pages_quarantined"] == 2  # the store may still write them
    store.finish(store.cancelled[-1])  # the onboard get
    smgr.expire_leases()
    assert smgr.stats()["pages_quarantined"] == 0
    smgr.abort(done.lease_id)
    baseline_ok(smgr)


def test_abort_during_onboard_is_deferred(smgr, store):
    tokens = list(range(8))
    fill_host(smgr, store, tokens)
    alloc = smgr.allocate(1, tokens, smgr.lookup(1, tokens))
    task = smgr.onboard_launch(alloc.lease_id)
    assert smgr.abort(alloc.lease_id) is True
    assert smgr.stats()["pages_leased"] == 2  # the store may be writing them
    assert smgr.expire_leases(now=1e9) == []
    with pytest.raises(LeaseGone):
        smgr.onboard_wait(alloc.lease_id, task)
    baseline_ok(smgr)


@pytest.mark.parametrize("broken", ["get_prefix_async", "wait"])
def test_store_down_fails_open(smgr, store, broken):
    tokens = list(range(8))
    fill_host(smgr, store, tokens)
    store.raise_on.add(broken)
    alloc, _ = serve(smgr, 1, tokens)
    assert alloc.cached_len == 0  # recomputed, nothing raised
    assert smgr.stats()["store_errors"] >= 1


def test_commit_before_onboard_is_a_caller_bug(smgr, store):
    tokens = list(range(8))
    fill_host(smgr, store, tokens)
    alloc = smgr.allocate(1, tokens, smgr.lookup(1, tokens))
    with pytest.raises(AssertionError, match="before its onboard"):
        smgr.commit(alloc.lease_id)


# -- a batch of requests: one lock per step, per-request outcomes, keys hashed once ----------


def test_a_batch_that_overflows_the_pool_fails_only_the_requests_that_do_not_fit(mgr):
    serve(mgr, 1, list(range(8)))  # 2 pages committed
    requests = [(1, list(range(8)) + [50, 51]),  # device hit: 1 new page
                (2, list(range(100, 124))),      # 6 pages: more than is left after the first
                (3, list(range(200, 204)))]      # 1 page
    before = mgr.stats()

    allocs = mgr.allocate_many(mgr.lookup_many(requests))

    first, too_big, small = allocs
    assert first.cached_len == 8 and isinstance(too_big, PoolExhausted) and small.cached_len == 0
    assert "user 2: need 6 free pages" in str(too_big)
    after = mgr.stats()
    assert after["allocations"] == before["allocations"] + 2 and after["pool_exhausted"] == 1
    assert after["lookups_device_hit"] == 1 and after["lookups_miss"] == 1 + 2  # serve's own miss, then 2
    mgr.check_invariants()
    done = mgr.commit_many([first.lease_id, small.lease_id])
    assert [c.lease_id for c in done] == [first.lease_id, small.lease_id]
    baseline_ok(mgr)


def test_lookup_hashes_only_the_pages_a_history_added_and_allocate_reuses_them(mgr, monkeypatch):
    import kvlifecycle.hashing as hashing

    hashed = []
    real = hashing._chain
    monkeypatch.setattr(hashing, "_chain", lambda *a: hashed.append(a) or real(*a))
    requests = [(1, list(range(10))), (2, list(range(20, 33)))]  # 2 and 3 full pages of S=4

    hits = mgr.lookup_many(requests)
    allocs = mgr.allocate_many(hits)
    mgr.commit_many([a.lease_id for a in allocs])
    assert len(hashed) == 5  # each full page once, at lookup; allocate and commit reuse the keys
    assert [h.keys for h in hits] == [tuple(page_keys(t, "ns", S)) for _, t in requests]

    grown = list(range(10)) + [7] * 8  # user 1's next request: 2 more full pages
    rewritten = [0, 1, 2, 3, 9] + grown[5:]  # a change in page 1: pages 1.. are hashed again
    expected = {tuple(h): tuple(page_keys(h, "ns", S)) for h in (grown, rewritten)}
    hashed.clear()
    assert mgr.lookup(1, grown).keys == expected[tuple(grown)]
    assert len(hashed) == 2  # only the pages it added
    hashed.clear()
    assert mgr.lookup(1, rewritten).keys == expected[tuple(rewritten)]
    assert len(hashed) == 3
    assert mgr.lookup(3, grown).keys == tuple(page_keys(grown, "ns", S))  # another user: its own chain


def test_commit_many_returns_each_leases_namespace_and_pages(smgr):
    a = smgr.onboard(smgr.allocate(1, list(range(8)), smgr.lookup(1, list(range(8)))))
    b = smgr.allocate(2, list(range(100, 103)), smgr.lookup(2, list(range(100, 103))))  # no full page

    done = smgr.commit_many([a.lease_id, 999, b.lease_id])

    assert [(c.lease_id, c.namespace) for c in done] == [(a.lease_id, "ns"), (999, "ns"), (b.lease_id, "ns")]
    assert [[it.prefix_len for it in c.items] for c in done] == [[4, 8], [], []]
    assert smgr.stats()["commit_unknown_lease"] == 1


def started_host_hit(smgr, store, tokens):
    """A host hit whose onboard copy is launched by the first poll and stays in flight (the fake
    store's get is UNREADY)."""
    fill_host(smgr, store, tokens)
    store.get_status = "UNREADY"
    [lease] = smgr.onboard_start_many([smgr.allocate(1, tokens, smgr.lookup(1, tokens))])
    assert not any(status == "UNREADY" for status in store.tasks.values()), "start must not ask the store"
    assert smgr.poll_onboards() == []  # asks the store; the copy stays in flight
    store.get_status = None
    return lease, next(t for t, status in store.tasks.items() if status == "UNREADY")


def test_onboard_start_returns_at_once_and_poll_settles_the_copy(smgr, store):
    tokens = list(range(8))
    lease, task = started_host_hit(smgr, store, tokens)
    assert lease.onboarding and lease.cached_len == 8 and smgr.onboards_in_flight() == 1
    assert smgr.onboard_result(lease.lease_id) is None  # its pages may not be read yet
    assert smgr.poll_onboards() == []  # the copy still runs
    store.finish(task, "SUCCESS")
    assert smgr.poll_onboards() == [lease.lease_id]
    done = smgr.onboard_result(lease.lease_id)
    assert done.onboarded and done.cached_len == 8 and done.page_row == lease.page_row
    assert (smgr.onboards_in_flight(), smgr.stats()["onboarded_pages"]) == (0, 2)
    smgr.commit(lease.lease_id)
    baseline_ok(smgr)


def test_a_late_copy_is_settled_as_a_timeout_even_when_nobody_waits(smgr, store, clock):
    tokens = list(range(8))
    lease, task = started_host_hit(smgr, store, tokens)
    clock.now += smgr.onboard_wait_s - 0.1
    assert smgr.poll_onboards() == []
    clock.now += 0.2
    assert smgr.poll_onboards() == [lease.lease_id]
    done = smgr.onboard_result(lease.lease_id)
    assert done.onboarded and done.cached_len == 0  # the request recomputes those tokens...
    assert not set(done.page_row) & set(lease.onboard_pages)  # ...into fresh pages
    assert task in store.cancelled and smgr.stats()["pages_quarantined"] == 2  # the copy may still write
    store.finish(task)
    smgr.expire_leases()
    smgr.abort(done.lease_id)
    baseline_ok(smgr)


def test_a_lease_aborted_while_its_copy_runs_is_released_when_it_settles(smgr, store):
    lease, task = started_host_hit(smgr, store, list(range(8)))
    assert smgr.abort(lease.lease_id)
    assert smgr.stats()["pages_leased"] == 2  # the store may be writing them
    store.finish(task, "SUCCESS")
    assert smgr.poll_onboards() == [lease.lease_id]
    assert isinstance(smgr.onboard_result(lease.lease_id), LeaseGone)
    baseline_ok(smgr)


@pytest.mark.parametrize("case", ["store refuses", "store holds none", "first poll after the deadline"])
def test_a_start_the_store_cannot_serve_is_settled_by_the_first_poll_as_pages_to_compute(smgr, store, clock,
                                                                                        case):
    tokens = list(range(8))
    if case != "store holds none":
        fill_host(smgr, store, tokens)
    if case == "store refuses":
        store.raise_on.add("get_async")
    [lease] = smgr.onboard_start_many([smgr.allocate(1, tokens, smgr.lookup(1, tokens))])
    assert lease.onboarding and lease.cached_len == 8 and smgr.onboards_in_flight() == 1
    if case == "first poll after the deadline":
        clock.now += smgr.onboard_wait_s + 0.1
    asked = len(store.tasks)
    assert smgr.poll_onboards() == [lease.lease_id], case
    if case == "first poll after the deadline":
        assert len(store.tasks) == asked, "a late start asks the store nothing"
    done = smgr.onboard_result(lease.lease_id)
    assert done.onboarded and done.cached_len == 0 and smgr.onboards_in_flight() == 0, case
    smgr.abort(lease.lease_id)
    baseline_ok(smgr)


# -- a lookup racing the same user's request in flight ----------------------------------------


def test_a_prefix_still_being_written_is_recomputed_never_waited_for_and_counted(mgr):
    """Both models commit before they answer; a user's request sent while its previous one still
    computes finds that prefix LEASED: it does not wait, computes those pages itself (the first
    commit of a key wins, the other page is freed) and is counted."""
    first = mgr.allocate(1, list(range(8)), mgr.lookup(1, list(range(8))))  # in flight
    hit = mgr.lookup(1, list(range(12)))
    assert hit.outcome == "miss" and mgr.stats()["uncommitted_prefix_lookups"] == 1
    second = mgr.allocate(1, list(range(12)), hit)
    assert mgr.lookup(2, [9] * 12).outcome == "miss"  # another history: nothing in flight for it
    assert mgr.stats()["uncommitted_prefix_lookups"] == 1
    mgr.commit(first.lease_id)
    mgr.commit(second.lease_id)
    assert mgr.stats()["duplicate_pages"] == 2  # pages 0 and 1, written by both
    assert mgr.lookup(1, list(range(12))).device_tokens == 12
    mgr.check_invariants()


# -- a request the pool cannot hold yet (pages pinned by the previous request's offload) ---------


def test_a_request_waits_for_offload_pins_to_drop_then_fits(tiny_spec, store, clock):
    """The request waits (counted, unanswered) while the pins hold the whole pool, and is
    answered once they drop: woken by the drop, long before its own 60 s wait would end."""
    m = KVCacheManager(tiny_spec, "ns", store, clock=clock, pool_wait_s=60.0)
    _, items = serve(m, 1, list(range(32)))  # the whole pool, committed and pinned for offload
    outcome: list = []

    def request() -> None:
        try:
            outcome.append(m.allocate(2, list(range(100, 132))))  # the whole pool again: fits once the pins drop
        except Exception as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    waiter = threading.Thread(target=request, daemon=True)
    waiter.start()
    wait_for(lambda: m.stats()["pool_waits"] >= 1 or outcome, 10, "the request to wait for pages")
    assert waiter.is_alive() and not outcome, f"answered while the pins held the pool: {outcome}"
    m.offload_done([it.page_id for it in items], True)
    waiter.join(30)  # a drop that woke nobody leaves it waiting 60 s
    assert not waiter.is_alive(), "the pins dropped and the request still waits"
    [alloc] = outcome
    assert not isinstance(alloc, Exception), repr(alloc)
    assert len(alloc.page_row) == 8
    assert m.stats()["pool_waits"] >= 1 and m.stats()["pool_exhausted"] == 0
    m.abort(alloc.lease_id)
    m.check_invariants()


def test_a_request_fails_after_the_wait_or_at_once_when_it_could_never_fit(tiny_spec, store, clock):
    m = KVCacheManager(tiny_spec, "ns", store, clock=clock, pool_wait_s=0.1)
    _, items = serve(m, 1, list(range(32)))
    with pytest.raises(PoolExhausted):
        m.allocate(2, list(range(100, 132)))  # the pins never drop: waits its 0.1 s, then fails
    assert (m.stats()["pool_waits"], m.stats()["pool_exhausted"]) == (1, 1), "it did not wait before failing"
    with pytest.raises(PoolExhausted):
        m.allocate(3, list(range(200, 240)))  # 10 pages of an 8-page pool: no wait
    assert (m.stats()["pool_waits"], m.stats()["pool_exhausted"]) == (1, 2), "it waited for pages it could never get"
    m.offload_done([it.page_id for it in items], True)
    baseline_ok(m)


def new_full_pages(lease: Lease) -> int:
    """The full pages the lease's request computes (past its cached prefix)."""
    return lease.num_full_pages - lease.cached_len // lease.page_size


@pytest.mark.parametrize("min_host_pages,onboard_pages", [(2, 0), (1, 1)])
def test_device_pages_lost_between_lookup_and_allocate_are_onboarded_only_from_min_host_pages(
        smgr, store, min_host_pages, onboard_pages):
    """Another request of the batch may evict a device hit's pages between its lookup and its
    allocate. Fewer such pages than ``min_host_pages`` are computed, not copied back from the
    host store: a copy that small costs more than its recompute."""
    tokens = list(range(12))
    fill_host(smgr, store, tokens)  # 3 pages on the host, none on the device
    serve(smgr, 1, tokens)  # onboarded: the device holds all 3
    smgr.min_host_pages = min_host_pages
    hit = smgr.lookup(1, tokens + [1, 2])
    assert (hit.device_tokens, hit.host_tokens) == (12, 0)
    smgr.abort(smgr.allocate(9, list(range(500, 524))).lease_id)  # 6 pages: the 5 free, and 1 evicted (the leaf)
    lease = smgr.allocate(1, tokens + [1, 2], hit)
    assert (lease.num_device_pages, lease.num_onboard_pages) == (2, onboard_pages)
    smgr.abort(lease.lease_id)


def test_without_a_store_lost_device_pages_are_computed(mgr):
    tokens = list(range(12))
    serve(mgr, 1, tokens)
    mgr.min_host_pages = 1
    hit = mgr.lookup(1, tokens + [1, 2])
    mgr.abort(mgr.allocate(9, list(range(500, 524))).lease_id)  # 6 pages: the 5 free, and 1 evicted (the leaf)
    lease = mgr.allocate(1, tokens + [1, 2], hit)
    assert (lease.num_device_pages, lease.num_onboard_pages) == (2, 0)
    mgr.abort(lease.lease_id)
