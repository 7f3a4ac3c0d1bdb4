"""The store's disk tier bounded by bytes: least recently used pages go first, and the count of
bytes held stays exact through writes, reads, drops and a restart's scan."""

from __future__ import annotations

from pathlib import Path

import torch

from kvlifecycle.store.tiers import DiskTier

PAGE_SHAPE = (2, 2, 4, 2, 8)  # [L, 2, S, H, D]: 1 KiB of float32


def _page(value: float) -> torch.Tensor:
    return torch.full((1, *PAGE_SHAPE), value)


def test_a_bounded_disk_tier_drops_the_least_recently_used_pages(tmp_path: Path) -> None:
    probe = DiskTier(tmp_path / "probe", PAGE_SHAPE, torch.float32)
    probe.write_behind([b"p" * 16], _page(0.0))  # a file holds its key: the same length as below
    assert probe.close(timeout_s=10)
    file_bytes = probe._bytes

    tier = DiskTier(tmp_path / "disk", PAGE_SHAPE, torch.float32, capacity_bytes=3 * file_bytes)
    keys = [bytes([i]) * 16 for i in range(5)]
    for i, key in enumerate(keys[:3]):
        tier.write_behind([key], _page(float(i)))
    assert tier.flush(timeout_s=10)
    assert torch.equal(tier.read(keys[0])[None], _page(0.0)), "read: the first page is now the most recent"
    for i, key in enumerate(keys[3:], start=3):
        tier.write_behind([key], _page(float(i)))
    assert tier.close(timeout_s=10)

    assert [k for k in keys if tier.holds(k)] == [keys[0], keys[3], keys[4]], "pages 1 and 2 were least recent"
    assert tier.read(keys[1]) is None and tier.counters["evicted_pages"] == 2
    assert tier._bytes == 3 * file_bytes == sum(p.stat().st_size for p in tier.dir.rglob("*.kvp"))

    restarted = DiskTier(tmp_path / "disk", PAGE_SHAPE, torch.float32, capacity_bytes=3 * file_bytes)
    assert len(restarted) == 3 and restarted._bytes == 3 * file_bytes
    assert torch.equal(restarted.read(keys[4])[None], _page(4.0))
    assert restarted.close(timeout_s=10)


def test_a_put_copies_its_pages_for_disk_before_another_thread_can_reuse_their_rows(tmp_path: Path) -> None:
    """A put's pages become visible in DRAM at its insert; from then on another thread's reserve
    (a locate reading disk pages back) may evict and reuse their rows. Here every row is
    overwritten right after the insert, as such a reuse would: the disk tier still gets the pages
    that were put (it once got the reusing page's bytes under the put's keys: wrong scores in
    stress with a small DRAM tier once the files were read back)."""
    import numpy as np

    from kvlifecycle.store.backing import LocalBacking, LocalConfig
    from kvlifecycle.store.transfer import PageCopier

    page_bytes = 4 * int(np.prod(PAGE_SHAPE))
    backing = LocalBacking(LocalConfig(dram_bytes=8 * page_bytes, disk_dir=tmp_path / "disk", shared_slab=False),
                           PAGE_SHAPE, torch.float32, pin_memory=False)
    layers, two, size, heads, dim = PAGE_SHAPE
    pool = torch.randn(layers, 4, two, size, heads, dim)  # [L, P, 2, S, H, D]
    insert = backing.dram.insert

    def insert_then_reuse(keys: list[bytes], rows: list[int]) -> int:
        inserted = insert(keys, rows)
        backing.dram.slab[rows] = -1.0  # another thread's page in the same rows
        return inserted

    backing.dram.insert = insert_then_reuse
    keys = [bytes([i]) * 16 for i in range(1, 4)]
    try:
        assert backing.put(PageCopier(pool), np.array([0, 2, 3]), keys).name == "SUCCESS"
        assert backing.disk.flush(timeout_s=10)
        for key, page in zip(keys, (0, 2, 3)):
            assert torch.equal(backing.disk.read(key), pool[:, page]), "the disk tier wrote another page's bytes"
    finally:
        backing.close()


