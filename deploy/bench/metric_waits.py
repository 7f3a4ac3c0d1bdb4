"""Waits on a server's KV metrics between hstu-bench's requests and runs: until a request's lookup
is published, until kv_offload has no put in flight."""
from __future__ import annotations

import logging
import time

from deploy.launcher import Server
from deploy.metrics import Metrics, scrape
from deploy.runtime.schema import ENSEMBLE, LOOKUP, MONOLITHIC
from deploy.server_stats import offload_queue_depth

logger = logging.getLogger("hstu-bench")

LOOKUPS_PUBLISHED_TIMEOUT_S = 10.0  # a request's lookup shows in the metrics within a second or two


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


def drain_offloads(server: Server, timeout_s: float = 30.0) -> None:
    """Wait until kv_offload has no put in flight (the gauge is refreshed as puts are reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if offload_queue_depth(scrape(server.metrics_url)) == 0:
            return
