"""Soak: 60 s (wall time, SOAK_S) at concurrency 16 over many users with a pool far smaller than the
working set, on `fault_server` (384 pages; the users' histories need about 10x that).

Checked: no request fails, not even with "pool exhausted" (16 requests of at most 8 pages lease
at most 128 of the 384 pages, and the rest cannot all be pinned by offloads in flight), a sample of responses equals the reference scorer, the
pool is back at baseline after a short drain (nothing leased, pinned or quarantined), and the
tritonserver + stub processes' resident memory grew by at most RSS_GROWTH_BOUND between the end
of the warm-up and the end of the soak.
"""
from __future__ import annotations

import time

import psutil
import pytest

from deploy.launcher import Server
from deploy.processes import log_tail
from tests.helpers import metric
from tests.reliability.conftest import (LOOKUP, EndlessLoad, Users, check_scores, settled_kv_metrics,
                                       wait_drained)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Wall time of the load, warm-up included. The suite must stay well under 20 minutes; for a longer
# or harder run: python -m tests.reliability.stress --seconds 600 --concurrency 48
SOAK_S = 60.0
WARMUP_S = 20.0
CONCURRENCY = 16
NUM_USERS = 600
MAX_EVENTS = 120  # 240 tokens = 7.5 pages: a user reaching it starts over as a new user
SAMPLE_EVERY = 25  # every 25th response is checked against the reference scorer
RSS_GROWTH_BOUND = (0.10, 64 << 20)  # at most 10% of the warmed-up total RSS plus 64 MiB


def serving_rss(server: Server) -> dict[str, int]:
    triton = psutil.Process(server.triton.pid)
    out = {}
    for proc in [triton, *triton.children(recursive=True)]:
        try:
            out[f"{proc.pid} {' '.join(proc.cmdline()[-2:])[-60:]}"] = proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return out


def test_soak_at_concurrency_16(fault_server: Server, reference) -> None:
    before = wait_drained(fault_server)  # the package's server: other modules' evictions and host hits count from here
    start = time.monotonic()
    load = EndlessLoad(fault_server.grpc_url, Users(num_users=NUM_USERS, max_events=MAX_EVENTS), CONCURRENCY,
                       keep=lambda n: n % SAMPLE_EVERY == 0)
    rss: dict[str, dict[str, int]] = {}
    time.sleep(WARMUP_S)
    rss["warm"] = serving_rss(fault_server)
    while time.monotonic() < start + SOAK_S and fault_server.triton.poll() is None:
        time.sleep(1.0)
    load.stop()
    assert fault_server.triton.poll() is None, (
        f"tritonserver exited with {fault_server.triton.returncode} during the soak ({load.count} requests served, "
        f"{len(load.errors)} failed, e.g. {load.errors[:2]}); its log ends:\n{log_tail(fault_server.triton_log, 30)}")
    load.join()
    wall = time.monotonic() - start
    served, errors, sample = load.count, load.errors, load.served

    drained = wait_drained(fault_server, timeout_s=60)
    rss["end"] = serving_rss(fault_server)
    settled_kv_metrics(fault_server)  # the metrics port shows the owner's page table and counters
    counts = {o: metric(fault_server, "hstu_kv_lookups_total", model=LOOKUP, outcome=o)
              for o in ("device_hit", "host_hit", "miss")}
    evictions, host_hits, onboarded = (drained[k] - before[k] for k in ("evictions", "lookups_host_hit",
                                                                         "onboarded_pages"))
    print(f"soak: {served} requests in {wall:.0f}s ({served / wall:.1f}/s) at concurrency {CONCURRENCY}, "
          f"{len(errors)} errors, lookups since the server started {counts}, this soak's evictions {evictions}, "
          f"host hits {host_hits}, onboarded pages {onboarded}, {len(sample)} responses checked")

    assert not errors, f"{len(errors)} failed requests, e.g. {errors[:3]}"
    assert served > 0 and sample
    for i, answer in enumerate(sample):
        check_scores(reference, answer.request, answer.scores, what=f"soak sample {i},")
    assert drained["pages_leased"] == 0 and drained["pages_pinned"] == 0
    assert metric(fault_server, "hstu_kv_pages", model=LOOKUP, state="leased") == 0
    assert metric(fault_server, "hstu_kv_pages", model=LOOKUP, state="pinned") == 0
    assert evictions > 0 and host_hits > 0, "the pool was not smaller than the soak's working set"

    warm, final = sum(rss["warm"].values()), sum(rss["end"].values())
    per_process = {k: f"{rss['warm'].get(k, 0) >> 20} -> {v >> 20} MiB" for k, v in rss["end"].items()}
    print(f"soak RSS (tritonserver + stubs): {warm >> 20} MiB after warm-up, {final >> 20} MiB at the end: "
          f"{per_process}")
    bound = RSS_GROWTH_BOUND[0] * warm + RSS_GROWTH_BOUND[1]
    assert final - warm <= bound, (f"RSS grew by {(final - warm) >> 20} MiB (bound {int(bound) >> 20} MiB): "
                                   f"{per_process}")
