"""Host hits copied by hstu_compute from the store's shared DRAM tier (`--host-hit-copy reader`), on
a real tritonserver and store process, through the store's failures:

1. users pushed out of a small device pool come back as host hits that hstu_compute copied
   (`hstu_kv_onboarded_pages_total{model="hstu_compute"}` moves, kv_lookup_alloc's does not);
2. with the store killed, the same users are served by recompute, every score right;
3. after a stop and start of the whole server with the disk tier, they are host hits again:
   `locate` reads their pages from disk into the new shared slab, and hstu_compute copies them;
4. with a store whose every match stalls past the store timeout, host hits are computed: a
   request waits for the store at most one timeout, never for the stall.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from deploy.client import RankingClient
from deploy.runtime.schema import COMPUTE, LOOKUP, RankingRequest
from tests.conftest import start_server
from tests.helpers import metric, wait_for
from tests.conftest import launch_config
from tests.reliability.conftest import FaultServer, check_scores, history, wait_drained

pytestmark = [pytest.mark.integration, pytest.mark.slow]

POOL_PAGES = 64  # the four users take 50; the fillers push them out


def _grown(r: RankingRequest, step: int) -> RankingRequest:
    """The user's next request: one more event."""
    return RankingRequest(r.user_id, r.item_ids + [5 + step], r.action_ids + [3], r.candidate_ids)


def _maps_the_slab(server, model: str) -> bool:
    """Whether the stub process of `model` maps the store's DRAM tier (its memfd, `kvlifecycle.store.slab`)."""
    stubs = [p for p in psutil.Process(server.triton.pid).children(recursive=True)
             if any(f"/{model}/" in arg for arg in p.cmdline())]
    assert stubs, f"no stub process of {model}"
    return any("memfd:hstu-kv-dram-tier" in Path(f"/proc/{p.pid}/maps").read_text() for p in stubs)


def _copied(server) -> tuple[float, float]:
    return (metric(server, "hstu_kv_onboarded_pages_total", model=COMPUTE),
            metric(server, "hstu_kv_onboarded_pages_total", model=LOOKUP))


def test_reader_copies_through_a_store_kill_and_a_restart_from_the_disk_tier(tmp_path: Path, reference) -> None:
    srv = start_server(tmp_path, pool_pages=POOL_PAGES, host_hit_copy="reader", store_disk_dir=tmp_path / "disk")
    users = [history(9000 + i, 200 + 50 * i, seed=7) for i in range(4)]
    fillers = [history(9100 + i, 400, seed=8) for i in range(6)]
    try:
        # hstu_compute maps the store's slab at load, not at its first host hit
        wait_for(lambda: _maps_the_slab(srv, "hstu_compute"), 30, "hstu_compute to map the store's slab before any request")
        with RankingClient(srv.grpc_url) as client:
            def serve(requests: list[RankingRequest], what: str) -> None:
                for r in requests:
                    check_scores(reference, r, client.score(r), what=what)
                wait_drained(srv)  # every offload reaped before the next step

            serve(users, "first visit,")
            serve(fillers, "filler,")  # the users' pages leave the device pool
            step1 = [_grown(r, 1) for r in users]
            serve(step1, "host hit copied by hstu_compute,")
            wait_for(lambda: _copied(srv)[0] > 0, 30, lambda: f"hstu_compute's onboarded pages: {_copied(srv)}")
            assert _copied(srv)[1] == 0, "kv_lookup_alloc's store copy path ran"

            serve(fillers[:3] + [_grown(r, 1) for r in fillers[3:]], "filler again,")
            os.kill(srv.store.pid, signal.SIGKILL)
            srv.store.wait()
            step2 = [_grown(r, 2) for r in step1]
            serve(step2, "with the store killed,")  # recomputed: the store cannot answer locate

        srv.stop()
        srv.start()  # a new store process: it finds the users' pages in its disk tier
        copied_before = _copied(srv)[0]
        with RankingClient(srv.grpc_url) as client:
            for r in [_grown(r, 3) for r in step2]:
                check_scores(reference, r, client.score(r), what="after the restart, from the disk tier,")
        wait_for(lambda: _copied(srv)[0] > copied_before, 30,
                 lambda: f"hstu_compute to copy pages read from the disk tier: {_copied(srv)} (was {copied_before})")
    finally:
        srv.stop()


def test_a_store_whose_locate_stalls_costs_at_most_its_timeout(tmp_path: Path, reference) -> None:
    # The disk tier: the restarted (stalling) store holds the users' pages, so the owner hands their
    # host hits to hstu_compute, whose locate is what stalls.
    srv = FaultServer(launch_config(tmp_path, pool_pages=POOL_PAGES, host_hit_copy="reader", store_timeout_s=0.5,
                                    store_disk_dir=tmp_path / "disk"))
    users = [history(9200 + i, 300, seed=9) for i in range(2)]
    fillers = [history(9300 + i, 400, seed=10) for i in range(5)]
    srv.start()
    try:
        with RankingClient(srv.grpc_url) as client:
            for r in users + fillers:  # the users' pages offloaded, then pushed out of the pool
                check_scores(reference, r, client.score(r), what="before the stall,")
                wait_drained(srv)
            srv.stop_store()  # flushes the disk tier
            srv.store_match_delay_s = 3.0  # every get_prefix and locate waits 3 s: past the 0.5 s timeout
            srv.start_store()
            for r in users:
                grown = _grown(r, 1)
                started = time.monotonic()
                check_scores(reference, grown, client.score(grown), what="with a stalled store,")
                took = time.monotonic() - started
                assert took < 2.5, f"a host hit waited {took:.2f} s: longer than the store's timeout plus compute"
        assert "match start" in srv.store_calls(), "hstu_compute never asked the stalled store"
    finally:
        srv.stop()
