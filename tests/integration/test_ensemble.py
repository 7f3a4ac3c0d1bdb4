"""The product: hstu_ranking served by a real tritonserver, checked against the reference scorer;
and hstu_monolithic, the baseline every comparison rests on, through the same replays (8 and 16
clients, a small pool with eviction and host hits, a bad request)."""
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
from deploy.client import ROUTE_HEADER, RankingClient
from deploy.launcher import Server
from deploy.metrics import scrape
from deploy import make_configs
from deploy.replay import replay
from deploy.runtime.schema import COMPUTE, ENSEMBLE, LOOKUP, MONOLITHIC, OFFLOAD
from deploy.runtime.settings import DEFAULT_MODEL_DIR, DEFAULT_MODEL_REPOSITORY
from deploy.trace import TraceConfig, generate, perf_analyzer_data
from kvlifecycle.stats_keys import LOOKUP_OUTCOMES
from tests.conftest import rendered_repository, start_server
from tests.helpers import ModelStats, assert_scores_match, metric, pages_in_store, wait_for

pytestmark = pytest.mark.integration

TOLERANCE = 1e-4
MODELS = [ENSEMBLE, MONOLITHIC]
KV_OWNER = {ENSEMBLE: LOOKUP, MONOLITHIC: MONOLITHIC}  # the `model` label of each public model's KV series
# Added to a trace's seed for the monolithic: both models key pages in one namespace and share the
# host store, so the same histories would find the other model's pages there.
SEED_OFFSET = {ENSEMBLE: 0, MONOLITHIC: 100}


def assert_matches_reference(trace, result, reference, what: str = "") -> None:
    """Every request of `trace` was scored, and each score equals the reference scorer's."""
    assert not result.errors, f"{what} errors: {list(result.errors.items())[:3]}"
    assert sorted(result.scores) == list(range(len(trace))), f"{what}: {len(result.scores)} of {len(trace)} scored"
    for i, served in result.scores.items():
        r = trace[i]
        expected = reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids)
        assert served.shape == expected.shape, f"{what} request {i}: shape {served.shape} vs {expected.shape}"
        diff = float(np.abs(served - expected).max())
        assert diff <= TOLERANCE, f"{what} request {i} (user {r.user_id}): max abs diff {diff:.2e}"


def lookups(server: Server, outcome: str, owner: str = LOOKUP) -> float:
    return metric(server, "hstu_kv_lookups_total", model=owner, outcome=outcome)


def settled_lookups(server: Server, owner: str = LOOKUP) -> dict[str, float]:
    """The lookup counters once they stop moving. The server is the session's: a test before this
    one may have sent requests whose lookups the models publish up to a second later (their
    metrics thread), and those must not count as this test's."""
    last: dict[str, float] | None = None
    for _ in range(30):
        now = {o: lookups(server, o, owner) for o in LOOKUP_OUTCOMES}
        if now == last:
            return now
        last = now
        time.sleep(1.5)  # longer than one publishing interval (METRICS_INTERVAL_S, 1 s)
    raise AssertionError(f"{owner}'s lookup counters kept moving with no request sent: {last}")


