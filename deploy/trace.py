"""Synthetic request traces: users with Zipf popularity whose histories grow between requests.

A trace is a list of `RankingRequest`s in send order, stored as JSONL (one request per line).
Each user starts with a lognormal number of history events and gains a few events before each of
their later requests, so their earlier history is a cacheable prefix. `hstu-trace` writes one;
`perf_analyzer_data` turns one into perf_analyzer's `--input-data` JSON.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from deploy.runtime.schema import RankingRequest


@dataclass
class TraceConfig:
    num_users: int = 20
    num_requests: int = 200
    zipf_a: float = 1.2  # user popularity exponent (rank r has weight r^-a)
    initial_events_median: float = 200.0  # lognormal initial history length, in events
    initial_events_sigma: float = 0.8
    growth_min: int = 1  # events added to a user's history before each later request
    growth_max: int = 8
    candidates_min: int = 16
    candidates_max: int = 64
    max_history_events: int = 2048
    item_vocab: int = 100_000
    action_vocab: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_users < 1 or self.num_requests < 1:
            raise ValueError("num_users and num_requests must be >= 1")
        if not 1 <= self.candidates_min <= self.candidates_max:
            raise ValueError(f"candidates_min..max = {self.candidates_min}..{self.candidates_max}: need 1 <= min <= max")
        if not 0 <= self.growth_min <= self.growth_max:
            raise ValueError(f"growth_min..max = {self.growth_min}..{self.growth_max}: need 0 <= min <= max")


def generate(config: TraceConfig) -> list[RankingRequest]:
    rng = np.random.default_rng(config.seed)
    weights = 1.0 / np.arange(1, config.num_users + 1) ** config.zipf_a
    users = rng.choice(config.num_users, size=config.num_requests, p=weights / weights.sum())
    histories: dict[int, tuple[list[int], list[int]]] = {}
    trace = []
    for u in users.tolist():
        if u not in histories:
            n = int(np.clip(rng.lognormal(np.log(config.initial_events_median), config.initial_events_sigma),
                            1, config.max_history_events))
            histories[u] = (_items(rng, n, config), _actions(rng, n, config))
        else:
            grow = int(rng.integers(config.growth_min, config.growth_max + 1))
            grow = min(grow, config.max_history_events - len(histories[u][0]))
            histories[u][0].extend(_items(rng, grow, config))
            histories[u][1].extend(_actions(rng, grow, config))
        c = int(rng.integers(config.candidates_min, config.candidates_max + 1))
        items, actions = histories[u]
        trace.append(RankingRequest(user_id=u + 1, item_ids=list(items), action_ids=list(actions),
                                    candidate_ids=_items(rng, c, config)))
    return trace


def save(trace: list[RankingRequest], path: Path) -> None:
    with open(path, "w") as f:
        for r in trace:
            f.write(json.dumps(r.to_json()) + "\n")


def load(path: Path) -> list[RankingRequest]:
    with open(path) as f:
        return [RankingRequest.from_json(json.loads(line)) for line in f if line.strip()]


def perf_analyzer_data(trace: list[RankingRequest]) -> dict:
    """perf_analyzer `--input-data` JSON: one entry per request, explicit shapes."""
    return {"data": [{name: {"content": arr.tolist(), "shape": list(arr.shape)}
                      for name, arr in r.arrays().items()} for r in trace]}


def _items(rng: np.random.Generator, n: int, config: TraceConfig) -> list[int]:
    return rng.integers(1, config.item_vocab, size=n).tolist()


def _actions(rng: np.random.Generator, n: int, config: TraceConfig) -> list[int]:
    return rng.integers(0, config.action_vocab, size=n).tolist()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="hstu-trace", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="JSONL trace to write")
    p.add_argument("--perf-analyzer-out", type=Path, help="also write perf_analyzer --input-data JSON")
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--median-events", type=float, default=200.0)
    p.add_argument("--candidates", type=int, nargs=2, default=[16, 64], metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    trace = generate(TraceConfig(num_users=a.users, num_requests=a.requests, initial_events_median=a.median_events,
                                 candidates_min=a.candidates[0], candidates_max=a.candidates[1], seed=a.seed))
    save(trace, a.out)
    if a.perf_analyzer_out:
        a.perf_analyzer_out.write_text(json.dumps(perf_analyzer_data(trace)))
    print(f"wrote {len(trace)} requests over {len({r.user_id for r in trace})} users to {a.out}")


if __name__ == "__main__":
    main()
