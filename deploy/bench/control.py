"""Control-plane round trip against a busy cache owner, at the default GIL switch interval and at
the one the models set (`kvlifecycle/gil.py`).

    python -m deploy.bench.control [--busy 0.7] [--requests 2000] [--report-dir deploy/reports]

An owner process runs the real `ControlServer` on its background thread while its main thread
does Python work in 1 ms bursts, `--busy` of the time (kv_lookup_alloc's `execute` under load);
this process sends `ping`s, one at a time, as kv_offload sends its commits. Prints the latency
percentiles per interval and writes `control-<date>-<device>.json`.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from deploy.bench.report import write_dated_report  # noqa: E402
from kvlifecycle.gil import SWITCH_INTERVAL_S  # noqa: E402
from kvlifecycle.control import ControlClient, ControlServer  # noqa: E402
from kvlifecycle.manager import KVCacheManager  # noqa: E402
from kvlifecycle.pool import PoolSpec  # noqa: E402

BURST_S = 0.001


def busy_owner(endpoint: str, interval_s: float | None, busy: float, ready, stop) -> None:
    if interval_s is not None:
        sys.setswitchinterval(interval_s)
    spec = PoolSpec(num_layers=3, num_pages=1024, page_size=32, num_heads=4, head_dim=128)
    server = ControlServer(KVCacheManager(spec, "bench"), endpoint)
    ready.set()
    idle_s = BURST_S * (1 - busy) / busy
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < BURST_S:
            sum(range(200))
        time.sleep(idle_s)
    server.close()


def round_trips(interval_s: float | None, busy: float, n: int) -> dict:
    run_dir = tempfile.mkdtemp(prefix="bench-control-")
    os.chmod(run_dir, 0o700)
    endpoint = f"ipc://{run_dir}/control.sock"
    ready, stop = mp.Event(), mp.Event()
    owner = mp.Process(target=busy_owner, args=(endpoint, interval_s, busy, ready, stop))
    owner.start()
    ready.wait(30)
    client = ControlClient(endpoint)
    try:
        for _ in range(50):
            client.ping()
        latencies = []
        for _ in range(n):
            started = time.perf_counter()
            client.ping()
            latencies.append((time.perf_counter() - started) * 1e3)
    finally:
        client.close()
        stop.set()
        owner.join()
    p50, p90, p99 = np.percentile(latencies, [50, 90, 99])
    return {"switch_interval_s": interval_s if interval_s is not None else sys.getswitchinterval(),
            "mean_ms": float(np.mean(latencies)), "p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--busy", type=float, default=0.7, help="fraction of the time the owner's main thread runs Python")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--report-dir", type=Path, default=Path("deploy/reports"))
    a = p.parse_args()
    if not 0 < a.busy < 1:
        p.error(f"--busy {a.busy}: expected a fraction in (0, 1)")
    runs = [round_trips(interval, a.busy, a.requests) for interval in (None, SWITCH_INTERVAL_S)]
    for r in runs:
        print(f"switch interval {r['switch_interval_s'] * 1e3:.1f} ms: control round trip mean {r['mean_ms']:.3f} ms, "
              f"p50 {r['p50_ms']:.3f}, p90 {r['p90_ms']:.3f}, p99 {r['p99_ms']:.3f}")
    write_dated_report(a.report_dir, "control", "cpu", {
        "command": sys.argv, "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
        "owner_busy": a.busy, "requests": a.requests, "runs": runs})
    return 0


if __name__ == "__main__":
    sys.exit(main())
