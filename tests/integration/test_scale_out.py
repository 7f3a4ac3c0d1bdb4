"""Scale-out: two tritonservers behind nginx (consistent hash on x-user-id), one Mooncake tier.

One scenario, in the order a deployment lives it:
  1. a trace over unary gRPC and a few HTTP /generate requests through the
     proxy: every score matches the reference scorer; nginx sent each user to one server, and
     each server's kv_lookup_alloc counted exactly the requests of the users sent to it;
  2. server 0 stops (it flushes its offloads into the shared tier); its users' next requests
     go to server 1, are served correctly, and server 1 finds their pages in the tier (host hits);
  3. the Mooncake master dies: server 1 serves new users by recompute, each within seconds (its
     Mooncake client is in its store process, not in the models); the master restarted, the
     memory node mounts its segment again and server 1's offloads reach the tier;
  4. the cluster stops and leaves no process behind.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from pathlib import Path

import pytest

from deploy.client import ROUTE_HEADER
from deploy.cluster import Cluster, ClusterConfig
from deploy.launcher import LaunchConfig, Server
from deploy.replay import replay
from deploy.runtime.schema import ENSEMBLE, RankingRequest
from deploy.runtime.settings import ServingSettings
from deploy.trace import TraceConfig, generate
from kvlifecycle.store import open_store
from kvlifecycle.store.processes import start_master
from tests.conftest import free_ports
from tests.integration.test_ensemble import assert_matches_reference, metric

pytestmark = [pytest.mark.integration, pytest.mark.slow]

OUTCOMES = ("device_hit", "host_hit", "miss")
OUTAGE_REQUEST_S = 10.0  # a request while the master is dead: a few store timeouts plus the compute


def lookups(server: Server, outcome: str | None = None) -> float:
    outcomes = OUTCOMES if outcome is None else (outcome,)
    return sum(metric(server, "hstu_kv_lookups_total", model="kv_lookup_alloc", outcome=o) for o in outcomes)


GRPC_METHOD = "/inference.GRPCInferenceService/ModelInfer"  # the unary call, as nginx logs its URI


def routed_users(cluster: Cluster, uri_part: str) -> dict[int, set[str]]:
    """user -> the servers that answered it, from nginx's access log (lines whose URI has
    `uri_part`). A line lists every upstream tried ("A, B" after a failover); the last answered."""
    routes: dict[int, set[str]] = defaultdict(set)
    for line in cluster.access_log.read_text().splitlines():
        m = re.search(r"user=(\d+) upstream=(.+?) status=.*uri=(\S+)", line)
        if m and uri_part in m.group(3):
            routes[int(m.group(1))].add(m.group(2).split(", ")[-1])
    return routes


def wait_for_metrics(server: Server, expected_lookups: float, timeout_s: float = 30.0) -> None:
    """Triton pulls the models' counters on an interval: wait until they add up."""
    deadline = time.monotonic() + timeout_s
    while lookups(server) < expected_lookups and time.monotonic() < deadline:
        time.sleep(0.5)


