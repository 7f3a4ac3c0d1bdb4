"""Conformance of the embedded and mooncake backends to the ``kvlifecycle.store`` API (flexkv, which
needs a GPU, has its own cases in test_store_flexkv.py):
round trips are byte-identical, the held pages are whole-page prefixes, missing pages are NOTFOUND,
cancel/try_wait/wait behave, and a stopped store fails open and is reconnected."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest
import torch

from kvlifecycle.pool import PagePool
from kvlifecycle.store import Status

from .store_harness import SPEC, backend_params, close_shared_stores, fill_random, held_pages, slots, tokens

@pytest.fixture(scope="module")
def pool() -> Iterator[PagePool]:
    """One pool per module, like one per server; tests isolate by namespace and pages."""
    with PagePool.create(SPEC) as p:
        yield p


@pytest.fixture(params=backend_params())
def make_store(request: pytest.FixtureRequest, pool: PagePool) -> Iterator[Callable[..., Any]]:
    harness_cls = request.param
    made: list[Any] = []

    def make(**kw: Any) -> Any:
        harness = harness_cls(pool, **kw)
        made.append(harness)
        return harness

    make.kind = harness_cls.kind  # type: ignore[attr-defined]
    try:
        yield make
    finally:
        for harness in made:
            harness.close()


@pytest.fixture(scope="module", autouse=True)
def _shared_stores() -> Iterator[None]:
    yield
    close_shared_stores()


def test_put_then_get_prefix_round_trip_is_byte_identical(make_store, pool):
    harness = make_store()
    store, ns = harness.client(), harness.ns
    seq = tokens(3, extra=2)  # 3 full pages + a partial page that is never stored
    expected = fill_random(pool, [5, 6, 9], seed=1)

    put = store.put_async(seq, slots([5, 6, 9]), ns, token_mask=np.arange(seq.size) < 12)
    assert store.wait([put], timeout_s=10) == {put: Status.SUCCESS}

    pool.tensor.zero_()
    task, held = store.get_prefix_async(seq, slots([20, 21, 22]), ns, first_page=0)
    assert (held, task is not None) == (3, True), "the 3 full pages are held, the partial 4th never stored"
    assert store.wait([task], timeout_s=10) == {task: Status.SUCCESS}
    assert torch.equal(pool.tensor[:, [20, 21, 22]], expected)
    assert not pool.tensor[:, [5, 6, 9]].any(), "a get wrote outside its slots"


def test_get_async_of_some_held_pages(make_store, pool):
    harness = make_store()
    store, ns = harness.client(), harness.ns
    seq = tokens(3)
    expected = fill_random(pool, [1, 2, 3], seed=2)
    put = store.put_async(seq, slots([1, 2, 3]), ns)
    assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS

    pool.tensor.zero_()
    only_last_two = np.arange(seq.size) >= SPEC.page_size
    get = store.get_async(seq, slots([10, 11]), ns, only_last_two)
    assert store.wait([get], timeout_s=10)[get] is Status.SUCCESS
    assert torch.equal(pool.tensor[:, [10, 11]], expected[:, 1:])


@pytest.mark.parametrize("case, query, held", [
    ("same tokens", tokens(3), 3),
    ("longer history", tokens(5), 3),
    ("shorter history", tokens(2, extra=3), 2),
    ("page 1 rewritten", np.concatenate([tokens(1), tokens(2, start=900)]), 1),
    ("page 0 rewritten", tokens(3, start=500), 0),
])
def test_the_held_pages_are_the_stored_whole_page_prefix(make_store, pool, case, query, held):
    harness = make_store()
    store, ns = harness.client(), harness.ns
    put = store.put_async(tokens(3), slots([1, 2, 3]), ns)
    assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS

    assert held_pages(store, query, ns) == held, case


def test_other_namespace_and_missing_pages_are_not_found(make_store, pool):
    harness = make_store()
    store, ns = harness.client(), harness.ns
    seq = tokens(3)
    put = store.put_async(seq, slots([1, 2]), ns, token_mask=np.arange(seq.size) < 8)  # pages 0, 1
    assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS

    assert held_pages(store, seq, "reloaded-model-weights") == 0, "another namespace (new weights) must never match"
    pool.tensor[:, 7] = 42.0
    get = store.get_async(seq, slots([6, 7, 8]), ns, np.ones(seq.size, dtype=bool))
    assert store.wait([get], timeout_s=10)[get] is Status.NOTFOUND
    assert (pool.tensor[:, 7] == 42.0).all(), "a NOTFOUND get must copy nothing"


def test_get_prefix_copies_the_held_candidates_in_one_round_trip(make_store, pool):
    """A lookup and an onboard in one call (a host hit on the serving path): the store holds pages
    0-2 of a 5-page history whose page 0 is on the device; asked for pages 1-4, it copies 1-2
    into their slots, leaves the slots of 3-4 alone and says it holds 3, in one RPC."""
    harness = make_store()
    store, ns = harness.client(), harness.ns
    seq = tokens(5)
    expected = fill_random(pool, [1, 2, 3], seed=3)
    put = store.put_async(seq[: 3 * SPEC.page_size], slots([1, 2, 3]), ns)
    assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS

    pool.tensor.zero_()
    pool.tensor[:, [23, 24]] = 42.0
    before = store.server_stats()
    task, held = store.get_prefix_async(seq, slots([21, 22, 23, 24]), ns, first_page=1)
    after = store.server_stats()
    assert held == 3 and task is not None
    assert store.wait([task], timeout_s=10) == {task: Status.SUCCESS}
    assert torch.equal(pool.tensor[:, [21, 22]], expected[:, 1:])
    assert (pool.tensor[:, [23, 24]] == 42.0).all(), "pages the store does not hold: slots untouched"
    moved = {k: v - before.get(k, 0) for k, v in after.items() if k.startswith("rpc_") and v != before.get(k, 0)}
    assert moved == {"rpc_get_prefix": 1, "rpc_stats": 1}, "one round trip: no separate match"

    assert store.get_prefix_async(seq, slots([25, 26]), ns, first_page=3) == (None, 3), "none held to copy"
    assert store.get_prefix_async(tokens(3, start=500), slots([27, 28]), ns, first_page=1) == (None, 0)
    with pytest.raises(ValueError, match="first_page"):
        store.get_prefix_async(seq, slots([]), ns, first_page=5)
    with pytest.raises(ValueError, match="no full page"):  # under one page: nothing the store could hold
        store.get_prefix_async(tokens(0, extra=3), slots([]), ns, first_page=0)


COPY_DELAY_S = 1.0  # the store sleeps this long before each copy (tests/slow_store.py)
ATTEMPTS = 3  # a machine that stalls past the delay between two calls repeats the case with new tasks


def test_try_wait_is_unready_then_success(make_store, pool):
    """A put cannot finish before COPY_DELAY_S after put_async was called, so statuses asked for
    within that time are UNREADY (try_wait) and TIMEOUT (wait at its deadline)."""
    harness = make_store(copy_delay_s=COPY_DELAY_S)
    store, ns = harness.client(), harness.ns
    fill_random(pool, [1, 2], seed=3)
    for attempt in range(ATTEMPTS):
        called = time.monotonic()
        put = store.put_async(tokens(2, start=1 + 100 * attempt), slots([1, 2]), ns)
        early = store.try_wait([put]), store.wait([put], timeout_s=0.05)
        if time.monotonic() - called < COPY_DELAY_S:
            break
    else:
        pytest.fail(f"the machine stalled past the {COPY_DELAY_S} s copy delay between two calls {ATTEMPTS} times")

    assert early == ({put: Status.UNREADY}, {put: Status.TIMEOUT}), "still in flight at the deadline"
    assert store.wait([put], timeout_s=10) == {put: Status.SUCCESS}
    with pytest.raises(ValueError, match="unknown task"):
        store.try_wait([put])  # a done status is reported once


def test_a_waiting_poll_is_answered_when_the_copy_ends_not_at_its_deadline(make_store, pool):
    """try_wait with wait_s: the store answers once the task is done (the copy thread rings the
    socket thread), so a 30 s wait returns after about the copy's delay; a short one comes back
    UNREADY at its deadline with the task still in flight. The copy's delay is under the client's
    cap on one waiting poll (1 s): with the delay at the cap, a loaded machine hit the cap first."""
    delay_s = COPY_DELAY_S / 4
    harness = make_store(copy_delay_s=delay_s)
    store, ns = harness.client(), harness.ns
    fill_random(pool, [1, 2], seed=9)
    put = store.put_async(tokens(2, start=3000), slots([1, 2]), ns)
    assert store.try_wait([put], wait_s=0.05) == {put: Status.UNREADY}
    asked = time.monotonic()
    assert store.try_wait([put], wait_s=30.0) == {put: Status.SUCCESS}
    assert time.monotonic() - asked < 0.9, "answered at the deadline, not when the copy ended"


def test_a_wait_on_a_store_that_dies_mid_copy_fails_the_task_instead_of_holding_the_caller(make_store, pool):
    """The waiting poll is held by the server; when the server dies with it, the caller is held one
    capped poll plus an RPC timeout, then fails open: the task is FAILED once its start_by (plus a
    grace) passed, long before the caller's 30 s."""
    harness = make_store(copy_delay_s=COPY_DELAY_S, dedicated=True)
    store, ns = harness.client(task_start_timeout_s=1.0), harness.ns
    fill_random(pool, [1, 2], seed=10)
    put = store.put_async(tokens(2, start=4000), slots([1, 2]), ns)
    harness.kill()
    asked = time.monotonic()
    assert store.wait([put], timeout_s=30.0) == {put: Status.FAILED}
    assert time.monotonic() - asked < 15.0, "the wait outlived the store by far"


