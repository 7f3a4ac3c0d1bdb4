"""Helpers the server-backed tests share: waiting for a condition, and reading what a running
tritonserver reports (Prometheus metrics, per-model statistics).

- `wait_for(predicate, timeout_s, what)`: poll until `predicate()` is true; fail with `what` at the
  deadline. Use it instead of a fixed sleep wherever a test waits for a metric or a state.
- `metric(server, name, **labels)`: the sum of the series `name` whose labels include `labels`
  (`deploy.metrics`, the reader the tools use too); raises `MissingSeries` when no such series
  exists (a renamed or missing series must not read as 0).
- `ModelStats.read(server, model)`: Triton's statistics of one model (`deploy.server_stats`, the
  parser hstu-bench uses too): request counts, executions, and the dynamic batcher's batch
  sizes; subtract two reads for what happened in between.
- `pages_in_store(endpoint, config, tokens, namespace, rpc_timeout_s)`: how many whole pages of
  `tokens`, from the first, the host store holds, asked as the serving onboard asks.
- `assert_scores_match(served, expected, tolerance, what)`: served scores against the reference's,
  the shape first (`np.abs(served - expected)` broadcasts: a (1, T) answer to a 3-candidate request
  would be compared against every row), then every value.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, TypeVar

import numpy as np

from deploy.metrics import scrape
from deploy.server_stats import read_model_stats
from kvlifecycle.pool import PagePool, PoolSpec, slots_for_pages
from kvlifecycle.store import open_store

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout_s: float, what: str | Callable[[], str],
             interval_s: float = 0.1) -> T:
    """Call `predicate` until it returns a true value, and return that value; AssertionError
    naming `what` (a string, or a callable giving one, e.g. with the last state seen) once
    `timeout_s` passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what() if callable(what) else what}")
        time.sleep(interval_s)


def metric(server, name: str, **labels: str) -> float:
    """Sum of the Prometheus series `name` (on `server.metrics_url`) whose labels include
    `labels`; `MissingSeries` when the metrics port shows no such series."""
    return scrape(server.metrics_url, timeout_s=5).value(name, **labels)


def pages_in_store(endpoint: str, config, tokens, namespace: str, rpc_timeout_s: float) -> int:
    """Whole pages of `tokens`, from the first, that the host store at `endpoint` holds in
    `namespace`; 0 when it is unreachable. Asked as the serving onboard asks (`get_prefix_async`
    from page 0), so the held pages are copied, into a scratch CPU pool of the model's page
    geometry (`config` is a `compute.HSTUConfig`; the store shares its pages across pools)."""
    S = config.page_size
    num_full = len(tokens) // S
    if num_full == 0:
        return 0  # the store keeps whole pages only
    spec = PoolSpec(num_layers=config.num_layers, num_pages=num_full, page_size=S, num_heads=config.num_heads,
                    head_dim=config.head_dim, dtype=config.dtype)
    with PagePool.create(spec) as scratch, open_store("embedded", endpoint=endpoint, page_size=S,
                                                      rpc_timeout_s=rpc_timeout_s,
                                                      pool_handle=scratch.handle()) as store:
        task, held = store.get_prefix_async(tokens, slots_for_pages(range(num_full), S), namespace, first_page=0)
        if task is not None:
            store.wait([task], timeout_s=rpc_timeout_s)  # the answer is `held`; the copy ends before the pool goes
    return held


def assert_scores_match(served, expected: np.ndarray, tolerance: float, what: str) -> None:
    """`served` has `expected`'s shape and every score within `tolerance` of it."""
    served = np.asarray(served)
    assert served.shape == expected.shape, f"{what}: scores of shape {served.shape}, the reference's {expected.shape}"
    diff = float(np.abs(served - expected).max())
    assert diff <= tolerance, f"{what}: max abs diff {diff:.2e} vs the reference"


@dataclass
class ModelStats:
    """One model's counters from Triton's statistics extension (all versions summed)."""

    success: int = 0  # requests answered
    fail: int = 0  # requests failed
    inferences: int = 0  # inference_count: requests executed (batched or not)
    executions: int = 0  # execution_count: model executions (one per dynamic batch)
    batches: Counter = field(default_factory=Counter)  # batch size -> executions of that size

    @classmethod
    def read(cls, server, model: str) -> "ModelStats":
        s = read_model_stats(server.http_url)[model]  # the parser hstu-bench uses too
        return cls(s.success.count, s.fail.count, s.inferences, s.executions,
                   Counter({size: d.count for size, d in s.batches.items()}))

    def __sub__(self, before: "ModelStats") -> "ModelStats":
        batches = Counter({size: n - before.batches.get(size, 0) for size, n in self.batches.items()})
        return ModelStats(self.success - before.success, self.fail - before.fail, self.inferences - before.inferences,
                          self.executions - before.executions, +batches)
