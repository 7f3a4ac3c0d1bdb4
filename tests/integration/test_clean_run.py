"""A clean run counts no store errors: the error counter must be able to drive an alert.

Every clean start used to end with ``hstu_kv_store_errors_total 1`` for the cache owners: the
pool registration with the host store timed out under the per-request RPC budget (0.5 s) while
the store attached the pool. Registration now has its own budget.
"""
from __future__ import annotations

import re
import urllib.request

from deploy.replay import replay
from deploy.runtime.schema import ENSEMBLE, MONOLITHIC
from deploy.trace import TraceConfig, generate
from tests.helpers import assert_scores_match

ERRORS = "hstu_kv_store_errors_total"


def store_error_series(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{ERRORS}\{{model="([^"]+)"\}} (\S+)$', text, re.MULTILINE)}


def test_a_clean_run_counts_no_store_errors(server, reference):
    trace = generate(TraceConfig(num_users=4, num_requests=16, initial_events_median=40.0, seed=11))
    expected = [reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids) for r in trace]
    for model in (ENSEMBLE, MONOLITHIC):
        result = replay(trace, server.grpc_url, model=model, concurrency=2)
        assert not result.errors, list(result.errors.items())[:3]
        assert sorted(result.scores) == list(range(len(trace))), f"{model}: {len(result.scores)} of {len(trace)} scored"
        for i, served in result.scores.items():
            assert_scores_match(served, expected[i], 1e-4, f"{model} request {i}")

    errors = store_error_series(server.metrics_url)
    assert set(errors) >= {"kv_lookup_alloc", "kv_offload", "hstu_monolithic"}, f"missing series: {errors}"
    assert errors == dict.fromkeys(errors, 0.0), f"store errors on a clean run: {errors}"


def test_the_ensemble_answers_unary_grpc_and_http_infer(server, reference):
    """No step of the ensemble is decoupled, so plain `/infer` and unary gRPC serve it too."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from deploy.runtime.schema import RankingRequest

    request = RankingRequest(user_id=77, item_ids=[5, 9, 13, 21], action_ids=[1, 0, 2, 3], candidate_ids=[11, 12, 13])
    expected = reference.score(request.user_id, request.item_ids, request.action_ids, request.candidate_ids)
    for module, url in ((grpcclient, server.grpc_url), (httpclient, server.http_url)):
        client = module.InferenceServerClient(url)
        inputs = []
        for name, array in request.arrays().items():
            tensor = module.InferInput(name, list(array.shape), "INT64")
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        result = client.infer(ENSEMBLE, inputs)
        assert_scores_match(result.as_numpy("scores"), expected, 1e-4, module.__name__)
        client.close()