def test_cancel_before_start(make_store, pool):
    """The store copies one task at a time in submission order, so a cancel that returned while
    the task ahead was still copying reached its task before it started."""
    harness = make_store(copy_delay_s=COPY_DELAY_S)
    store, ns = harness.client(), harness.ns
    fill_random(pool, [1, 2, 3, 4], seed=4)
    for attempt in range(ATTEMPTS):
        first = store.put_async(tokens(2, start=1 + 1000 * attempt), slots([1, 2]), ns)
        queued = tokens(2, start=100 + 1000 * attempt)
        second = store.put_async(queued, slots([3, 4]), ns)  # queued behind the first
        store.cancel([second])

        if store.try_wait([first]) == {first: Status.UNREADY}:  # the first still copying: second not started
            break
        store.wait([second], timeout_s=10)
    else:
        pytest.fail(f"the machine stalled past the {COPY_DELAY_S} s copy delay around a cancel {ATTEMPTS} times")

    assert store.wait([first, second], timeout_s=10) == {first: Status.SUCCESS, second: Status.CANCELLED}
    assert held_pages(store, queued, ns) == 0, "a cancelled put stored nothing"


def test_dram_capacity_evicts_least_recently_used(make_store, pool):
    harness = make_store(capacity_pages=4)
    if not harness.has_lru:
        pytest.skip(f"{harness.kind}: eviction is not a byte-capacity LRU of ours")
    store, ns = harness.client(), harness.ns
    a, b, c = tokens(2, start=1), tokens(2, start=100), tokens(2, start=200)
    fill_random(pool, [1, 2, 3, 4, 5, 6], seed=5)
    for seq, pages in ((a, [1, 2]), (b, [3, 4])):
        put = store.put_async(seq, slots(pages), ns)
        assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS
    touch = store.get_async(a, slots([10, 11]), ns, np.ones(a.size, dtype=bool))  # a is now recent
    assert store.wait([touch], timeout_s=10)[touch] is Status.SUCCESS

    put = store.put_async(c, slots([5, 6]), ns)  # needs 2 rows: evicts b, the least recently used
    assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS
    held = {name: held_pages(store, seq, ns) for name, seq in (("a", a), ("b", b), ("c", c))}
    assert held == {"a": 2, "b": 0, "c": 2}


