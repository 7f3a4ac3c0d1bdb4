"""The local store's DRAM tier in shared memory, read by the process that onboards (``locate``,
and the slab's own index): a real store process, a real CPU pool, the reader's own copy.

- ``locate`` answers the rows of each request's held prefix; copying them gives the bytes that
  were put, and every row still has the version the store answered;
- located rows are pinned: a put that needs room cannot evict them while the pin lasts;
- once the pin expired and the rows were reused, the versions tell the reader so;
- the slab's index (``SharedSlab.find``, no round trip) shows exactly the pages the tier holds,
  through random puts and evictions with long, wrapping probe runs; a page a reader found gets
  one second chance before eviction; a reader racing the store's reuse of rows never keeps a
  page other than the one it found;
- hstu_compute's reader (``OnboardReader``) queues a batch's copy and checks it after the forward:
  rows reused in between are reported not onboarded (computed), intact ones onboarded;
- on CUDA, a copy queued without waiting is read by the next work on the caller's stream;
- a reader maps the store's memory, and keeps it after the store closed it;
- where no shared memory file can be made, the tier stays private.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.onboard_reader import OnboardReader
from kvlifecycle.hashing import page_keys
from kvlifecycle.pool import PagePool, PoolSpec
from kvlifecycle.store import Status
from kvlifecycle.store.protocol import keys_to_words
from kvlifecycle.store import slab as slab_module
from kvlifecycle.store.slab import SharedSlab
from kvlifecycle.store.tiers import DramTier
from kvlifecycle.store.transfer import PageCopier, host_page_shape
from tests.kvlifecycle.store_harness import SPEC, EmbeddedHarness, fill_random, held_pages, slots, tokens


@pytest.fixture
def pool():
    with PagePool.create(SPEC) as p:
        yield p


def _put(store, seq: np.ndarray, pages: list[int], ns: str) -> None:
    task = store.put_async(seq, slots(pages), ns)
    assert store.wait([task], timeout_s=10)[task] is Status.SUCCESS


def test_located_rows_copy_what_was_put_pin_against_eviction_and_show_reuse(pool: PagePool) -> None:
    harness = EmbeddedHarness(pool, capacity_pages=8)
    try:
        store = harness.client()
        assert store.register_pool(pool.handle()) and store.slab is not None, "the store's DRAM tier is not shared"
        a, b, c = tokens(4, start=1), tokens(8, start=1000), tokens(8, start=5000)
        put_a = fill_random(pool, [0, 1, 2, 3], seed=1)
        _put(store, a, [0, 1, 2, 3], harness.ns)
        keys_a = page_keys(a, harness.ns, SPEC.page_size)

        assert store.locate([], pin_s=1.0).slab == store.slab, "a locate of nothing names the slab"
        unknown = [b"\x01" * 16]
        located = store.locate([keys_a, keys_a[:2] + unknown + keys_a[3:], unknown], pin_s=1.0)
        assert [len(r) for r in located.rows] == [4, 2, 0], "each request's held prefix, and no further"
        slab = SharedSlab.attach(located.slab, pin=False)
        try:
            PageCopier(pool.tensor).scatter(slab.rows, located.rows[0], np.array([10, 11, 12, 13]))
            assert torch.equal(pool.tensor[:, 10:14], put_a), "the located rows hold the pages that were put"
            assert slab.unchanged(located.rows[0], located.versions[0]).all()

            # Pinned: a put of 8 pages into the 8-page tier finds only the 4 free rows.
            fill_random(pool, list(range(4, 12)), seed=2)
            _put(store, b, list(range(4, 12)), harness.ns)
            assert held_pages(store, a, harness.ns) == 4, "a pinned page was evicted"
            assert held_pages(store, b, harness.ns) == 4, "the put kept its first pages in the free rows"
            assert slab.unchanged(located.rows[0], located.versions[0]).all()

            # Once the pins expired, a put may take the rows: their versions move.
            time.sleep(1.1)
            fill_random(pool, list(range(12, 20)), seed=3)
            _put(store, c, list(range(12, 20)), harness.ns)
            assert held_pages(store, a, harness.ns) == 0
            assert not slab.unchanged(located.rows[0], located.versions[0]).any(), (
                "rows written again kept their versions: a reader could not tell")
        finally:
            slab.close()
    finally:
        harness.close()


PAGE = (1, 2, 2, 1, 2)  # a tiny page [L, 2, S, H, D]: the index does not look at the bytes


def _shared_tier(pages: int) -> DramTier:
    tier = DramTier(pages * 2 * int(np.prod(PAGE)), PAGE, torch.float16, pin_memory=False, shared=True)
    assert tier.shared is not None and tier.capacity_pages == pages
    return tier


@pytest.fixture(params=["each", "together"])
def probe(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``SharedSlab.find`` probes a few keys one by one and many at once: each test runs both."""
    monkeypatch.setattr(slab_module, "FEW_KEYS", 10**9 if request.param == "each" else 0)
    return request.param


