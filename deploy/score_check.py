"""Served scores against the reference scorer (invariant 1): `check_scores` over one replay,
`ScoreCheck` tallied over many runs (hstu-bench), `reference_scores` computed once for many runs.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from numpy.typing import ArrayLike

from deploy.replay import ReplayResult
from deploy.runtime.schema import RankingRequest


class CheckFailed(RuntimeError):
    """A score check that cannot pass: requests failed, or nothing was scored to compare."""


def reference_scores(trace: list[RankingRequest], model_repository: str | Path,
                     device: str = "cpu") -> list[np.ndarray]:
    """The reference scorer's scores of every request of ``trace``: compute once, then check
    every run over the same trace against them (``check_scores(..., expected=...)``)."""
    from compute import load_reference

    ref = load_reference(str(model_repository), device)
    return [ref.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids) for r in trace]


class ScoreCheck:
    """Served scores against the reference scorer, tallied over many runs: hstu-bench checks every
    request it times, after its run (the check itself is never timed). ``device``: where the
    float32 reference runs ("cuda" checks thousands of requests in seconds)."""

    def __init__(self, model_repository: str | Path, tolerance: float, device: str = "cpu") -> None:
        from compute import load_reference

        self.reference = load_reference(str(model_repository), device)
        self.tolerance = tolerance
        self.checked = 0
        self.failed = 0  # requests whose max abs diff exceeds the tolerance
        self.max_abs_diff = 0.0

    def check(self, requests: list[RankingRequest], served: list[np.ndarray]) -> float:
        """The max abs diff over ``requests`` and their ``served`` scores (same order)."""
        worst = 0.0
        for r, scores in zip(requests, served, strict=True):
            diff = max_abs_diff(scores, self.reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids))
            worst = max(worst, diff)
            self.failed += diff > self.tolerance
        self.checked += len(requests)
        self.max_abs_diff = max(self.max_abs_diff, worst)
        return worst

    @property
    def device(self) -> str:
        return str(self.reference.device)

    def check_replay(self, trace: list[RankingRequest], result: ReplayResult) -> float:
        """``check`` over the requests of ``trace`` that ``result`` scored."""
        indexes = sorted(result.scores)
        return self.check([trace[i] for i in indexes], [result.scores[i] for i in indexes])


def check_scores(trace: list[RankingRequest], result: ReplayResult, model_repository: str | Path,
                 expected: list[np.ndarray] | None = None) -> float:
    """Max abs difference between the served scores and the reference scorer's (invariant 1).
    ``expected``: ``reference_scores(trace, ...)`` when already computed.

    Raises CheckFailed unless every request of ``trace`` was scored: a max diff over failed or
    missing requests (0 over none at all) would read as a pass."""
    if result.failure is not None:
        raise CheckFailed(result.failure)
    if set(result.scores) != set(range(len(trace))):
        raise CheckFailed(f"{len(result.scores)} requests scored for a trace of {len(trace)}: not this trace's run")
    if expected is None:
        from compute import load_reference

        ref = load_reference(str(model_repository))
    worst = 0.0
    for i, served in result.scores.items():
        r = trace[i]
        want = expected[i] if expected is not None else ref.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids)
        worst = max(worst, max_abs_diff(served, want))
    return worst


def max_abs_diff(served: ArrayLike, want: np.ndarray) -> float:
    """The largest absolute difference between served scores and the reference's."""
    return float(np.abs(np.asarray(served) - want).max())

