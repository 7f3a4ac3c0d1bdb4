"""The local store's DRAM tier in shared memory, read by the process that onboards (``locate``):
a real store process, a real CPU pool, the reader's own copy.

- ``locate`` answers the rows of each request's held prefix; copying them gives the bytes that
  were put, and every row still has the version the store answered;
- located rows are pinned: a put that needs room cannot evict them while the pin lasts;
- once the pin expired and the rows were reused, the versions tell the reader so;
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

            # The same copy, its rows reused before the check (the pin expired, a put took them).
            queued = reader.start(pool, [plan._replace(page_row=torch.tensor([20, 21, 22, 23]))])
            assert queued.pages == [4]
            time.sleep(0.6)
            fill_random(pool, list(range(24, 32)), seed=3)
            _put(store, c, list(range(24, 32)), harness.ns)
            assert reader.finish(queued) == [0], "rows the store reused before the check were taken as the pages"
            assert reader.stats() == {"onboarded_pages": 4, "onboard_failed_pages": 4}
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


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by deploy/gpu_run.sh pytest)")
def test_a_queued_copy_is_read_by_the_next_work_on_the_callers_stream() -> None:
    """`scatter(..., wait=False)` returns before the copy ends; what the calling thread queues next
    on its stream (the forward, in hstu_compute) must still read the copied pages. A big copy, so
    that a missing stream wait would read the old bytes."""
    spec = PoolSpec(num_layers=4, num_pages=1024, page_size=32, num_heads=4, head_dim=128, dtype="bfloat16",
                    device="cuda")
    slab = SharedSlab.create(512, host_page_shape(spec.shape), spec.torch_dtype, pin=True)
    try:
        with PagePool.create(spec) as pool:
            pool.tensor.zero_()
            slab.rows.copy_(torch.randn(slab.rows.shape, dtype=torch.float32).to(spec.torch_dtype))
            rows, pages = np.arange(512, dtype=np.int64), np.arange(100, 612, dtype=np.int64)
            done = PageCopier(pool.tensor).scatter(slab.rows, rows, pages, wait=False)
            read = pool.tensor[:, 100:612].transpose(0, 1).contiguous()  # on the caller's stream, queued next
            assert done is not None
            assert torch.equal(read.cpu(), slab.rows), "the caller's stream read the pages before the copy landed"
    finally:
        slab.close()