def _colliding_key(rng: np.random.Generator, homes: list[int]) -> bytes:
    """A key whose first 8 bytes (its home slot) are one of ``homes``: long probe runs, wrapping."""
    return int(rng.choice(homes)).to_bytes(8, "little") + rng.bytes(8)


def test_the_slabs_index_shows_exactly_the_pages_the_tier_holds(probe: str) -> None:
    """Random puts and evictions through the DRAM tier, most keys homed on a few slots around the
    table's end (runs that wrap, deletions that move entries back): after every step, ``find``
    answers each key's row exactly as the tier holds it, and nothing for a key it dropped."""
    tier = _shared_tier(16)
    slots = tier.shared._mask + 1  # 32
    homes = [slots - 2, slots - 1, 0, 1, 5]
    rng = np.random.default_rng(7)
    seen: list[bytes] = []
    try:
        for step in range(400):
            keys = [_colliding_key(rng, homes) for _ in range(int(rng.integers(1, 5)))]
            rows = tier.reserve(len(keys), keep=set())
            tier.insert(keys[:len(rows)], rows)
            seen += keys
            held = {k: tier.row(k) for k in seen if tier.holds(k)}
            answers = tier.shared.find([[k] for k in seen])
            for key, (rows_found, versions) in zip(seen, answers):
                if key in held:
                    assert rows_found.tolist() == [held[key]], f"step {step}: a held page's row"
                    assert versions.tolist() == tier.shared.versions_of(rows_found).tolist()
                else:
                    assert rows_found.size == 0, f"step {step}: found a page the tier evicted"
        assert tier.evictions > 300
        # A request's answer is its leading pages only.
        some = list(held)[:3]
        assert [r.size for r, _ in tier.shared.find([some, some[:1] + [b"\x00" * 16] + some[1:]])] == [3, 1]
    finally:
        tier.close()


def test_a_page_a_reader_found_gets_a_second_chance_before_eviction(probe: str) -> None:
    tier = _shared_tier(4)
    keys = [bytes([i]) * 16 for i in range(1, 6)]
    try:
        tier.insert(keys[:4], tier.reserve(4, keep=set()))  # full; the first key is the least recent
        [(rows, _)] = tier.shared.find([keys[:1]])  # a reader copies the least recent page
        tier.insert(keys[4:], tier.reserve(1, keep=set()))
        assert tier.holds(keys[0]) and not tier.holds(keys[1]), "the page just read was evicted, not the next"
        tier.insert([bytes([9]) * 16], tier.reserve(1, keep=set()))
        tier.insert([bytes([10]) * 16], tier.reserve(1, keep=set()))
        tier.insert([bytes([11]) * 16], tier.reserve(1, keep=set()))
        assert not tier.holds(keys[0]), "one read buys one second chance, not a pin"
        assert tier.shared.find([keys[:1]])[0][0].size == 0
    finally:
        tier.close()


def test_a_page_inserted_twice_keeps_one_row_in_the_index(probe: str) -> None:
    """The store's two threads may insert the same page (a put, and a read-back from disk): the
    second insert's row returns free and is not indexed, so the index never names a row that
    will be reused without being withdrawn first."""
    tier = _shared_tier(4)
    key = bytes([3]) * 16
    try:
        [first] = tier.reserve(1, keep=set())
        [spare] = tier.reserve(1, keep=set())
        assert tier.insert([key], [first]) == 1 and tier.insert([key], [spare]) == 0
        assert tier.shared.find([[key]])[0][0].tolist() == [first]
        assert int((tier.shared._table == first + 1).sum()) == 1 and not (tier.shared._table == spare + 1).any()
        assert spare in tier._free and tier.row(key) == first
    finally:
        tier.close()


