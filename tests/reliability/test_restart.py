"""Restart: a clean stop and start of the whole server with the store's disk
tier loses no user's KV: after the restart the users' histories are host hits (onboarded from
the disk tier into the new, empty device pool) and their scores stay correct."""
from __future__ import annotations

import pytest

from deploy.client import RankingClient
from deploy.launcher import Server
from deploy.runtime.schema import RankingRequest
from tests.helpers import metric, wait_for
from tests.reliability.conftest import LOOKUP, check_scores, history, owner_stats, wait_drained

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_stop_and_start_with_the_disk_tier_brings_users_back_as_host_hits(fault_server: Server,
                                                                          reference) -> None:
    users = [history(7000 + i, 200 + 50 * i, seed=5) for i in range(4)]
    with RankingClient(fault_server.grpc_url) as client:
        for r in users:
            check_scores(reference, r, client.score(r))
    wait_drained(fault_server)  # every put reaped; the stop below flushes the disk write-behind queue

    fault_server.stop()
    assert fault_server.store is None and fault_server.triton is None
    fault_server.start()

    assert owner_stats(fault_server)["pages_in_use"] == 0, "a restarted server starts with an empty device pool"
    full_pages = sum(len(r.item_ids) * 2 // 32 for r in users)
    with RankingClient(fault_server.grpc_url) as client:
        for r in users:
            grown = RankingRequest(r.user_id, r.item_ids + [5], r.action_ids + [3], r.candidate_ids)
            check_scores(reference, grown, client.score(grown), what="after the restart,")
    stats = wait_drained(fault_server)
    assert stats["lookups_host_hit"] == len(users), f"expected {len(users)} host hits after the restart: {stats}"
    assert stats["onboarded_pages"] == full_pages, f"expected every full page ({full_pages}) onboarded: {stats}"

    def shown() -> tuple[float, float]:
        return (metric(fault_server, "hstu_kv_lookups_total", model=LOOKUP, outcome="host_hit"),
                metric(fault_server, "hstu_kv_onboarded_pages_total", model=LOOKUP))

    wait_for(lambda: shown() == (len(users), full_pages), 30,
             lambda: f"the metrics port to show {len(users)} host hits and {full_pages} onboarded pages: {shown()}")
