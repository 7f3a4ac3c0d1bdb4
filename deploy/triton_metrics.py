"""KV-cache metrics on Triton's metrics port (Python backend custom metrics API).

The libraries keep plain cumulative counters and gauges in `stats()` dicts; models call
`KVMetrics.update(stats)` after each execute (and the offloader after each reap), and this module
turns snapshots into Prometheus counters (by delta) and gauges. Every series carries the label
`model` so the ensemble and the monolithic baseline can be told apart.

Series (stats key -> metric{labels}):
  lookups_device_hit / lookups_host_hit / lookups_miss -> hstu_kv_lookups_total{outcome}
  cached_tokens_served -> hstu_kv_cached_tokens_total      tokens served from the cache
  onboarded_pages      -> hstu_kv_onboarded_pages_total    host -> device
  pages_free / pages_in_use / pages_pinned / pages_leased -> hstu_kv_pages{state}
  offload_queue_depth  -> hstu_kv_offload_queue_depth      puts submitted, not yet reaped
  offloaded_pages / offloaded_bytes -> hstu_kv_offloaded_{pages,bytes}_total
  reap_latency_s_sum / reaps -> hstu_kv_reap_latency_seconds_{sum,count}
  store_errors         -> hstu_kv_store_errors_total       failed or timed-out store calls
"""
from __future__ import annotations

import logging
import threading

import triton_python_backend_utils as pb_utils

logger = logging.getLogger(__name__)

# stats key -> (metric name, kind, description, extra labels)
_SERIES: dict[str, tuple[str, str, str, dict[str, str]]] = {
    "lookups_device_hit": ("hstu_kv_lookups_total", "counter", "KV lookups by outcome", {"outcome": "device_hit"}),
    "lookups_host_hit": ("hstu_kv_lookups_total", "counter", "KV lookups by outcome", {"outcome": "host_hit"}),
    "lookups_miss": ("hstu_kv_lookups_total", "counter", "KV lookups by outcome", {"outcome": "miss"}),
    "cached_tokens_served": ("hstu_kv_cached_tokens_total", "counter", "History tokens served from the KV cache", {}),
    "onboarded_pages": ("hstu_kv_onboarded_pages_total", "counter", "Pages copied host store -> device pool", {}),
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
}

# What each kind of model publishes.
OWNER_KEYS = ["lookups_device_hit", "lookups_host_hit", "lookups_miss", "cached_tokens_served", "onboarded_pages",
              "pages_free", "pages_in_use", "pages_pinned", "pages_leased", "store_errors"]
OFFLOAD_KEYS = ["offload_queue_depth", "offloaded_pages", "offloaded_bytes", "reap_latency_s_sum", "reaps",
                "store_errors"]


class KVMetrics:
    """Publishes a subset of `_SERIES` for one model."""

    def __init__(self, model: str, keys: list[str]):
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
            self._metrics[key] = (kind, families[name].Metric(labels={"model": model, **labels}))
        self._families = families  # keep the families alive as long as their metrics
        self._lock = threading.Lock()  # execute and background threads both publish

    def update(self, stats: dict[str, float]) -> None:
        with self._lock:
            self._update(stats)

    def _update(self, stats: dict[str, float]) -> None:
        for key, (kind, metric) in self._metrics.items():
            if key not in stats:
                continue
            value = float(stats[key])
            if kind == "gauge":
                metric.set(value)
            else:
                delta = value - self._last.get(key, 0.0)
                if delta > 0:
                    metric.increment(delta)
                self._last[key] = value
