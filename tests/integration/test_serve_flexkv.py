"""Serving with ``--store flexkv`` on the GPU: FlexKV (built by deploy/build_flexkv.sh) as the host
tier behind the real ensemble, every score checked against the fp32 reference.

One server (CUDA pool of 384 pages, a few users' histories; FlexKV's CPU tier behind it):
- a trace over 8 streams whose working set is 3x the pool: correct, with host hits onboarded
  from FlexKV;
- two requests of one user sent together (the same history, or one a page longer): both correct;
- a user whose history changed after it was offloaded (an event rewritten mid-history): scored
  from the pages that still match, never from the stale ones;
- the FlexKV store process (and FlexKV's transfer process under it) killed mid-load: every
  request served by recompute; a restarted store gets the pool again and serves host hits.

Skipped without a CUDA device or without a FlexKV build (``deploy/gpu_run.sh flexkv`` runs it
on the GPU host).
"""
from __future__ import annotations

import signal
import time

import numpy as np
import psutil
import pytest
import torch

from compute import HSTUConfig, history_tokens
from deploy.client import RankingClient
from deploy.replay import replay
from deploy.runtime.schema import ENSEMBLE, RankingRequest
from deploy.trace import TraceConfig, generate
from kvlifecycle.store.flexkv import flexkv_unavailable_reason
from tests.helpers import metric, wait_for
from tests.reliability.conftest import (FAULT_POOL_PAGES, FaultServer, Load, evict_from_device, fire_together,
                                        history, owner_stats, store_errors, wait_drained)
from tests.conftest import launch_config

REASON = "no CUDA device" if not torch.cuda.is_available() else flexkv_unavailable_reason()
pytestmark = [pytest.mark.integration, pytest.mark.cuda,
              pytest.mark.skipif(REASON is not None, reason=f"serving with --store flexkv: {REASON}")]

TOLERANCE = 1e-3  # the CUDA package (fp32) vs the CPU fp32 reference


@pytest.fixture(scope="module")
def flexkv_server(tmp_path_factory):
    srv = FaultServer(launch_config(tmp_path_factory.mktemp("flexkv"), device="cuda", store="flexkv",
                                    pool_pages=FAULT_POOL_PAGES, store_dram_bytes=1 << 30))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def check(reference, request: RankingRequest, served: object, what: str) -> float:
    assert isinstance(served, np.ndarray), f"{what}: {served!r}"
    expected = reference.score(request.user_id, request.item_ids, request.action_ids, request.candidate_ids)
    assert served.shape == expected.shape, f"{what}: shape {served.shape} vs {expected.shape}"
    diff = float(np.abs(served - expected).max())
    assert diff <= TOLERANCE, f"{what} (user {request.user_id}): max abs diff {diff:.2e} vs the reference"
    return diff


def onboarded_pages(server) -> int:
    return owner_stats(server)["onboarded_pages"]


def test_a_trace_over_8_streams_is_correct_with_host_hits_from_flexkv(flexkv_server, reference) -> None:
    trace = generate(TraceConfig(num_users=30, num_requests=150, seed=5, zipf_a=0.3, initial_events_median=600,
                                 initial_events_sigma=0.3))
    before = owner_stats(flexkv_server)
    result = replay(trace, flexkv_server.grpc_url, model=ENSEMBLE, concurrency=8)
    assert not result.errors, f"errors: {list(result.errors.items())[:3]}"
    diffs = [check(reference, trace[i], result.scores.get(i), f"request {i}") for i in range(len(trace))]
    after = wait_drained(flexkv_server)
    host_hits = after["lookups_host_hit"] - before["lookups_host_hit"]
    onboarded = after["onboarded_pages"] - before["onboarded_pages"]
    print(f"flexkv trace: 150 requests at c=8, max abs diff {max(diffs):.2e}, {host_hits} host hits, "
          f"{onboarded} pages onboarded from FlexKV")
    assert host_hits > 0 and onboarded > 0, f"no host hit from FlexKV ({host_hits} hits, {onboarded} pages)"
    assert store_errors(flexkv_server) == 0, "store errors while FlexKV was up"


