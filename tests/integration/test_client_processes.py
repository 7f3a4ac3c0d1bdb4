"""`replay(..., processes=N)`: the clients spread over N processes return what one process returns.

The same trace replayed by one process and by two must score every request, with the same
shapes and values (and the reference scorer's), and no error; a dead port must still turn every
request of every process into an error, never lose one with its process.
"""
from __future__ import annotations

import numpy as np
import pytest

from deploy.client import ROUTE_HEADER
from deploy.launcher import Server
from deploy.replay import default_processes, partition_by_user, replay
from deploy.runtime.schema import ENSEMBLE
from deploy.trace import TraceConfig, generate
from tests.conftest import free_ports

TRACE = generate(TraceConfig(num_users=8, num_requests=40, seed=3))
TOLERANCE = 1e-5  # one process against two: the same server, the same requests
REFERENCE_TOLERANCE = 1e-4  # as tests/integration/test_ensemble.py


@pytest.mark.integration
@pytest.mark.parametrize("route_header", [None, ROUTE_HEADER], ids=["shared", "per-user"])
def test_two_processes_score_like_one(server: Server, reference, route_header: str | None) -> None:
    one = replay(TRACE, server.grpc_url, model=ENSEMBLE, concurrency=4, route_header=route_header)
    two = replay(TRACE, server.grpc_url, model=ENSEMBLE, concurrency=4, route_header=route_header, processes=2)

    everything = list(range(len(TRACE)))
    for name, result in (("1 process", one), ("2 processes", two)):
        assert not result.errors, f"{name}: {list(result.errors.items())[:3]}"
        assert sorted(result.scores) == everything, f"{name}: {len(result.scores)} of {len(TRACE)} scored"
        assert len(result.latencies_s) == len(TRACE) and all(s > 0 for s in result.latencies_s), name
        assert result.wall_s > 0 and result.throughput > 0, name
    for i in everything:
        assert two.scores[i].shape == one.scores[i].shape, f"request {i}: {two.scores[i].shape} vs {one.scores[i].shape}"
        diff = float(np.abs(two.scores[i] - one.scores[i]).max())
        assert diff <= TOLERANCE, f"request {i}: 2 processes vs 1, max abs diff {diff:.2e}"
        r = TRACE[i]
        expected = reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids)
        diff = float(np.abs(two.scores[i] - expected).max())
        assert diff <= REFERENCE_TOLERANCE, f"request {i}: 2 processes vs the reference, max abs diff {diff:.2e}"


def test_every_request_to_a_dead_port_is_an_error_in_every_process() -> None:
    (port,) = free_ports(1)
    result = replay(TRACE, f"127.0.0.1:{port}", concurrency=4, timeout_s=10.0, processes=2)
    assert not result.scores and not result.latencies_s
    assert sorted(result.errors) == list(range(len(TRACE))), result.errors
    assert result.failure and result.failure.startswith(f"{len(TRACE)} of {len(TRACE)} requests failed")


def test_users_stay_in_one_process_in_trace_order() -> None:
    """The split `replay` uses: whole users per process, each part in trace order, every index once."""
    parts = partition_by_user(TRACE, 2)
    assert len(parts) == 2 and sorted(i for part in parts for i in part) == list(range(len(TRACE)))
    users = [{TRACE[i].user_id for i in part} for part in parts]
    assert not users[0] & users[1]
    assert all(part == sorted(part) for part in parts)


def test_default_processes_is_one_per_8_clients_at_most_half_the_cores(monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 16)
    assert [default_processes(c) for c in (1, 7, 8, 16, 32, 128)] == [1, 1, 1, 2, 4, 8]
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert default_processes(128) == 1
    monkeypatch.setattr("os.cpu_count", lambda: None)
    assert default_processes(128) == 1
