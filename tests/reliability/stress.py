"""Stress: many streams against one server for a while; counts failed requests and a crash.

It is how the Python-backend memory corruption of tritonserver 2.51 with batched steps
(docs/ARCHITECTURE.md, "Batching on tritonserver 2.51") was measured, and the proof that the
shipped configs do not trigger it:

    python -m tests.reliability.stress --seconds 3600 --concurrency 48 [--device cuda]

The server serves the real models from a repository whose configs are rendered with the given
lifecycle batch size, over the soak's pool (384 pages) and users (tests/reliability/test_soak.py),
so host hits, evictions and offloads all run. Every 10 s it prints the requests served and
failed; at the end it checks every `--check-every`-th answer against the reference scorer (a
corrupted score is no failed request) and prints one JSON line (requests, failures with
examples, scores checked and wrong, whether tritonserver died). Exit code 1 when a request
failed, a score was wrong or the server died. A request on this workload never fails for a
reason of its own: every failure is a defect.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from deploy import make_configs
from deploy.launcher import build_model
from deploy.metrics import scrape
from deploy.processes import log_tail
from deploy.runtime.settings import HOST_HIT_COPIERS, ServingSettings
from tests.conftest import REPO_ROOT, LocalServer, launch_config, rendered_repository
from tests.reliability.conftest import FAULT_POOL_PAGES, TOLERANCE, EndlessLoad, Users


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=240.0)
    p.add_argument("--concurrency", type=int, default=48)
    p.add_argument("--lifecycle-max-batch-size", type=int, default=make_configs.LIFECYCLE_MAX_BATCH_SIZE)
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--check-every", type=int, default=50, help="check every Nth answer's scores (0: none)")
    p.add_argument("--host-hit-copy", choices=HOST_HIT_COPIERS, default=ServingSettings.host_hit_copy,
                   help="who copies a host hit's pages (hstu-serve's option of that name)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where hstu_compute runs (the default "
                   "float32 model; the reference is the float32 CPU scorer)")
    p.add_argument("--tolerance", type=float, default=TOLERANCE, help="max abs diff of a checked answer")
    p.add_argument("--min-host-pages", type=int, default=0,
                   help="the owner's --min-host-pages (default 0: the device's, 12 on cuda: most of this "
                        "workload's histories are shorter, so pass 2 there to copy host hits)")
    p.add_argument("--store-dram-bytes", type=int, default=512 << 20,
                   help="the host store's DRAM tier (default 512 MiB); smaller makes it evict and reuse rows that "
                        "hstu_compute copies host hits from")
    a = p.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="hstu-stress-"))
    # The disk tier bounded: an hour of stress wrote 20 GB of pages unbounded.
    server = LocalServer(launch_config(root, device=a.device, pool_pages=FAULT_POOL_PAGES, store_disk_dir=root / "disk",
                                       host_hit_copy=a.host_hit_copy, min_host_pages=a.min_host_pages,
                                       store_dram_bytes=a.store_dram_bytes, store_disk_bytes=2 << 30,
                                       model_repository=rendered_repository(
                                           root, lifecycle_max_batch_size=a.lifecycle_max_batch_size)))
    build_model(server.settings.model_dir, server.settings.device)
    server.start()
    started = time.monotonic()
    passed = False
    load = EndlessLoad(server.grpc_url, Users(seed=a.seed), a.concurrency, timeout_s=60,
                       keep=lambda n: a.check_every > 0 and n % a.check_every == 0)
    try:
        while time.monotonic() < started + a.seconds and server.triton.poll() is None:
            time.sleep(10)
            print(f"{time.monotonic() - started:.0f}s: {load.count} served, {len(load.errors)} failed", flush=True)
        crashed = server.triton.poll() is not None
        host_tier = {} if crashed else _host_tier_counts(server)
        load.stop()
        if not crashed:
            load.join()
        seconds = round(time.monotonic() - started, 1)
        wrong = _wrong_scores(load.served, a.tolerance)
        result = {"device": a.device, "lifecycle_max_batch_size": a.lifecycle_max_batch_size,
                  "concurrency": a.concurrency,
                  "seconds": seconds, "requests": load.count + len(load.errors),
                  "failed": len(load.errors), "failures": [e[:300] for e in load.errors[:5]],
                  # answered with a retryable error and resent: an input corrupted in transit
                  "retried": load.retried,
                  "scores_checked": len(load.served), "scores_wrong": len(wrong), "wrong": wrong[:5],
                  "tritonserver_died": crashed, **host_tier}
        if crashed:
            result["log_tail"] = log_tail(server.triton_log, 30)
        print(json.dumps(result))
        passed = not (load.errors or wrong or crashed)
        return 0 if passed else 1
    finally:
        server.stop()
        shutil.rmtree(root / "disk", ignore_errors=True)  # GBs of offloaded pages
        if passed:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"logs kept in {root}", flush=True)


def _host_tier_counts(server: LocalServer) -> dict[str, float]:
    """How much of the run went through the host tier (the ensemble's series)."""
    names = {"host_hits": ("hstu_kv_lookups_total", {"model": "kv_lookup_alloc", "outcome": "host_hit"}),
             "onboarded_pages": ("hstu_kv_onboarded_pages_total", {}),
             "onboard_failed_pages": ("hstu_kv_onboard_failed_pages_total", {}),
             "onboard_locates": ("hstu_kv_onboard_locates_total", {"model": "hstu_compute"}),
             "offloaded_pages": ("hstu_kv_offloaded_pages_total", {"model": "kv_offload"})}
    try:
        shown = scrape(server.metrics_url, timeout_s=5)
        return {key: shown.value(name, **labels) for key, (name, labels) in names.items()}
    except Exception as e:  # a report without them, not a failed run
        return {"host_tier_counts": f"not read: {e}"}


def _wrong_scores(served: list, tolerance: float) -> list[str]:
    """What is wrong with each sampled answer, checked against the reference scorer."""
    if not served:  # --check-every 0: no reference to load
        return []
    from compute import load_reference

    reference = load_reference(str(REPO_ROOT / "model_repository"))
    wrong = []
    for answer in served:
        r = answer.request
        expected = reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids)
        if answer.scores.shape != expected.shape:
            wrong.append(f"user {r.user_id}: shape {answer.scores.shape}, expected {expected.shape}")
        elif (diff := float(np.abs(answer.scores - expected).max())) > tolerance:
            wrong.append(f"user {r.user_id}: max abs diff {diff:.2e} vs the reference")
    return wrong


if __name__ == "__main__":
    sys.exit(main())
