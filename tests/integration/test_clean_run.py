"""A clean run counts no store errors: the error counter must be able to drive an alert.

Every clean start used to end with ``hstu_kv_store_errors_total 1`` for the cache owners: the
pool registration with the host store timed out under the per-request RPC budget (0.5 s) while
the store attached the pool. Registration now has its own budget.
"""
from __future__ import annotations

import re
import urllib.request

from deploy.client import check_scores, replay
from deploy.schema import ENSEMBLE, MONOLITHIC
from deploy.trace import TraceConfig, generate

ERRORS = "hstu_kv_store_errors_total"


def store_error_series(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{ERRORS}\{{model="([^"]+)"\}} (\S+)$', text, re.MULTILINE)}


def test_a_clean_run_counts_no_store_errors(server):
    trace = generate(TraceConfig(num_users=4, num_requests=16, initial_events_median=40.0, seed=11))
    for model in (ENSEMBLE, MONOLITHIC):
        result = replay(trace, server.grpc_url, model=model, concurrency=2)
        assert not result.errors, list(result.errors.items())[:3]
        assert check_scores(trace, result, server.settings.model_dir) <= 1e-4

    errors = store_error_series(server.metrics_url)
    assert set(errors) >= {"kv_lookup_alloc", "kv_offload", "hstu_monolithic"}, f"missing series: {errors}"
    assert errors == dict.fromkeys(errors, 0.0), f"store errors on a clean run: {errors}"
