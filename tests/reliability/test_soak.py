"""Soak: 5 minutes (wall time) at concurrency 16 over many users with a pool far smaller than the
working set, on `fault_server` (384 pages; the users' histories need about 10x that).

Checked: no request fails, not even with "pool exhausted" (16 requests of at most 8 pages lease
at most 128 of the 384 pages, and the rest cannot all be pinned by offloads in flight), a sample of responses equals the reference scorer, the
pool is back at baseline after a short drain (nothing leased, pinned or quarantined), and the
tritonserver + stub processes' resident memory grew by at most RSS_GROWTH_BOUND between the end
of the warm-up and the end of the soak.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import psutil
import pytest

from deploy.client import RankingClient, RequestFailed
from deploy.launcher import Server, log_tail
from deploy.runtime.schema import RankingRequest
from tests.helpers import metric
from tests.reliability.conftest import FAULT_CANDIDATE, LOOKUP, check_scores, settled_kv_metrics, wait_drained

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SOAK_S = 300.0  # wall time of the load, warm-up included
WARMUP_S = 60.0
CONCURRENCY = 16
NUM_USERS = 600
MAX_EVENTS = 120  # 240 tokens = 7.5 pages: a user reaching it starts over as a new user
SAMPLE_EVERY = 25  # every 25th response is checked against the reference scorer
RSS_GROWTH_BOUND = (0.10, 64 << 20)  # at most 10% of the warmed-up total RSS plus 64 MiB


class Users:
    """Endless requests: NUM_USERS users, picked uniformly, each history growing by 1..8 events per
    request from a lognormal start (median 40 events); thread-safe."""

    def __init__(self, seed: int = 21):
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._histories: dict[int, tuple[list[int], list[int]]] = {}
        self._ids = list(range(1_000_000, 1_000_000 + NUM_USERS))

    def next(self) -> RankingRequest:
        with self._lock:
            rng = self._rng
            slot = int(rng.integers(NUM_USERS))
            user = self._ids[slot]
            items, actions = self._histories.get(user, ([], []))
            grow = int(rng.lognormal(np.log(40), 0.5)) if not items else int(rng.integers(1, 9))
            if len(items) + grow > MAX_EVENTS:
                user = self._ids[slot] = user + NUM_USERS  # a new user takes the slot
                items, actions = [], []
                grow = int(rng.integers(1, 60))
            items = items + rng.integers(1, 100_000, grow).tolist()
            actions = actions + rng.integers(0, 16, grow).tolist()
            self._histories[user] = (items, actions)
            candidates = [c for c in rng.integers(1, 100_000, int(rng.integers(8, 48))).tolist() if c != FAULT_CANDIDATE]
            return RankingRequest(user, items, actions, candidates)


def serving_rss(server: Server) -> dict[str, int]:
    triton = psutil.Process(server.triton.pid)
    out = {}
    for proc in [triton, *triton.children(recursive=True)]:
        try:
            out[f"{proc.pid} {' '.join(proc.cmdline()[-2:])[-60:]}"] = proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def test_soak_five_minutes_at_concurrency_16(fault_server: Server, reference) -> None:
    users = Users()
    start = time.monotonic()
    end = start + SOAK_S
    lock = threading.Lock()
    sample: list[tuple[RankingRequest, np.ndarray]] = []
    errors: list[str] = []
    served = [0]
    rss: dict[str, dict[str, int]] = {}

    def client_loop() -> None:
        with RankingClient(fault_server.grpc_url, timeout_s=120) as client:
            while time.monotonic() < end:
                request = users.next()
                try:
                    scores = client.score(request)
                except (RequestFailed, TimeoutError) as e:
                    with lock:
                        errors.append(f"{type(e).__name__}: {e}")
                    continue
                with lock:
                    served[0] += 1
                    if served[0] % SAMPLE_EVERY == 0:
                        sample.append((request, scores))

    threads = [threading.Thread(target=client_loop, daemon=True) for _ in range(CONCURRENCY)]
    for t in threads:
        t.start()
    time.sleep(WARMUP_S)
    rss["warm"] = serving_rss(fault_server)
    for t in threads:
        t.join(max(1.0, end - time.monotonic()) + 150)
    assert fault_server.triton.poll() is None, (
        f"tritonserver exited with {fault_server.triton.returncode} during the soak ({served[0]} requests served, "
        f"{len(errors)} failed, e.g. {errors[:2]}); its log ends:\n{log_tail(fault_server.triton_log, 30)}")
    assert not any(t.is_alive() for t in threads), "a soak client hung"
    wall = time.monotonic() - start

    drained = wait_drained(fault_server, timeout_s=60)
    rss["end"] = serving_rss(fault_server)
    settled_kv_metrics(fault_server)  # the metrics port shows the owner's page table and counters
    counts = {o: metric(fault_server, "hstu_kv_lookups_total", model=LOOKUP, outcome=o)
              for o in ("device_hit", "host_hit", "miss")}
    print(f"soak: {served[0]} requests in {wall:.0f}s ({served[0] / wall:.1f}/s) at concurrency {CONCURRENCY}, "
          f"{len(errors)} errors, lookups {counts}, evictions {drained['evictions']}, "
          f"onboarded pages {drained['onboarded_pages']}, {len(sample)} responses checked")

    assert not errors, f"{len(errors)} failed requests, e.g. {errors[:3]}"
    assert served[0] > 0 and sample
    for i, (request, scores) in enumerate(sample):
        check_scores(reference, request, scores, what=f"soak sample {i},")
    assert drained["pages_leased"] == 0 and drained["pages_pinned"] == 0
    assert metric(fault_server, "hstu_kv_pages", model=LOOKUP, state="leased") == 0
    assert metric(fault_server, "hstu_kv_pages", model=LOOKUP, state="pinned") == 0
    assert drained["evictions"] > 0 and counts["host_hit"] > 0, "the pool was not smaller than the working set"

    warm, final = sum(rss["warm"].values()), sum(rss["end"].values())
    per_process = {k: f"{rss['warm'].get(k, 0) >> 20} -> {v >> 20} MiB" for k, v in rss["end"].items()}
    print(f"soak RSS (tritonserver + stubs): {warm >> 20} MiB after warm-up, {final >> 20} MiB at the end: "
          f"{per_process}")
    bound = RSS_GROWTH_BOUND[0] * warm + RSS_GROWTH_BOUND[1]
    assert final - warm <= bound, (f"RSS grew by {(final - warm) >> 20} MiB (bound {int(bound) >> 20} MiB): "
                                   f"{per_process}")