def extend(r: RankingRequest, events: int = 3) -> RankingRequest:
    """The user's next request: a few more history events, the same candidates."""
    items = [*r.item_ids, *[(r.item_ids[-1] + k) % 99_999 + 1 for k in range(1, events + 1)]]
    actions = [*r.action_ids, *[k % 16 for k in range(events)]]
    return RankingRequest(r.user_id, items, actions, r.candidate_ids)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ports = free_ports(9)
    config = ClusterConfig(
        num_servers=2, http_port=ports[0], grpc_port=ports[1], mooncake_port=ports[2],
        server_ports=[tuple(ports[3:6]), tuple(ports[6:9])], segment_bytes=256 << 20,
        run_dir=tmp_path_factory.mktemp("cluster") / "run", ready_timeout_s=600.0,
        server=LaunchConfig(ServingSettings(pool_pages=1024), ready_timeout_s=600.0))
    c = Cluster(config)
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_users_stick_to_one_server_and_move_with_their_cache(cluster: Cluster, reference) -> None:
    s0, s1 = cluster.servers
    trace = generate(TraceConfig(num_users=12, num_requests=60, seed=11, zipf_a=0.5, initial_events_median=80,
                                 initial_events_sigma=0.3))

    # 1. unary gRPC (the user id in each call's header) through the proxy; then HTTP /generate.
    result = replay(trace, cluster.grpc_url, model=ENSEMBLE, concurrency=3, route_header=ROUTE_HEADER,
                    timeout_s=120.0)
    assert_matches_reference(trace, result, reference)
    http_trace = trace[:8]
    http_result = replay(http_trace, cluster.http_url, model=ENSEMBLE, concurrency=2, http=True,
                         route_header=ROUTE_HEADER, timeout_s=120.0)
    assert_matches_reference(http_trace, http_result, reference)

    users = {r.user_id for r in trace}
    deadline = time.monotonic() + 10  # nginx logs a call when it ends
    while set(routed_users(cluster, GRPC_METHOD)) != users and time.monotonic() < deadline:
        time.sleep(0.2)
    grpc_routes = routed_users(cluster, GRPC_METHOD)
    http_routes = routed_users(cluster, "/generate")
    assert set(grpc_routes) == users, f"access log users {sorted(grpc_routes)} vs trace users {sorted(users)}"
    for routes in (grpc_routes, http_routes):
        split = {u: sorted(ups) for u, ups in routes.items() if len(ups) != 1}
        assert not split, f"users routed to more than one server: {split}"
    grpc_of = {s0.grpc_url: s0, s1.grpc_url: s1}
    http_of = {s0.http_url: s0, s1.http_url: s1}
    expected = {s0.grpc_url: 0, s1.grpc_url: 0}
    for r in trace:
        expected[grpc_routes[r.user_id].copy().pop()] += 1
    for r in http_trace:
        expected[http_of[http_routes[r.user_id].copy().pop()].grpc_url] += 1
    assert min(expected.values()) > 0, f"the ring sent every user to one server: {expected}"
    for url, server in grpc_of.items():
        wait_for_metrics(server, expected[url])
        assert lookups(server) == expected[url], (
            f"{url}: kv_lookup_alloc counted {lookups(server)} lookups; the access log routed {expected[url]} "
            "requests to it")

    # 2. Server 0 stops; its users' next requests go to server 1 and hit the shared tier.
    moved = sorted(u for u, ups in grpc_routes.items() if ups == {s0.grpc_url})
    last = {r.user_id: r for r in trace}
    follow_up = [extend(last[u]) for u in moved]
    host_hits_before, lookups_before = lookups(s1, "host_hit"), lookups(s1)
    cluster.stop_server(0)
    result = replay(follow_up, cluster.grpc_url, model=ENSEMBLE, concurrency=2, route_header=ROUTE_HEADER,
                    timeout_s=120.0)
    assert_matches_reference(follow_up, result, reference)
    wait_for_metrics(s1, lookups_before + len(follow_up))
    host_hits = lookups(s1, "host_hit") - host_hits_before
    assert lookups(s1) - lookups_before == len(follow_up), "server 1 did not serve every moved user"
    # Each moved user's first request on server 1 misses its device pool; its pages, offloaded
    # by server 0, are in the tier (a get_prefix that times out on a loaded machine is a miss).
    assert host_hits > 0, f"server 1: no host hits for {len(moved)} users moved from server 0"
    deadline = time.monotonic() + 10
    while not all(s1.grpc_url in routed_users(cluster, GRPC_METHOD)[u] for u in moved):
        assert time.monotonic() < deadline, f"access log: moved users {moved} not all answered by {s1.grpc_url}"
        time.sleep(0.2)

    # 3. The master dies and comes back.
    cluster.master.proc.kill()
    cluster.master.proc.wait()
    outage = generate(TraceConfig(num_users=3, num_requests=3, seed=12, initial_events_median=80))
    result = replay(outage, cluster.grpc_url, model=ENSEMBLE, concurrency=1, route_header=ROUTE_HEADER,
                    timeout_s=120.0)
    assert_matches_reference(outage, result, reference, what="master dead:")
    assert max(result.latencies_s) < OUTAGE_REQUEST_S, f"a stall with the master dead: {result.latencies_s}"
    cluster.master = start_master(cluster.config.mooncake_port, log_path=cluster.run_dir / "mooncake-master.log")
    probes = iter(generate(TraceConfig(num_users=30, num_requests=30, seed=13, initial_events_median=80)))

    def probe_reaches_the_tier() -> bool:
        before = pages_put(s1)
        probe = [next(probes)]
        result = replay(probe, cluster.grpc_url, model=ENSEMBLE, route_header=ROUTE_HEADER, timeout_s=120.0)
        assert_matches_reference(probe, result, reference, what="master restarted:")
        deadline = time.monotonic() + 3  # the offload runs after the answer
        while pages_put(s1) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        return pages_put(s1) > before

    deadline = time.monotonic() + 90
    while not probe_reaches_the_tier():
        assert time.monotonic() < deadline, "no offload reached the restarted master within 90 s"

    # 4. A clean stop leaves nothing behind (nor any process in the children's process groups).
    pids = set(cluster.process_ids())
    cluster.stop()
    assert not leftovers(pids), f"still running after stop: {leftovers(pids)}"


def pages_put(server: Server) -> int:
    """Pages the server's store process has put into the tier (its own counter: exact, immediate)."""
    with open_store("mooncake", endpoint=server.settings.store_socket, page_size=32, rpc_timeout_s=30.0) as store:
        stats = store.server_stats()
    assert stats is not None, f"the store process at {server.settings.store_socket} does not answer"
    return stats.get("put_pages", 0)


def leftovers(pids: set[int]) -> list[str]:
    """Live (not zombie) processes whose pid or process group is in `pids`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            pid, rest = stat.read_text().split(" (", 1)
        except OSError:
            continue
        fields = rest.rsplit(") ", 1)[1].split()
        state, pgrp = fields[0], int(fields[2])
        if state != "Z" and (int(pid) in pids or pgrp in pids):
            found.append(f"pid {pid} (group {pgrp}, state {state})")
    return found
