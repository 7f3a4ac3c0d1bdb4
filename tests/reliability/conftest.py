"""Fixtures and helpers for the reliability tests (bad input, faults, load, restart, security).

- `fault_server` (package scope): a second tritonserver + host store for the tests that need a
  config of their own: a small page pool (384 pages of 32 tokens, far smaller than the soak's
  working set; 3 max-length histories fill it), the store's disk tier, and test fault injection
  (`HSTU_FAULTS`, `deploy/faults.py`): hstu_compute raises on candidate `FAULT_CANDIDATE`.
  Tests that use it may kill and restart its store or the whole server; each leaves it serving.
- `owner_stats(server)`: kv_lookup_alloc's page table counters, read over its control socket
  (exact and immediate; the metrics port lags by up to a second).
- `wait_drained(server)`: waits until no page is leased or pinned (every lease committed or
  returned, every offload reaped) and returns the owner's stats.
- `kv_metrics(server)`: the KV series of the metrics port that bad input must not change.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from deploy.launcher import Server
from deploy.schema import RankingRequest
from kvlifecycle.control import ControlClient
from tests.conftest import launch_config
from tests.integration.test_ensemble import metric

FAULT_CANDIDATE = 99_991  # never sent by the tests' traces (see `without_fault_candidate`)
FAULT_POOL_PAGES = 384
TOLERANCE = 1e-4
LOOKUP = "kv_lookup_alloc"


@pytest.fixture(scope="package")
def fault_server(tmp_path_factory) -> Server:
    root = tmp_path_factory.mktemp("fault_server")
    srv = Server(launch_config(root, pool_pages=FAULT_POOL_PAGES, store_disk_dir=root / "disk",
                               extra_env={"HSTU_FAULTS": json.dumps({"compute_raise_on_candidate": FAULT_CANDIDATE})}))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def owner_stats(server: Server) -> dict[str, int]:
    with ControlClient(server.settings.control_endpoint, timeout_s=30.0) as control:
        return control.stats()


def wait_drained(server: Server, timeout_s: float = 90.0) -> dict[str, int]:
    """Owner stats once nothing is leased or pinned; AssertionError (with the stats) on timeout.
    Leases left by a cancelled request return on expiry (lease_ttl_s, 30 s by default)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = owner_stats(server)
        if stats["pages_leased"] == 0 and stats["pages_pinned"] == 0 and stats["leases_active"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"pool not back at baseline after {timeout_s:.0f}s: leased "
                                 f"{stats['pages_leased']}, pinned {stats['pages_pinned']}, "
                                 f"leases {stats['leases_active']}, quarantined {stats['pages_quarantined']}")
        time.sleep(0.25)


KV_SERIES = [("hstu_kv_pages", {"state": s}) for s in ("free", "in_use", "pinned", "leased")] + \
    [("hstu_kv_lookups_total", {"outcome": o}) for o in ("device_hit", "host_hit", "miss")]


def kv_metrics(server: Server) -> dict[str, float]:
    """kv_lookup_alloc's page gauges and lookup counters, as the metrics port shows them."""
    return {f"{name}{labels}": metric(server, name, model=LOOKUP, **labels) for name, labels in KV_SERIES}


def settled_kv_metrics(server: Server) -> dict[str, float]:
    """`kv_metrics` once the pool is drained and the gauges (refreshed every second) agree."""
    wait_drained(server)
    time.sleep(1.5)
    return kv_metrics(server)


def check_scores(reference, request: RankingRequest, served: np.ndarray, what: str = "") -> None:
    expected = reference.score(request.user_id, request.item_ids, request.action_ids, request.candidate_ids)
    assert served.shape == expected.shape, f"{what} user {request.user_id}: shape {served.shape} vs {expected.shape}"
    diff = float(np.abs(served - expected).max())
    assert diff <= TOLERANCE, f"{what} user {request.user_id}: max abs diff {diff:.2e} vs the reference"


def without_fault_candidate(request: RankingRequest) -> RankingRequest:
    cands = [c if c != FAULT_CANDIDATE else c + 1 for c in request.candidate_ids]
    return RankingRequest(request.user_id, request.item_ids, request.action_ids, cands)


def history(user_id: int, events: int, candidates: int = 16, seed: int = 0) -> RankingRequest:
    """A random valid request: `events` history events, `candidates` candidates."""
    rng = np.random.default_rng([user_id, events, seed])
    return without_fault_candidate(RankingRequest(
        user_id, rng.integers(1, 100_000, events).tolist(), rng.integers(0, 16, events).tolist(),
        rng.integers(1, 100_000, candidates).tolist()))


def evict_from_device(client, first_user: int, pages: int = 2 * FAULT_POOL_PAGES) -> None:
    """Push every committed page out of `fault_server`'s device pool by serving `pages` pages of
    fresh users' histories (max-length histories, 128 pages each), one at a time."""
    for i in range(max(1, pages // 128)):
        client.score(history(first_user + i, 2048, candidates=1))