@pytest.mark.parametrize("model", MODELS)
def test_trace_over_8_streams_matches_reference_and_repeats_find_their_pages(server: Server, reference,
                                                                              model: str) -> None:
    """kv_offload (or hstu_monolithic) commits a request's pages before it answers, so a user's
    next request, sent after that answer, finds every full page of it on the device: every
    repeat is a device hit, and no lookup meets a prefix still being written. Each of the 8
    streams owns whole users and sends a user's requests in trace order, one at a time (`replay`
    with a route header)."""
    owner = KV_OWNER[model]
    trace = generate(TraceConfig(num_users=20, num_requests=200, seed=1 + SEED_OFFSET[model],
                                 initial_events_median=120))
    page_size = HSTUConfig.load(server.settings.model_dir).page_size
    before = settled_lookups(server, owner)
    uncommitted_before = uncommitted_prefix_lookups(server, owner)
    previous: dict[int, int] = {}  # user -> history events of the user's previous request
    repeats_with_a_full_page = 0
    for r in trace:
        if previous.get(r.user_id, 0) * 2 >= page_size:
            repeats_with_a_full_page += 1
        previous[r.user_id] = len(r.item_ids)

    result = replay(trace, server.grpc_url, model=model, concurrency=8, route_header=ROUTE_HEADER)

    assert_matches_reference(trace, result, reference, what=model)
    wait_for(lambda: sum(lookups(server, o, owner) - n for o, n in before.items()) >= len(trace), 30,
             f"{owner}'s lookup counters to count {len(trace)} lookups")
    seen = {o: lookups(server, o, owner) - n for o, n in before.items()}
    assert seen["device_hit"] == repeats_with_a_full_page, (
        f"{seen}: expected a device hit for each of the {repeats_with_a_full_page} repeat requests whose user's "
        f"previous request had a full page ({len(trace) - len(previous)} repeat requests)")
    assert uncommitted_prefix_lookups(server, owner) == uncommitted_before, "a lookup met a prefix not committed yet"


def uncommitted_prefix_lookups(server: Server, owner: str = LOOKUP) -> float:
    return metric(server, "hstu_kv_uncommitted_prefix_lookups_total", model=owner)


def test_committed_configs_are_the_generator_output() -> None:
    expected = make_configs.render(make_configs.num_tasks_of(DEFAULT_MODEL_DIR))
    for name, text in expected.items():
        committed = (DEFAULT_MODEL_REPOSITORY / name / "config.pbtxt").read_text()
        assert committed == text, f"{name}/config.pbtxt is stale: run `python -m deploy.make_configs`"


@pytest.mark.parametrize("step", [LOOKUP, COMPUTE, OFFLOAD])
def test_steps_batch_as_configured_under_concurrent_load(server: Server, reference, step: str) -> None:
    """Each step serves the requests queued while its one instance was busy in one execute
    (Triton's statistics show batches of more than one), and every score is right."""
    trace = generate(TraceConfig(num_users=48, num_requests=64, seed=7, zipf_a=0.2, initial_events_median=150))
    before = ModelStats.read(server, step)

    result = replay(trace, server.grpc_url, model=ENSEMBLE, concurrency=16)

    assert_matches_reference(trace, result, reference)
    batched = ModelStats.read(server, step) - before
    assert batched.inferences == len(trace), batched
    assert sum(size * n for size, n in batched.batches.items()) == batched.inferences, batched
    assert max(batched.batches) > 1 and batched.executions < batched.inferences, (
        f"{step} ran {batched.inferences} requests at concurrency 16 one by one: {batched}")
    assert max(batched.batches) <= (make_configs.LIFECYCLE_MAX_BATCH_SIZE if step != COMPUTE else 64), batched
    print(f"{step} at concurrency 16: {batched.inferences} requests in {batched.executions} executions, "
          f"batch sizes {dict(sorted(batched.batches.items()))}")


def test_monolithic_at_concurrency_16_matches_reference(server: Server, reference) -> None:
    """The trace the batching test above sends at concurrency 16, to the baseline (one instance,
    one request per execute): every request queued behind others is still scored right."""
    trace = generate(TraceConfig(num_users=48, num_requests=64, seed=7 + SEED_OFFSET[MONOLITHIC], zipf_a=0.2,
                                 initial_events_median=150))
    result = replay(trace, server.grpc_url, model=MONOLITHIC, concurrency=16)
    assert_matches_reference(trace, result, reference, what=MONOLITHIC)


def test_http_generate_matches_reference(server: Server, reference) -> None:
    trace = generate(TraceConfig(num_users=5, num_requests=20, seed=2))
    result = replay(trace, server.http_url, model=ENSEMBLE, concurrency=2, http=True)
    assert_matches_reference(trace, result, reference)