DEAD_STORE_S = 4.0  # calls against a down store must all return within this


def test_stopped_store_fails_open_then_reconnects(make_store, pool):
    """Embedded: the store process killed. Mooncake: the master killed; the Mooncake client lives
    in the store process, so the caller sees at most a store timeout (it held the caller for
    about 100 s when it ran in the caller's process)."""
    fails_open_then_reconnects(make_store(dedicated=True), pool)


def fails_open_then_reconnects(harness, pool) -> None:
    """The scenario: a put, the store killed, calls fail open at once, the store back, reconnected."""
    store, ns = harness.client(), harness.ns
    fill_random(pool, [1, 2], seed=6)
    put = store.put_async(tokens(2), slots([1, 2]), ns)
    assert store.wait([put], timeout_s=10)[put] is Status.SUCCESS

    harness.kill()
    t0 = time.monotonic()
    assert store.get_prefix_async(tokens(2), slots([3]), ns, first_page=1) == (None, 0), "fail open: a miss"
    failed_put = store.put_async(tokens(2), slots([1, 2]), ns)
    statuses = store.wait([failed_put], timeout_s=2)
    elapsed = time.monotonic() - t0
    assert statuses[failed_put] in (Status.FAILED, Status.TIMEOUT)
    assert elapsed < DEAD_STORE_S, f"calls against a down store took {elapsed:.1f} s"
    assert store.stats()["errors"] >= 1

    harness.start()
    deadline = time.monotonic() + 15
    while True:  # the client retries after its back-off window
        put = store.put_async(tokens(2), slots([1, 2]), ns)
        if store.wait([put], timeout_s=5)[put] is Status.SUCCESS:
            break
        assert time.monotonic() < deadline, f"no reconnection; stats {store.stats()}"
        time.sleep(0.2)
    assert held_pages(store, tokens(2), ns) == 2
    assert store.stats()["reconnects"] >= 1
