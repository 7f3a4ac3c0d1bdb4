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