def test_two_requests_of_one_user_sent_together_are_both_correct(flexkv_server, reference) -> None:
    base = history(6000, 300, seed=4)
    items, actions = list(base.item_ids), list(base.action_ids)
    for round_ in range(6):
        shorter = RankingRequest(6000, list(items), list(actions), base.candidate_ids)
        items += [round_ + 1] * 40  # past a page boundary
        actions += [round_ % 16] * 40
        longer = RankingRequest(6000, list(items), list(actions), base.candidate_ids[:5])
        pairs = [shorter, shorter] if round_ % 2 else [shorter, longer]
        for request, outcome in zip(pairs, fire_together(flexkv_server.grpc_url, pairs)):
            check(reference, request, outcome, f"round {round_}")
    wait_drained(flexkv_server)


def test_a_changed_history_is_never_served_from_its_stale_pages(flexkv_server, reference) -> None:
    with RankingClient(flexkv_server.grpc_url) as client:
        user = history(7000, 800, seed=6)
        check(reference, user, client.score(user), "first request")
        wait_drained(flexkv_server)
        evict_from_device(client, first_user=7100)  # its pages now live in FlexKV only
        wait_drained(flexkv_server)
        before = onboarded_pages(flexkv_server)
        items = list(user.item_ids)
        items[500] += 1  # one event rewritten: pages from that one on are stale
        changed = RankingRequest(user.user_id, items, list(user.action_ids), user.candidate_ids)
        check(reference, changed, client.score(changed), "changed history")
        onboarded = onboarded_pages(flexkv_server) - before
        config = HSTUConfig.load(flexkv_server.settings.model_dir)
        unchanged = len(history_tokens(items[:500], user.action_ids[:500], config)) // config.page_size
        assert onboarded == unchanged, (f"onboarded {onboarded} pages from FlexKV: expected the {unchanged} "
                                        "whole pages before the rewritten event, and none after it")


def kill_store(server: FaultServer) -> None:
    """SIGKILL the store process and every process under it (FlexKV's transfer process), as an
    out-of-memory kill of the store's container would."""
    proc = psutil.Process(server.store.pid)
    for p in [*proc.children(recursive=True), proc]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    server.store.wait()


def test_flexkv_killed_mid_load_is_served_by_recompute_then_restarted(flexkv_server, reference) -> None:
    trace = generate(TraceConfig(num_users=20, num_requests=60, seed=11, zipf_a=0.5, initial_events_median=400,
                                 initial_events_sigma=0.4))
    errors_before = store_errors(flexkv_server)
    load = Load(flexkv_server.grpc_url, trace, concurrency=4)
    load.wait_done(12)
    kill_store(flexkv_server)
    try:
        load.wait_done(30)
    finally:  # the module's server gets its store back even when this test fails here
        flexkv_server.start_store()
    for i, outcome in sorted(load.join().items()):
        check(reference, trace[i], outcome, f"request {i} (store killed mid-load)")
    wait_for(lambda: store_errors(flexkv_server) > errors_before, 30, "the outage in hstu_kv_store_errors_total")

    # The restarted store gets the pool's memory again (on the owner's first NO_POOL) and serves
    # host hits: a fresh user offloaded, pushed off the device, then onboarded from FlexKV.
    with RankingClient(flexkv_server.grpc_url) as client:
        offloaded = metric(flexkv_server, "hstu_kv_offloaded_pages_total")
        probes: list[RankingRequest] = []

        def probe_reaches_the_store() -> bool:
            probes.append(history(8000 + len(probes), 300, seed=1))
            check(reference, probes[-1], client.score(probes[-1]), "after the restart")
            wait_drained(flexkv_server)
            return metric(flexkv_server, "hstu_kv_offloaded_pages_total") > offloaded

        started = time.monotonic()
        wait_for(probe_reaches_the_store, 240, "an offload to reach the restarted FlexKV store", interval_s=1.0)
        print(f"flexkv restart: {len(probes)} probe(s) over {time.monotonic() - started:.1f} s until an offload "
              "reached the restarted store")
        before = wait_drained(flexkv_server)
        evict_from_device(client, first_user=8100)
        check(reference, probes[-1], client.score(probes[-1]), "host hit after the restart")
    after = wait_drained(flexkv_server)
    assert after["lookups_host_hit"] > before["lookups_host_hit"], "no host hit after the restart"
    assert after["onboarded_pages"] > before["onboarded_pages"], "nothing onboarded after the restart"