def test_monolithic_and_ensemble_both_match_the_reference(server: Server, reference) -> None:
    trace = generate(TraceConfig(num_users=6, num_requests=30, seed=3))
    for model in (ENSEMBLE, MONOLITHIC):
        result = replay(trace, server.grpc_url, model=model, concurrency=2)
        assert_matches_reference(trace, result, reference, what=model)


PA_CONCURRENCY = 2


def test_perf_analyzer_streams_a_trace_with_sane_figures(server: Server, tmp_path: Path) -> None:
    """perf_analyzer's figures obey Little's law (throughput x latency = the requests in flight: at
    most the concurrency, and close to it in a closed loop), and Triton counted every request it
    reports as a success. Its stability check is off: on 2 shared cores its 2 s windows varied
    from 0.4 to 55 requests/s and 10 windows never agreed within 25%."""
    trace = generate(TraceConfig(num_users=10, num_requests=40, seed=4))
    data = tmp_path / "data.json"
    data.write_text(json.dumps(perf_analyzer_data(trace)))
    cmd = [str(Path(sys.executable).parent / "perf_analyzer"), "-m", ENSEMBLE, "-u", server.grpc_url, "-i", "grpc",
           "--streaming", "--async", "--input-data", str(data), "--concurrency-range", str(PA_CONCURRENCY),
           "--measurement-interval", "2000", "--stability-percentage", "100000", "--max-trials", "3"]
    before = ModelStats.read(server, ENSEMBLE)

    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    assert out.returncode == 0 and "error" not in out.stdout.lower(), out.stdout + out.stderr
    served = ModelStats.read(server, ENSEMBLE) - before
    client = out.stdout.split("Client:", 1)[1].split("Server:", 1)[0]
    figure = lambda label: float(re.search(rf"{label}: ([\d.]+)", client).group(1))  # noqa: E731
    count, throughput = figure("Request count"), figure("Throughput")
    latency_s, p50_s, p90_s, p95_s, p99_s = (figure(f"{q} latency") / 1e6 for q in ("Avg", "p50", "p90", "p95", "p99"))
    assert count > 0 and 0 < p50_s <= p90_s <= p95_s <= p99_s, client  # a latency distribution
    in_flight = throughput * latency_s
    assert 0.5 * PA_CONCURRENCY <= in_flight <= 1.1 * PA_CONCURRENCY, (
        f"throughput {throughput}/s x latency {latency_s * 1e3:.1f} ms = {in_flight:.2f} in flight at concurrency "
        f"{PA_CONCURRENCY}: {client}")
    assert served.fail == 0 and served.success >= count, f"Triton counted {served}; perf_analyzer {count} requests"


@pytest.mark.parametrize("model", MODELS)
def test_bad_request_names_the_field(server: Server, reference, model: str) -> None:
    from deploy.client import RequestFailed
    from deploy.runtime.schema import RankingRequest

    with RankingClient(server.grpc_url, model=model) as client:
        with pytest.raises(RequestFailed, match="action_ids"):
            client.score(RankingRequest(1, [1, 2, 3], [0, 1], [5]))
        # The stream still works afterwards: the next request gets the reference's scores.
        assert_scores_match(client.score(RankingRequest(1, [1, 2, 3], [0, 1, 2], [5])),
                            reference.score(1, [1, 2, 3], [0, 1, 2], [5]), TOLERANCE, "after the bad request")


@pytest.fixture(scope="module", params=["store", "reader"], ids=["store-copies", "reader-copies"])
def small_pool_server(request, tmp_path_factory):
    """A server whose pool holds only a few users' histories: eviction and onboarding happen; the
    ensemble's host hits copied by the store, or by hstu_compute from the store's shared slab."""
    srv = start_server(tmp_path_factory.mktemp("small"), pool_pages=96, host_hit_copy=request.param)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.mark.parametrize("model", MODELS)
