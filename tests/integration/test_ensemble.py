"""The product: hstu_ranking served by a real tritonserver, checked against the reference scorer."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from compute import HSTUConfig, fingerprint, history_tokens
from deploy.client import RankingClient, replay
from deploy.launcher import Server
from deploy.schema import ENSEMBLE, MONOLITHIC
from deploy.trace import TraceConfig, generate, perf_analyzer_data
from tests.conftest import launch_config

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4


def metric(server: Server, name: str, **labels: str) -> float:
    """Sum of the Prometheus series `name` whose labels include `labels`."""
    text = urllib.request.urlopen(server.metrics_url, timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def assert_matches_reference(trace, result, reference) -> None:
    assert not result.errors, f"errors: {list(result.errors.items())[:3]}"
    assert len(result.scores) == len(trace)
    for i, served in result.scores.items():
        r = trace[i]
        expected = reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids)
        assert served.shape == expected.shape, f"request {i}: shape {served.shape} vs {expected.shape}"
        diff = float(np.abs(served - expected).max())
        assert diff <= TOLERANCE, f"request {i} (user {r.user_id}): max abs diff {diff:.2e}"


def test_trace_over_8_streams_matches_reference_with_device_hits(server: Server, reference) -> None:
    trace = generate(TraceConfig(num_users=20, num_requests=200, seed=1, initial_events_median=120))
    hits_before = metric(server, "hstu_kv_lookups_total", model="kv_lookup_alloc", outcome="device_hit")

    result = replay(trace, server.grpc_url, model=ENSEMBLE, concurrency=8)

    assert_matches_reference(trace, result, reference)
    time.sleep(1.5)  # metrics are pulled by Triton on an interval
    hits = metric(server, "hstu_kv_lookups_total", model="kv_lookup_alloc", outcome="device_hit") - hits_before
    repeat_requests = len(trace) - len({r.user_id for r in trace})
    # A user's next request can overtake the commit of the previous one (commit follows FINAL),
    # so not every repeat is a hit; most must be.
    assert hits >= 0.5 * repeat_requests, f"device hits {hits} for {repeat_requests} repeat requests"


def test_http_generate_matches_reference(server: Server, reference) -> None:
    trace = generate(TraceConfig(num_users=5, num_requests=20, seed=2))
    result = replay(trace, server.http_url, model=ENSEMBLE, concurrency=2, http=True)
    assert_matches_reference(trace, result, reference)


def test_monolithic_gives_the_same_scores_as_the_ensemble(server: Server) -> None:
    trace = generate(TraceConfig(num_users=6, num_requests=30, seed=3))
    ensemble = replay(trace, server.grpc_url, model=ENSEMBLE, concurrency=2)
    monolithic = replay(trace, server.grpc_url, model=MONOLITHIC, concurrency=2)
    assert not ensemble.errors and not monolithic.errors
    for i in range(len(trace)):
        np.testing.assert_allclose(ensemble.scores[i], monolithic.scores[i], atol=TOLERANCE, rtol=0)


def test_perf_analyzer_streams_a_trace(server: Server, tmp_path: Path) -> None:
    trace = generate(TraceConfig(num_users=10, num_requests=40, seed=4))
    data = tmp_path / "data.json"
    data.write_text(json.dumps(perf_analyzer_data(trace)))
    cmd = [str(Path(sys.executable).parent / "perf_analyzer"), "-m", ENSEMBLE, "-u", server.grpc_url, "-i", "grpc",
           "--streaming", "--async", "--input-data", str(data), "--concurrency-range", "2",
           "--measurement-interval", "3000", "--stability-percentage", "100000", "--max-trials", "3"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    m = re.search(r"Request count: (\d+)", out.stdout)
    assert m and int(m.group(1)) > 0, out.stdout
    assert "error" not in out.stdout.lower(), out.stdout


def test_bad_request_names_the_field(server: Server) -> None:
    from deploy.client import RequestFailed
    from deploy.schema import RankingRequest

    with RankingClient(server.grpc_url) as client:
        with pytest.raises(RequestFailed, match="action_ids"):
            client.score(RankingRequest(1, [1, 2, 3], [0, 1], [5]))
        # The stream still works afterwards.
        assert client.score(RankingRequest(1, [1, 2, 3], [0, 1, 2], [5])).shape == (1, 3)


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory):
    """A server whose pool holds only a few users' histories: eviction and onboarding happen."""
    srv = Server(launch_config(tmp_path_factory.mktemp("small"), pool_pages=96))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


def test_small_pool_serves_many_users_correctly_with_host_hits(small_pool_server: Server, reference) -> None:
    trace = generate(TraceConfig(num_users=30, num_requests=150, seed=5, zipf_a=0.3, initial_events_median=150,
                                 initial_events_sigma=0.3))
    result = replay(trace, small_pool_server.grpc_url, model=ENSEMBLE, concurrency=2)
    assert_matches_reference(trace, result, reference)
    time.sleep(1.5)
    host_hits = metric(small_pool_server, "hstu_kv_lookups_total", model="kv_lookup_alloc", outcome="host_hit")
    onboarded = metric(small_pool_server, "hstu_kv_onboarded_pages_total", model="kv_lookup_alloc")
    assert host_hits > 0 and onboarded > 0, f"host hits {host_hits}, onboarded pages {onboarded}"


def test_unloading_kv_offload_flushes_every_offload(tmp_path: Path, reference) -> None:
    from kvlifecycle.store import open_store

    srv = Server(launch_config(tmp_path, model_control="explicit"))
    srv.start()
    try:
        trace = generate(TraceConfig(num_users=8, num_requests=40, seed=6, initial_events_median=300))
        result = replay(trace, srv.grpc_url, model=ENSEMBLE, concurrency=4)
        assert not result.errors

        unload = urllib.request.Request(f"http://{srv.http_url}/v2/repository/models/kv_offload/unload", data=b"{}")
        urllib.request.urlopen(unload, timeout=120).read()
        deadline = time.monotonic() + 120
        while _model_state(srv, "kv_offload") not in ("UNAVAILABLE", None) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _model_state(srv, "kv_offload") == "UNAVAILABLE"

        # Every full page of every request's history is in the host store now.
        model_dir = srv.settings.model_dir
        config, namespace = HSTUConfig.load(model_dir), fingerprint(model_dir)
        store = open_store("embedded", endpoint=srv.settings.store_endpoint, page_size=config.page_size,
                           rpc_timeout_s=5.0)
        try:
            for r in trace:
                tokens = history_tokens(r.item_ids, r.action_ids, config)
                full = (tokens.numel() // config.page_size) * config.page_size
                _, mask = store.get_match(tokens, namespace)
                held = int(np.asarray(mask, dtype=bool).sum())
                assert held == full, f"user {r.user_id}: store holds {held} of {full} full-page tokens"
        finally:
            store.close()
    finally:
        srv.stop()


def _model_state(server: Server, name: str) -> str | None:
    req = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}")
    for entry in json.loads(urllib.request.urlopen(req, timeout=10).read()):
        if entry["name"] == name:
            return entry.get("state")
    return None
