"""Waits on a server's KV metrics and Triton's statistics between hstu-bench's requests and runs:
until a request's lookup is published, until Triton has counted a block's requests, until
kv_offload has no put in flight."""
from __future__ import annotations

import logging
import time

from deploy.launcher import Server
from deploy.metrics import Metrics, scrape
from deploy.runtime.schema import COMPUTE, ENSEMBLE, LOOKUP, MONOLITHIC, OFFLOAD
from deploy.server_stats import ModelStats, offload_queue_depth, read_model_stats

logger = logging.getLogger("hstu-bench")

LOOKUPS_PUBLISHED_TIMEOUT_S = 10.0  # a request's lookup shows in the metrics within a second or two
STATS_COUNTED_TIMEOUT_S = 10.0
# The models a request to each served model executes once each.
MODELS_CALLED = {ENSEMBLE: (ENSEMBLE, LOOKUP, COMPUTE, OFFLOAD), MONOLITHIC: (MONOLITHIC,)}


def lookup_owner(model: str) -> str:
    """The model whose hstu_kv_lookups_total counts `model`'s requests."""
    return LOOKUP if model == ENSEMBLE else MONOLITHIC


def lookups_total(metrics: Metrics, model: str) -> float:
    """`model`'s lookups so far, as its lookup owner counts them."""
    return metrics.value("hstu_kv_lookups_total", model=lookup_owner(model))


def lookups_published(server: Server, owner: str, at_least: float) -> Metrics:
    """A scrape in which `owner` has published at least `at_least` lookups in all. The models publish
    their counters from a background thread every second (`deploy.runtime.triton_metrics`), so a
    scrape right after a request may not count it yet."""
    deadline = time.monotonic() + LOOKUPS_PUBLISHED_TIMEOUT_S
    while True:
        metrics = scrape(server.metrics_url)
        total = metrics.value("hstu_kv_lookups_total", model=owner)
        if total >= at_least:
            return metrics
        if time.monotonic() > deadline:
            raise RuntimeError(f"{owner} on {server.metrics_url} published {total:.0f} lookups, expected at least "
                               f"{at_least:.0f} after {LOOKUPS_PUBLISHED_TIMEOUT_S:g}s; is it publishing its metrics?")
        time.sleep(0.1)


def stats_counted(server: Server, before: dict[str, ModelStats], model: str, requests: int) -> dict[str, ModelStats]:
    """Triton's statistics once every model `model` calls has counted `requests` more successful
    requests than at `before`. Triton sends a request's answer before it adds the request to its
    model's statistics, so a read right after the last answer can lack it: that window would miss
    the request and the next one count it (on a loaded CPU a window of the ensemble once counted
    an execution of the monolithic, called just before it)."""
    deadline = time.monotonic() + STATS_COUNTED_TIMEOUT_S
    while True:
        stats = read_model_stats(server.http_url)
        short = {m: before[m].success.count + requests - stats[m].success.count for m in MODELS_CALLED[model]
                 if stats[m].success.count < before[m].success.count + requests}
        if not short:
            return stats
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.http_url}: Triton's statistics still lack requests after "
                               f"{STATS_COUNTED_TIMEOUT_S:g}s (per model: {short}); did a request fail?")
        time.sleep(0.005)


def drain_offloads(server: Server, timeout_s: float = 30.0) -> None:
    """Wait until kv_offload has no put in flight (the gauge is refreshed as puts are reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if offload_queue_depth(scrape(server.metrics_url)) == 0:
            return
