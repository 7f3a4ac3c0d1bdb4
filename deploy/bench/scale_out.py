"""Scale-out benchmark: the same trace through `hstu-cluster` with 1 and with 2 servers.

    python -m deploy.bench.scale_out --out deploy/reports/scale-out-$(date +%F).json

Both runs go through the same path (nginx, x-user-id routing on every unary gRPC call, the
Mooncake tier), so the only difference is the number of tritonservers behind the proxy. Every
score is checked against the reference scorer. On a machine with few cores the servers share
those cores: the numbers measure the mechanism, not the scaling of a real multi-host cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

from deploy.client import ROUTE_HEADER
from deploy.cluster import Cluster, ClusterConfig
from deploy.launcher import LaunchConfig
from deploy.metrics import scrape
from deploy.replay import replay
from deploy.runtime.schema import ENSEMBLE, LOOKUP
from deploy.runtime.settings import DEFAULT_MODEL_REPOSITORY
from deploy.score_check import check_scores
from deploy.server_stats import LOOKUP_OUTCOMES
from deploy.trace import TraceConfig, generate


def lookup_outcomes(metrics_url: str) -> dict[str, float]:
    """kv_lookup_alloc's lookups so far, by outcome (device_hit, host_hit, miss)."""
    metrics = scrape(metrics_url, timeout_s=5)
    return {outcome: metrics.value("hstu_kv_lookups_total", model=LOOKUP, outcome=outcome)
            for outcome in LOOKUP_OUTCOMES}


def run(num_servers: int, trace_config: TraceConfig, concurrency: int, base_port: int) -> dict:
    trace = generate(trace_config)
    config = ClusterConfig(num_servers=num_servers, http_port=base_port, grpc_port=base_port + 1,
                           mooncake_port=base_port + 2, base_port=base_port + 10, segment_bytes=1 << 30,
                           server=LaunchConfig(ready_timeout_s=600.0))
    with Cluster(config) as cluster:
        load_before = os.getloadavg()[0]
        result = replay(trace, cluster.grpc_url, model=ENSEMBLE, concurrency=concurrency,
                        route_header=ROUTE_HEADER, timeout_s=300.0)
        time.sleep(2.0)  # Triton pulls the models' counters on an interval
        per_server = [lookup_outcomes(s.metrics_url) for s in cluster.servers]
        load_after = os.getloadavg()[0]
    return {
        "servers": num_servers,
        "requests": len(trace),
        "ok": len(result.scores),
        "errors": len(result.errors),
        "throughput_rps": round(result.throughput, 2),
        "p50_ms": round(result.percentile_ms(50), 1),
        "p99_ms": round(result.percentile_ms(99), 1),
        "wall_s": round(result.wall_s, 2),
        "max_abs_diff_vs_reference": check_scores(trace, result, DEFAULT_MODEL_REPOSITORY),
        "lookups_per_server": per_server,
        "load_average_1m_before_after": [round(load_before, 2), round(load_after, 2)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.bench.scale_out", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--users", type=int, default=40)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--base-port", type=int, default=18000)
    a = p.parse_args(argv)
    trace_config = TraceConfig(num_users=a.users, num_requests=a.requests, seed=7, zipf_a=0.8)
    runs = [run(n, trace_config, a.concurrency, a.base_port + 100 * n) for n in (1, 2)]
    report = {
        "what": "hstu_ranking through hstu-cluster (nginx, consistent hash on x-user-id, Mooncake tier): "
                "the same trace with 1 and with 2 tritonservers on one machine",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "caveat": "other test suites ran on this machine at the same time (see load_average_1m_before_after); "
                  f"all servers share this machine's {os.cpu_count()} cores, so 2 servers cannot double "
                  "throughput here; this measures the routing and shared-tier path, not multi-host scaling",
        "trace": asdict(trace_config),
        "concurrency": a.concurrency,
        "client": "deploy.replay.replay, route_header=x-user-id (each worker owns whole users, one stream per user)",
        "runs": runs,
        "speedup_2_vs_1": round(runs[1]["throughput_rps"] / runs[0]["throughput_rps"], 2),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("speedup_2_vs_1",)} |
                     {f"{r['servers']}_servers": {k: r[k] for k in ("throughput_rps", "p50_ms", "p99_ms", "errors",
                                                                      "max_abs_diff_vs_reference")}
                      for r in runs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
