"""A dead Mooncake master (issue 15 part 2).

With `--store mooncake` the Mooncake client runs in hstu-serve's store process, never in a Triton
model process: the models speak the store protocol to that process. When it ran in the models, a
killed `mooncake_master` stalled them for about 100 s. Now, in the order an outage lives:
  1. the master up: requests served, their pages offloaded into the tier;
  2. the master killed: every request is served by recompute, with correct scores, each within
     seconds (a store timeout, never the stall), and a user evicted from the device is recomputed;
  3. the master restarted: the store process sets up again by itself, offloads reach the new
     master, and an evicted user comes back as a host hit.
"""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from deploy.client import RankingClient
from deploy.runtime.schema import RankingRequest
from kvlifecycle.store import open_store
from tests.conftest import LocalServer, launch_config
from tests.helpers import wait_for
from tests.kvlifecycle.store_harness import mooncake_skip_reason
from tests.reliability.conftest import check_scores, history, owner_stats, wait_drained

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL_PAGES = 256  # pages of 32 tokens: two max-length histories (128 pages each) evict everything else
OUTAGE_REQUEST_S = 10.0  # a request while the master is dead: a few store timeouts plus the compute


class Master:
    """A `mooncake_master` on one loopback port, killed and restarted there."""

    def __init__(self, log_path: Path) -> None:
        from kvlifecycle.store.processes import start_master

        self.log_path = log_path
        self.process = start_master(log_path=log_path)
        self.port = int(self.process.address.rpartition(":")[2])

    def kill(self) -> None:
        self.process.proc.kill()
        self.process.proc.wait()

    def restart(self) -> None:
        from kvlifecycle.store.processes import start_master

        self.process = start_master(self.port, log_path=self.log_path)


@pytest.fixture(scope="module")
def mooncake_server(tmp_path_factory):
    reason = mooncake_skip_reason()
    if reason is not None:
        pytest.skip(f"mooncake: {reason}")
    root = tmp_path_factory.mktemp("mooncake-server")
    master = Master(root / "mooncake-master.log")
    server = LocalServer(launch_config(root, store="mooncake", store_endpoint=master.process.address,
                                       pool_pages=POOL_PAGES, mooncake_segment_bytes=64 << 20))
    try:
        server.start()
        yield server, master
    finally:
        server.stop()
        master.process.stop()


def evict(server: LocalServer, client: RankingClient, first_user: int) -> None:
    """Push every committed page out of the device pool: two max-length histories, one at a time.
    Each fills half the pool, and its pages stay pinned until their offload is reaped (kv_offload
    offloads after it answers), so the second waits for the first's offload."""
    for i in range(2):
        client.score(history(first_user + i, 2048, candidates=1))
        wait_drained(server)


def grown(r: RankingRequest) -> RankingRequest:
    return RankingRequest(r.user_id, r.item_ids + [5, 6], r.action_ids + [1, 2], r.candidate_ids)


def pages_put(server: LocalServer) -> int:
    """Pages the store process has put into the tier so far (its own counter: exact, immediate)."""
    with open_store("mooncake", endpoint=server.settings.store_socket, page_size=32, rpc_timeout_s=30.0) as store:
        stats = store.server_stats()
    assert stats is not None, f"the store process at {server.settings.store_socket} does not answer"
    return stats.get("put_pages", 0)


def test_dead_master_costs_recompute_within_the_store_timeout_then_service_recovers(mooncake_server,
                                                                                   reference) -> None:
    server, master = mooncake_server
    with RankingClient(server.grpc_url, timeout_s=120) as client:
        # 1. The master up: a user's pages reach the tier.
        user = history(9000, 300, seed=7)
        check_scores(reference, user, client.score(user))
        wait_drained(server)  # every offload reaped
        assert pages_put(server) >= 300 * 2 // 32, "the first user's pages did not reach the tier"

        # 2. The master killed: served by recompute, each request within seconds.
        master.kill()
        outage = [grown(user), history(9100, 200, seed=7), history(9101, 50, seed=7)]
        for r in outage:
            start = time.monotonic()
            check_scores(reference, r, client.score(r), what="master dead,")
            took = time.monotonic() - start
            assert took < OUTAGE_REQUEST_S, f"user {r.user_id} took {took:.1f}s with the master dead (a stall)"
        evict(server, client, first_user=9200)
        before = owner_stats(server)
        start = time.monotonic()
        again = grown(grown(user))
        check_scores(reference, again, client.score(again), what="evicted, master dead,")
        took = time.monotonic() - start
        assert took < OUTAGE_REQUEST_S, f"an evicted user took {took:.1f}s with the master dead (a stall)"
        assert owner_stats(server)["lookups_host_hit"] == before["lookups_host_hit"], "a host hit from a dead tier"
        wait_drained(server)

        # 3. The master back: the store process sets up again; offloads and host hits resume.
        master.restart()
        probes: list[RankingRequest] = []

        def probe_reaches_the_tier() -> bool:
            put_before = pages_put(server)
            probes.append(history(9300 + len(probes), 300, seed=7))
            check_scores(reference, probes[-1], client.score(probes[-1]), what="master restarted,")
            wait_drained(server)  # its offload reaped: put, or failed while the store sets up again
            return pages_put(server) > put_before

        wait_for(probe_reaches_the_tier, 120, "an offload to reach the restarted master", interval_s=1.0)
        back = probes[-1]
        evict(server, client, first_user=9400)
        before = owner_stats(server)
        check_scores(reference, grown(back), client.score(grown(back)), what="host hit after the restart,")
        after = wait_drained(server)
    assert after["lookups_host_hit"] == before["lookups_host_hit"] + 1, f"no host hit after the restart: {after}"
    assert after["onboarded_pages"] > before["onboarded_pages"], f"nothing onboarded after the restart: {after}"

