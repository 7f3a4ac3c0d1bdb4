"""No client tool reports OK over requests that failed, or over nothing at all.

Against a port where nothing listens, every request must come back as an error (never lost with
its worker thread), `check_scores` must raise instead of returning a max diff of 0 over nothing,
and `hstu-client --check` must exit non-zero: every time, not in most tries.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from deploy.replay import ReplayResult, replay
from deploy.runtime.schema import RankingRequest
from deploy.score_check import CheckFailed, check_scores
from tests.conftest import REPO_ROOT, free_ports

TRACE = [RankingRequest(7, [11, 12, 13], [1, 0, 2], [21, 22]), RankingRequest(8, [11], [1], [21]),
         RankingRequest(7, [11, 12, 13, 14], [1, 0, 2, 1], [21, 22]), RankingRequest(9, [5, 6], [0, 0], [3])]


@pytest.mark.parametrize("http", [False, True], ids=["grpc", "http"])
@pytest.mark.parametrize("route_header", [None, "x-user-id"], ids=["shared", "per-user"])
def test_every_request_to_a_dead_port_is_an_error(http: bool, route_header: str | None) -> None:
    (port,) = free_ports(1)
    result = replay(TRACE, f"127.0.0.1:{port}", concurrency=2, http=http, timeout_s=10.0, route_header=route_header)
    assert not result.scores
    assert sorted(result.errors) == list(range(len(TRACE))), result.errors
    assert result.failure and result.failure.startswith(f"{len(TRACE)} of {len(TRACE)} requests failed")
    with pytest.raises(CheckFailed, match="requests failed"):
        check_scores(TRACE, result, REPO_ROOT / "model_repository")


def test_a_check_over_nothing_or_over_failures_fails() -> None:
    repo = REPO_ROOT / "model_repository"
    with pytest.raises(CheckFailed, match="no request was scored"):
        check_scores([], ReplayResult(), repo)
    partial = ReplayResult(scores={0: np.zeros((2, 3), np.float32)}, errors={1: "boom"})
    with pytest.raises(CheckFailed, match="1 of 2 requests failed .request 1: boom"):
        check_scores(TRACE[:2], partial, repo)
    with pytest.raises(CheckFailed, match="1 requests scored for a trace of 2"):
        check_scores(TRACE[:2], ReplayResult(scores={0: np.zeros((2, 3), np.float32)}), repo)


def test_hstu_client_check_against_a_dead_port_fails_every_time(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    cmd = [str(Path(sys.executable).parent / "hstu-client"), "--url", f"127.0.0.1:{port}", "--user", "7",
           "--items", "11,12,13", "--actions", "1,0,2", "--candidates", "21,22", "--check"]
    for attempt in range(3):  # the exit code used to race: 0 in most tries
        out = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        text = out.stdout + out.stderr
        assert out.returncode != 0, f"attempt {attempt}: exit 0 with nothing scored:\n{text}"
        assert "0/1 ok, 1 errors" in out.stdout, text
        assert "check vs reference scorer: FAIL" in out.stdout and "OK" not in out.stdout, text