def test_a_reader_racing_the_store_never_accepts_a_page_other_than_the_one_it_found(probe: str) -> None:
    """The store reuses rows as fast as it can (withdraw, bump, write a page whose every value
    names its key, publish) while a reader thread finds pages, copies them and keeps those whose
    version did not move (``unchanged``), with thread switches every few microseconds: every page
    the reader kept holds its own key's values, never a half-written or reused row's."""
    import sys
    import threading
    page = (1, 2, 32, 4, 16)  # 4,096 values: a write takes long enough to be read half done
    tier = DramTier(64 * 2 * int(np.prod(page)), page, torch.float16, pin_memory=False, shared=True)
    slab = tier.shared
    assert slab is not None
    key_of = lambda i: (i % 5).to_bytes(8, "little") + i.to_bytes(8, "little")  # noqa: E731 (shared homes)
    stop, kept, wrong, written = threading.Event(), [0], [], [0]

    def read() -> None:
        while not stop.is_set():
            ids = list(range(max(0, written[0] - 72), written[0]))  # the 64 held, and the oldest at the edge
            answers = slab.find([[key_of(i)] for i in ids])
            for i, (rows, versions) in zip(ids, answers):
                if rows.size:
                    copy = slab.rows.index_select(0, torch.from_numpy(rows))  # releases the GIL
                    if slab.unchanged(rows, versions).all():
                        kept[0] += 1
                        if not bool((copy == float(i % 2000)).all()):
                            wrong.append(i)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    reader = threading.Thread(target=read)
    reader.start()
    try:
        started, i = time.monotonic(), 0
        # at least 2 s, and until the reader kept enough pages (thread switches cost more on some hosts)
        while time.monotonic() - started < 2.0 or (kept[0] < 2000 and time.monotonic() - started < 20.0):
            [row] = tier.reserve(1, keep=set())  # evicts (withdraws) the least recent, bumps
            tier.slab[row] = float(i % 2000)
            tier.insert([key_of(i)], [row])
            i += 1
            written[0] = i
            time.sleep(0)  # lets the reader in between pages as well as within them
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(switch)
        tier.close()
    print(f"the reader kept {kept[0]} pages of {written[0]} written")
    assert kept[0] > 1000, f"the reader kept only {kept[0]} pages: the race was not run"
    assert not wrong, f"{len(wrong)} of {kept[0]} pages kept held another page's values (ids {wrong[:5]})"


def _onboard_plan(history: np.ndarray, keys: list[bytes], page_row: list[int]) -> ComputePlan:
    """A host hit's plan as kv_lookup_alloc writes it: every full page onboarded by the reader."""
    cached = len(keys) * SPEC.page_size
    return ComputePlan(new_tokens=torch.from_numpy(history), cached_len=cached, onboard_len=cached,
                       page_row=torch.tensor(page_row), candidates=torch.ones(1, dtype=torch.int64), namespace_tag=0,
                       lease_id=1, onboard_keys=torch.from_numpy(keys_to_words(keys)))


def test_the_reader_checks_its_queued_copy_after_the_forward(pool: PagePool) -> None:
    harness = EmbeddedHarness(pool, capacity_pages=8)
    try:
        store = harness.client()
        assert store.register_pool(pool.handle()) and store.slab is not None, "the store's DRAM tier is not shared"
        a, c = tokens(4, start=1), tokens(8, start=5000)
        put_a = fill_random(pool, [0, 1, 2, 3], seed=1)
        _put(store, a, [0, 1, 2, 3], harness.ns)
        plan = _onboard_plan(a, page_keys(a, harness.ns, SPEC.page_size), [10, 11, 12, 13])
        reader = OnboardReader(harness.client(), pin_s=0.5)
        try:
            queued = reader.start(pool, [plan, plan._replace(onboard_keys=torch.zeros((0, 2), dtype=torch.int64))])
            assert queued.pages == [4, 0], "the held prefix is queued; a plan without keys reads nothing"
            assert reader.finish(queued) == [4, 0] and reader.finish(queued) == [4, 0], "checked once, asked twice"
            assert torch.equal(pool.tensor[:, 10:14], put_a), "the copy landed in the lease's pages"

            # The same copy, its rows reused before the check (a put took them: nothing pins rows
            # the reader found in the slab's index, and the second chance they got is spent).
            queued = reader.start(pool, [plan._replace(page_row=torch.tensor([20, 21, 22, 23]))])
            assert queued.pages == [4]
            time.sleep(0.6)
            fill_random(pool, list(range(24, 32)), seed=3)
            _put(store, c, list(range(24, 32)), harness.ns)
            assert reader.finish(queued) == [0], "rows the store reused before the check were taken as the pages"
            assert reader.stats() == {"onboarded_pages": 4, "onboard_failed_pages": 4, "onboard_locates": 1}, (
                "only the first start, before the slab was mapped, asked the store")
        finally:
            reader.close()
    finally:
        harness.close()