def test_the_stores_own_copy_holds_its_rows_against_eviction() -> None:
    """A get looks its rows up, then copies them outside the index lock: meanwhile no other
    thread's reserve may evict (and reuse) them."""
    from kvlifecycle.store.tiers import DramTier

    tier = DramTier(2 * 1024, (1, 2, 4, 2, 16), torch.float32, pin_memory=False)  # 2 pages of 1 KiB
    a, b = b"a" * 16, b"b" * 16
    tier.insert([a, b], tier.reserve(2, keep=set()))  # a is the least recently used
    tier.hold([tier.row(a)])
    tier.row(b)  # b touched after: a stays the least recent, and is held
    assert len(tier.reserve(1, keep=set())) == 1 and tier.holds(a) and not tier.holds(b), "a held row was evicted"
    tier.unhold([tier.row(a)])
    assert len(tier.reserve(1, keep=set())) == 1 and not tier.holds(a), "an unheld row stayed"


def test_a_put_of_a_page_another_thread_read_back_meanwhile_keeps_one_row_for_it(tmp_path: Path) -> None:
    """A put picks the pages the tier lacks, copies them outside the index lock, then inserts
    them. Meanwhile the store's socket thread may read one of those pages back from disk (a
    `locate` after its DRAM row was evicted): the put then finds the key held at its insert. The
    page keeps one row, the put's row returns free (it once tripped an assertion, failing the put
    and leaking its rows), and every page reads back right."""
    import numpy as np

    from kvlifecycle.store.backing import LocalBacking, LocalConfig
    from kvlifecycle.store.transfer import PageCopier

    page_bytes = 4 * int(np.prod(PAGE_SHAPE))
    backing = LocalBacking(LocalConfig(dram_bytes=8 * page_bytes, disk_dir=tmp_path / "disk", shared_slab=False),
                           PAGE_SHAPE, torch.float32, pin_memory=False)
    layers, two, size, heads, dim = PAGE_SHAPE
    pool = torch.randn(layers, 4, two, size, heads, dim)  # [L, P, 2, S, H, D]
    keys = [bytes([i]) * 16 for i in range(1, 4)]
    copier = PageCopier(pool)
    gather = copier.gather

    def gather_while_the_socket_thread_reads_back(*args, **kwargs) -> None:
        gather(*args, **kwargs)
        backing._promote([keys[1]], pool[:, 2].unsqueeze(0).clone(), keep=set())  # keys[1] is pool page 2

    copier.gather = gather_while_the_socket_thread_reads_back
    try:
        assert backing.put(copier, np.array([0, 2, 3]), keys).name == "SUCCESS"
        rows = [backing.dram.row(key) for key in keys]
        assert None not in rows and len(set(rows)) == 3, f"rows {rows}: each page must keep one row of its own"
        assert len(backing.dram) == 3 and len(backing.dram._free) == 8 - 3, "the put's spare row did not return free"
        assert backing.stats()["put_pages"] == 2, "the page read back meanwhile was counted as put"
        out = torch.zeros_like(pool)
        assert backing.get(PageCopier(out), np.array([1, 2, 3]), keys).name == "SUCCESS"
        for got, put in zip((1, 2, 3), (0, 2, 3)):
            assert torch.equal(out[:, got], pool[:, put]), f"pool page {put} read back wrong"
    finally:
        backing.close()


def test_a_page_offered_again_before_or_after_its_write_is_written_once(tmp_path: Path) -> None:
    """The same key offered twice (a put of a page the tier still holds queued, or already holds)
    writes one file once."""
    tier = DiskTier(tmp_path / "disk", PAGE_SHAPE, torch.float32)
    key = b"k" * 16
    assert tier.write_behind([key], _page(1.0)) and tier.write_behind([key], _page(1.0))
    assert tier.flush(timeout_s=10)
    assert tier.write_behind([key], _page(1.0))
    assert tier.close(timeout_s=10)
    assert tier.counters["written_pages"] == 1 and tier.holds(key) and len(tier) == 1
    assert torch.equal(tier.read(key)[None], _page(1.0))
