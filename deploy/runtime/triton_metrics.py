"""KV-cache metrics on Triton's metrics port (Python backend custom metrics API).

The libraries keep plain cumulative counters and gauges in `stats()` dicts. A model gives
`KVMetrics` a function returning its current stats; one background thread turns a snapshot into
Prometheus counters (by delta) and gauges every `interval_s` (and once more at `close`). Nothing
is published from `execute`: each custom-metric call is a synchronous round trip to the server
(0.06-0.75 ms measured on the CPU machine), which had cost kv_lookup_alloc about 1 ms per request.
Every series carries the label `model` so the ensemble and the monolithic can be told apart.
Several instances of one model (`make_configs --offload-instances`) share each counter (Triton
hands every instance the same metric, and each adds its own deltas); a gauge is each instance's
own value, so gauges also carry `instance` and a reader sums them (`deploy.metrics`).

Series (stats key -> metric{labels}; the keys are named in `kvlifecycle.stats_keys`, and the
owners publish `OWNER_PUBLISHED`, kv_offload `OFFLOAD_PUBLISHED`):
  lookups_device_hit / lookups_host_hit / lookups_miss -> hstu_kv_lookups_total{outcome}
  cached_tokens_served -> hstu_kv_cached_tokens_total      tokens served from the cache
  onboarded_pages      -> hstu_kv_onboarded_pages_total    host -> device
  onboard_locates      -> hstu_kv_onboard_locates_total    hstu_compute's round trips to find host hits'
                       pages the store's shared index did not show (disk-only pages, a restart)
  pages_free / pages_in_use / pages_pinned / pages_leased -> hstu_kv_pages{state}
  offload_queue_depth  -> hstu_kv_offload_queue_depth      puts submitted, not yet reaped
  offloaded_pages / offloaded_bytes -> hstu_kv_offloaded_{pages,bytes}_total
  reap_latency_s_sum / reaps -> hstu_kv_reap_latency_seconds_{sum,count}
  store_errors         -> hstu_kv_store_errors_total       failed or timed-out store calls
  uncommitted_prefix_lookups -> hstu_kv_uncommitted_prefix_lookups_total
                       lookups that found their prefix still being written by a request in flight
                       (the same user's previous request) and computed those pages themselves
  host_filtered_lookups -> hstu_kv_host_filtered_lookups_total
                       lookups the host store's filter of held keys showed it could not serve: not
                       asked, computed with the batch (no onboard round trip)
  commits_announced / commits_round_trip -> hstu_kv_commits_total{path}
                       kv_offload's commits of a batch: announced to the owner (no round trip), or
                       a round trip where the owner's commit inbox could not take the datagram
  pool_waits / pool_exhausted -> hstu_kv_pool_waits_total / hstu_kv_pool_exhausted_total
                       reservations that waited for pages held by other requests or by offloads
                       in flight; requests refused for want of pages (a retryable error)
  compute_graph_calls / compute_direct_calls -> hstu_compute_calls_total{path=cuda_graph|direct}
                       hstu_compute's compiled calls replayed from a CUDA graph or made directly (a
                       batch too large for a graph, a shape's first batch, or a shape whose capture
                       failed); counted only while CUDA graphs are on (HSTU_CUDA_GRAPHS > 0, on CUDA)
  compute_graph_captures -> hstu_compute_cuda_graph_captures_total
  stage_<s>_s_sum / stage_<s>_count -> hstu_kv_stage_seconds_{sum,count}{stage=<s>}
                       time spent per request in each stage of the KV lifecycle (STAGES)
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Callable, Iterator

import triton_python_backend_utils as pb_utils

from kvlifecycle.stats_keys import LOOKUP_OUTCOMES, OFFLOAD_PUBLISHED, OWNER_PUBLISHED, lookups_key

logger = logging.getLogger(__name__)

# stats key -> (metric name, kind, description, extra labels)
_SERIES: dict[str, tuple[str, str, str, dict[str, str]]] = {
    **{lookups_key(outcome): ("hstu_kv_lookups_total", "counter", "KV lookups by outcome", {"outcome": outcome})
       for outcome in LOOKUP_OUTCOMES},
    "cached_tokens_served": ("hstu_kv_cached_tokens_total", "counter", "History tokens served from the KV cache", {}),
    "onboarded_pages": ("hstu_kv_onboarded_pages_total", "counter", "Pages copied host store -> device pool", {}),
    "onboard_failed_pages": ("hstu_kv_onboard_failed_pages_total", "counter",
                             "Host-hit pages recomputed: the store no longer held them, or their copy failed", {}),
    "onboard_locates": ("hstu_kv_onboard_locates_total", "counter",
                        "Round trips to the host store to find host hits' pages its shared index did not show", {}),
    "pages_free": ("hstu_kv_pages", "gauge", "Device pool pages by state", {"state": "free"}),
    "pages_in_use": ("hstu_kv_pages", "gauge", "Device pool pages by state", {"state": "in_use"}),
    "pages_pinned": ("hstu_kv_pages", "gauge", "Device pool pages by state", {"state": "pinned"}),
    "pages_leased": ("hstu_kv_pages", "gauge", "Device pool pages by state", {"state": "leased"}),
    "offload_queue_depth": ("hstu_kv_offload_queue_depth", "gauge", "Offloads submitted and not yet reaped", {}),
    "offloaded_pages": ("hstu_kv_offloaded_pages_total", "counter", "Pages offloaded to the host store", {}),
    "offloaded_bytes": ("hstu_kv_offloaded_bytes_total", "counter", "Bytes offloaded to the host store", {}),
    "reap_latency_s_sum": ("hstu_kv_reap_latency_seconds_sum", "counter", "Seconds from put to reap, summed", {}),
    "reaps": ("hstu_kv_reap_latency_seconds_count", "counter", "Offload tasks reaped", {}),
    "store_errors": ("hstu_kv_store_errors_total", "counter", "Failed or timed-out host store calls", {}),
    "uncommitted_prefix_lookups": ("hstu_kv_uncommitted_prefix_lookups_total", "counter",
                                   "Lookups whose prefix a request in flight was still writing (recomputed)", {}),
    "host_filtered_lookups": ("hstu_kv_host_filtered_lookups_total", "counter",
                              "Lookups not asked of the host store: its filter of held keys ruled them out", {}),
    "commits_announced": ("hstu_kv_commits_total", "counter", "kv_offload's batch commits by path",
                          {"path": "announced"}),
    "commits_round_trip": ("hstu_kv_commits_total", "counter", "kv_offload's batch commits by path",
                           {"path": "round_trip"}),
    "pool_waits": ("hstu_kv_pool_waits_total", "counter",
                   "Reservations that waited for pages held by other requests or offloads in flight", {}),
    "pool_exhausted": ("hstu_kv_pool_exhausted_total", "counter", "Requests refused for want of device pages", {}),
    "compute_graph_calls": ("hstu_compute_calls_total", "counter", "Compiled forward calls by how they ran",
                            {"path": "cuda_graph"}),
    "compute_direct_calls": ("hstu_compute_calls_total", "counter", "Compiled forward calls by how they ran",
                             {"path": "direct"}),
    "compute_graph_captures": ("hstu_compute_cuda_graph_captures_total", "counter",
                               "CUDA graphs captured (one per bucketed batch shape, at its second batch)", {}),
}

# Stages of a request, each timed where it runs: apply_commits (the commits kv_offload announced
# since the owner's last batch, applied before its lookup; in lookup until a831b8c), lookup,
# allocate and onboard_launch (starting a host hit's copy) in the owner; onboard (the wait for
# that copy) and compute (batch assembly, the compiled call, the KV write) in hstu_compute; commit
# in kv_offload. hstu_monolithic publishes none (one execute does every stage: Triton's statistics
# time it). Triton's own statistics give each model's queue time. compute_call is the one stage
# counted per compiled call, not per request: hstu_compute splits a batch of unlike shapes into
# several calls (plan_sub_batches), and compute's count over compute_call's is the requests per
# call.
STAGES = ("apply_commits", "lookup", "allocate", "onboard_launch", "onboard", "compute", "compute_call", "commit")
for _stage in STAGES:
    _SERIES[f"stage_{_stage}_s_sum"] = ("hstu_kv_stage_seconds_sum", "counter",
                                        "Seconds spent in a KV lifecycle stage, summed over requests",
                                        {"stage": _stage})
    _SERIES[f"stage_{_stage}_count"] = ("hstu_kv_stage_seconds_count", "counter",
                                        "Requests that went through a KV lifecycle stage", {"stage": _stage})

def stage_keys(*stages: str) -> list[str]:
    """The stats keys of ``StageTimer`` for ``stages``."""
    return [f"stage_{s}_{part}" for s in stages for part in ("s_sum", "count")]


# Every key a model publishes (kvlifecycle.stats_keys) has its series: checked at import.
_unmapped = [k for k in (*OWNER_PUBLISHED, *OFFLOAD_PUBLISHED) if k not in _SERIES]
assert not _unmapped, f"triton_metrics: published stats keys without a series: {_unmapped}"

METRICS_INTERVAL_S = 1.0


class StageTimer:
    """Per-stage time sums and counts of one model, cheap enough for the request path (no
    metric call: `KVMetrics` publishes `stats()` from its thread)."""

    def __init__(self) -> None:
        self._stats: dict[str, float] = {}

    @contextlib.contextmanager
    def time(self, stage: str) -> Iterator[None]:
        assert stage in STAGES, f"StageTimer: unknown stage {stage!r}; known: {STAGES}"
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(stage, time.perf_counter() - started)

    def add(self, stage: str, seconds: float, requests: int = 1) -> None:
        """`requests` requests each spent `seconds` in `stage` (together, as one batch)."""
        self._stats[f"stage_{stage}_s_sum"] = self._stats.get(f"stage_{stage}_s_sum", 0.0) + seconds * requests
        self._stats[f"stage_{stage}_count"] = self._stats.get(f"stage_{stage}_count", 0) + requests

    def stats(self) -> dict[str, float]:
        return dict(self._stats)


class KVMetrics:
    """Publishes a subset of `_SERIES` for one model, from `source()`, on a background thread."""

    def __init__(self, model: str, instance: str, keys: list[str], source: Callable[[], dict[str, float]],
                 interval_s: float = METRICS_INTERVAL_S):
        unknown = [k for k in keys if k not in _SERIES]
        assert not unknown, f"KVMetrics: unknown stats keys {unknown}; known: {sorted(_SERIES)}"
        families: dict[str, object] = {}
        self._metrics = {}
        self._last: dict[str, float] = {}
        for key in keys:
            name, kind, doc, labels = _SERIES[key]
            if name not in families:
                kind_enum = pb_utils.MetricFamily.COUNTER if kind == "counter" else pb_utils.MetricFamily.GAUGE
                families[name] = pb_utils.MetricFamily(name=name, description=doc, kind=kind_enum)
            own = {"instance": instance} if kind == "gauge" else {}  # see the module docstring
            self._metrics[key] = (kind, families[name].Metric(labels={"model": model, **own, **labels}))
        self._families = families  # keep the families alive as long as their metrics
        self._source = source
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{model}-metrics", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after one last publication."""
        self._stop.set()
        self._thread.join()

    # ---- helpers ----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            stopping = self._stop.wait(self._interval_s)
            try:
                self._publish(self._source())
            except Exception:
                logger.warning("publishing KV metrics failed", exc_info=True)
            if stopping:
                return

    def _publish(self, stats: dict[str, float]) -> None:
        for key, (kind, metric) in self._metrics.items():
            if key not in stats:
                continue
            value = float(stats[key])
            last = self._last.get(key, 0.0)
            if kind == "gauge":
                if key not in self._last or value != last:
                    metric.set(value)
            elif value > last:
                metric.increment(value - last)
            self._last[key] = value