def test_where_no_shared_memory_can_be_made_the_tier_stays_private(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(name: str, flags: int = 0) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(slab_module.os, "memfd_create", refuse)
    tier = DramTier(64 * SPEC.page_bytes, host_page_shape(SPEC.shape), SPEC.torch_dtype, pin_memory=False,
                    shared=True)
    assert tier.shared is None and tier.slab.shape[0] == 64
    tier.close()


def test_a_reader_maps_the_store_memory_and_keeps_it_after_the_store_closed_it() -> None:
    slab = SharedSlab.create(4, host_page_shape(SPEC.shape), SPEC.torch_dtype, pin=False)
    reader = SharedSlab.attach(slab.handle(), pin=False)
    slab.rows[2].fill_(7.0)
    assert torch.equal(reader.rows[2], slab.rows[2]), "the reader maps the store's memory"
    slab.bump([2])
    assert not reader.unchanged(np.array([2]), np.array([0]))[0]
    path = slab.path
    slab.close()
    assert not os.path.exists(path), "the store's fd is closed"
    assert float(reader.rows[2].max()) == 7.0, "a reader's mapping outlives the store's fd"
    reader.close()


@pytest.mark.parametrize("mapped", [True, False], ids=["mapped-rows", "staged"])
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by deploy/gpu_run.sh pytest)")
def test_a_queued_copy_is_read_by_the_next_work_on_the_callers_stream(mapped: bool) -> None:
    """`scatter(..., wait=False)` returns before the copy ends, queued on the calling thread's
    stream; what that thread queues next (the forward, in hstu_compute) must still read the copied
    pages. A big copy, so that a copy queued on another stream would be read before it landed.
    Both forms of host rows: mapped into the device (read in place) and staged."""
    spec = PoolSpec(num_layers=4, num_pages=1024, page_size=32, num_heads=4, head_dim=128, dtype="bfloat16",
                    device="cuda")
    slab = SharedSlab.create(512, host_page_shape(spec.shape), spec.torch_dtype, pin=True)
    try:
        with PagePool.create(spec) as pool:
            pool.tensor.zero_()
            slab.rows.copy_(torch.randn(slab.rows.shape, dtype=torch.float32).to(spec.torch_dtype))
            rows, pages = np.arange(512, dtype=np.int64), np.arange(100, 612, dtype=np.int64)
            done = PageCopier(pool.tensor).scatter(slab.copy_rows if mapped else slab.rows, rows, pages, wait=False)
            read = pool.tensor[:, 100:612].transpose(0, 1).contiguous()  # on the caller's stream, queued next
            assert torch.equal(read.cpu(), slab.rows), "the caller's stream read the pages before the copy landed"
            done.synchronize()
            assert done.query(), "the event recorded after the copy completes once the copy ended"
    finally:
        slab.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by deploy/gpu_run.sh pytest)")
def test_copies_through_the_mapped_slab_move_each_page_to_its_row_and_back_in_any_order() -> None:
    """A pinned slab's `copy_rows` is its rows mapped into the device (same address). An onboard
    (the reader's, or the store's) reads scattered rows through it into the pool in place, and the
    store's offload writes pool pages into scattered rows through it: one indexed kernel each way."""
    spec = PoolSpec(num_layers=3, num_pages=256, page_size=16, num_heads=2, head_dim=64, dtype="bfloat16",
                    device="cuda")
    slab = SharedSlab.create(64, host_page_shape(spec.shape), spec.torch_dtype, pin=True)
    try:
        assert slab.copy_rows.is_cuda and slab.copy_rows.data_ptr() == slab.rows.data_ptr(), (
            "a pinned slab on a CUDA host is addressed by the device in place")
        slab.rows.copy_(torch.randn(slab.rows.shape, dtype=torch.float32).to(spec.torch_dtype))
        with PagePool.create(spec) as pool:
            pool.tensor.zero_()
            rng = np.random.default_rng(0)
            rows = rng.permutation(64)[:20].astype(np.int64)
            pages = rng.permutation(256)[:20].astype(np.int64)
            PageCopier(pool.tensor).scatter(slab.copy_rows, rows, pages)
            for row, page in zip(rows, pages):
                assert torch.equal(pool.tensor[:, page].cpu(), slab.rows[row]), f"page {page} does not hold row {row}"
            pool.tensor[:, 100:120].copy_(torch.randn(pool.tensor[:, 100:120].shape, device="cuda").to(spec.torch_dtype))
            out_rows = rng.permutation(64)[:20].astype(np.int64)
            PageCopier(pool.tensor).gather(np.arange(100, 120, dtype=np.int64), slab.copy_rows, out_rows)
            for page, row in zip(range(100, 120), out_rows):
                assert torch.equal(slab.rows[row], pool.tensor[:, page].cpu()), f"row {row} does not hold page {page}"
    finally:
        slab.close()
    assert not slab.copy_rows.is_cuda, "a closed slab no longer offers its unregistered device view"
