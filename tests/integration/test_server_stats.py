"""deploy.server_stats, what hstu-bench reads around a run: hstu_kv_* deltas per model (from two
metrics scrapes) and per-hop Triton statistics (from two /v2/models/stats reads). No server."""
from __future__ import annotations

import pytest

from deploy.metrics import MissingSeries, parse
from deploy.runtime.schema import COMPUTE, LOOKUP, OFFLOAD
from deploy.server_stats import Duration, ModelStats, hop_stats, kv_cache_stats


def scrape_text(lookups: dict[str, int], onboarded: int, offloaded_pages: int, reaps: int, reap_s: float,
                lookup_stage_n: int, lookup_stage_s: float, uncommitted_prefix: int = 0,
                compute_requests: int = 0, compute_calls: int = 0) -> str:
    lines = [f'hstu_kv_lookups_total{{model="{LOOKUP}",outcome="{o}"}} {n}' for o, n in lookups.items()]
    lines += [f'hstu_kv_uncommitted_prefix_lookups_total{{model="{LOOKUP}"}} {uncommitted_prefix}']
    lines += [f'hstu_kv_cached_tokens_total{{model="{LOOKUP}"}} 0',
              f'hstu_kv_onboarded_pages_total{{model="{LOOKUP}"}} {onboarded}',
              f'hstu_kv_pages{{model="{LOOKUP}",state="free"}} 90',
              f'hstu_kv_store_errors_total{{model="{LOOKUP}"}} 0',
              f'hstu_kv_stage_seconds_count{{model="{LOOKUP}",stage="lookup"}} {lookup_stage_n}',
              f'hstu_kv_stage_seconds_sum{{model="{LOOKUP}",stage="lookup"}} {lookup_stage_s}',
              f'hstu_kv_stage_seconds_count{{model="{COMPUTE}",stage="compute"}} {compute_requests}',
              f'hstu_kv_stage_seconds_sum{{model="{COMPUTE}",stage="compute"}} {compute_requests * 0.004}',
              f'hstu_kv_stage_seconds_count{{model="{COMPUTE}",stage="compute_call"}} {compute_calls}',
              f'hstu_kv_stage_seconds_sum{{model="{COMPUTE}",stage="compute_call"}} {compute_calls * 0.002}',
              f'hstu_kv_offload_queue_depth{{model="{OFFLOAD}"}} 0',
              f'hstu_kv_offloaded_pages_total{{model="{OFFLOAD}"}} {offloaded_pages}',
              f'hstu_kv_offloaded_bytes_total{{model="{OFFLOAD}"}} {offloaded_pages * 100}',
              f'hstu_kv_reap_latency_seconds_count{{model="{OFFLOAD}"}} {reaps}',
              f'hstu_kv_reap_latency_seconds_sum{{model="{OFFLOAD}"}} {reap_s}',
              f'hstu_kv_store_errors_total{{model="{OFFLOAD}"}} 1']
    return "\n".join(lines) + "\n"


def test_kv_cache_stats_are_the_deltas_per_model() -> None:
    before = parse(scrape_text({"device_hit": 1, "host_hit": 0, "miss": 1}, 0, 2, 1, 0.5, 2, 0.2, 1))
    after = parse(scrape_text({"device_hit": 4, "host_hit": 1, "miss": 3}, 3, 6, 3, 0.9, 8, 0.8, 3))

    stats = kv_cache_stats(before, after, page_bytes=1000)

    assert set(stats) == {LOOKUP, COMPUTE, OFFLOAD}
    owner = stats[LOOKUP]
    assert owner.lookups.by_outcome == {"device_hit": 3, "host_hit": 1, "miss": 2}
    assert owner.lookups.rate("device_hit") == pytest.approx(0.5) and owner.lookups.outcome is None
    assert (owner.lookups.onboarded_pages, owner.lookups.onboarded_bytes) == (3, 3000)
    assert owner.lookups.uncommitted_prefix == 2
    assert owner.stage_ms_mean == {"lookup": pytest.approx(100.0)}  # 0.6 s over 6 requests
    assert owner.offloads is None and owner.store_errors == 0
    offload = stats[OFFLOAD]
    assert offload.lookups is None and offload.offloads.offloaded_pages == 4
    assert offload.offloads.reap_latency_ms_mean == pytest.approx(200.0) and offload.store_errors == 0
    assert stats[COMPUTE].store_errors is None and stats[COMPUTE].stage_ms_mean == {}  # no request in between


def test_hstu_compute_reports_its_requests_per_compiled_call() -> None:
    """compute is counted per request, compute_call per compiled call: a batch split into several
    calls (plan_sub_batches) shows as fewer requests per call."""
    before = parse(scrape_text({"device_hit": 0, "host_hit": 0, "miss": 0}, 0, 0, 0, 0, 0, 0))
    after = parse(scrape_text({"device_hit": 0, "host_hit": 0, "miss": 0}, 0, 0, 0, 0, 0, 0,
                              compute_requests=12, compute_calls=4))

    compute = kv_cache_stats(before, after, 0)[COMPUTE]
    assert compute.requests_per_call == pytest.approx(3.0)
    assert compute.stage_ms_mean == {"compute": pytest.approx(4.0), "compute_call": pytest.approx(2.0)}


def test_a_single_request_has_one_outcome() -> None:
    before = parse(scrape_text({"device_hit": 1, "host_hit": 0, "miss": 1}, 0, 0, 0, 0, 0, 0))
    after = parse(scrape_text({"device_hit": 1, "host_hit": 1, "miss": 1}, 2, 0, 0, 0, 0, 0))

    assert kv_cache_stats(before, after, 0)[LOOKUP].lookups.outcome == "host_hit"


def test_a_cache_owner_without_its_lookups_fails_loudly() -> None:
    text = scrape_text({"device_hit": 0, "host_hit": 0, "miss": 0}, 0, 0, 0, 0, 0, 0)
    renamed = parse(text.replace("hstu_kv_lookups_total", "hstu_kv_lookups"))

    with pytest.raises(MissingSeries, match="hstu_kv_lookups_total"):
        kv_cache_stats(renamed, renamed, 0)


def stats(success: int, executions: int, infer_ns: int, batches: dict[int, tuple[int, int]]) -> ModelStats:
    stages = {"queue": Duration(success, success * 1_000_000), "compute_input": Duration(success, 0),
              "compute_infer": Duration(success, infer_ns), "compute_output": Duration(success, 0)}
    return ModelStats(Duration(success, 0), Duration(0, 0), success, executions, stages,
                      {s: Duration(*v) for s, v in batches.items()})


def test_hop_stats_are_per_request_means_and_batch_sizes_between_two_reads() -> None:
    before = {COMPUTE: stats(2, 2, 20_000_000, {1: (2, 20_000_000)}), OFFLOAD: stats(2, 2, 0, {})}
    after = {COMPUTE: stats(8, 4, 80_000_000, {1: (3, 30_000_000), 3: (1, 60_000_000)}), OFFLOAD: stats(2, 2, 0, {})}

    hops = hop_stats(before, after)

    assert set(hops) == {COMPUTE}  # kv_offload answered nothing in between
    hop = hops[COMPUTE]
    assert (hop.requests, hop.executions) == (6, 2)
    assert hop.ms_per_request["compute_infer"] == pytest.approx(10.0) and hop.ms_per_request["queue"] == 1.0
    assert {s: (b.executions, b.ms_per_execution) for s, b in hop.batches.items()} == {1: (1, 10.0), 3: (1, 60.0)}
    assert hop.mean_batch_size == 2.0
    assert hop_stats(after, after) == {}  # nothing answered: no hop to report