def test_small_pool_serves_many_users_correctly_with_host_hits(small_pool_server: Server, reference,
                                                                model: str) -> None:
    """Each model has a pool of its own of 96 pages, far fewer than the trace's users need: pages
    are evicted, and users come back as host hits (onboarded from the host store). With
    host_hit_copy=reader the ensemble's pages are copied by hstu_compute, which counts them."""
    owner = KV_OWNER[model]
    copier = COMPUTE if model == ENSEMBLE and small_pool_server.settings.host_hit_copy == "reader" else owner
    trace = generate(TraceConfig(num_users=30, num_requests=150, seed=5 + SEED_OFFSET[model], zipf_a=0.3,
                                 initial_events_median=150, initial_events_sigma=0.3))
    result = replay(trace, small_pool_server.grpc_url, model=model, concurrency=2)
    assert_matches_reference(trace, result, reference, what=model)
    shown = lambda: (lookups(small_pool_server, "host_hit", owner),  # noqa: E731
                     metric(small_pool_server, "hstu_kv_onboarded_pages_total", model=copier))
    wait_for(lambda: min(shown()) > 0, 30, lambda: f"{owner}'s host hits and {copier}'s onboarded pages "
                                                   f"(so far {shown()})")
    if copier == COMPUTE:  # none went through the store's copy path
        assert metric(small_pool_server, "hstu_kv_onboarded_pages_total", model=LOOKUP) == 0


def test_unloading_kv_offload_flushes_every_offload(tmp_path: Path, reference) -> None:
    """With two kv_offload instances and a queue delay of their own (`make_configs
    --offload-instances 2 --offload-queue-delay-us 300`): each commits and offloads, their counters
    add up in one series, each reports its own queue depth, and unloading the model flushes both."""
    repository = rendered_repository(tmp_path, offload_instances=2, offload_queue_delay_us=300)
    delays = {step: re.search(r"max_queue_delay_microseconds: (\d+)", (repository / step / "config.pbtxt").read_text())[1]
              for step in (LOOKUP, COMPUTE, OFFLOAD)}
    assert delays == {LOOKUP: "0", COMPUTE: "0", OFFLOAD: "300"}, delays
    srv = start_server(tmp_path, model_control="explicit", model_repository=repository)
    try:
        trace = generate(TraceConfig(num_users=8, num_requests=40, seed=6, initial_events_median=300))
        result = replay(trace, srv.grpc_url, model=ENSEMBLE, concurrency=4)
        assert_matches_reference(trace, result, reference)
        wait_for(lambda: metric(srv, "hstu_kv_stage_seconds_count", model=OFFLOAD, stage="commit") == len(trace),
                 10, "every request's commit counted once, over both instances")
        depths = scrape(srv.metrics_url).samples("hstu_kv_offload_queue_depth", model=OFFLOAD)
        assert len({s.labels["instance"] for s in depths}) == 2, depths

        unload = urllib.request.Request(f"http://{srv.http_url}/v2/repository/models/kv_offload/unload", data=b"{}")
        urllib.request.urlopen(unload, timeout=120).read()
        wait_for(lambda: _model_state(srv, "kv_offload") == "UNAVAILABLE", 120, "kv_offload unloaded")

        # Every full page of every request's history is in the host store now.
        model_dir = srv.settings.model_dir
        config, namespace = HSTUConfig.load(model_dir), fingerprint(model_dir)
        for r in trace:
            tokens = history_tokens(r.item_ids, r.action_ids, config)
            full = tokens.numel() // config.page_size
            held = pages_in_store(srv.settings.store_endpoint, config, tokens, namespace, 5.0)
            assert held == full, f"user {r.user_id}: store holds {held} of {full} full pages"
    finally:
        srv.stop()


def _model_state(server: Server, name: str) -> str | None:
    req = urllib.request.Request(f"http://{server.http_url}/v2/repository/index", data=b"{}")
    for entry in json.loads(urllib.request.urlopen(req, timeout=10).read()):
        if entry["name"] == name:
            return entry.get("state")
    return None
