"""The main job: start the host store and tritonserver, send real traffic, print the results.

    .venv/bin/python -m deploy.demo [--requests 200 --users 20 --concurrency 8]

It serves `model_repository/` through the launcher, replays a synthetic trace against the
ensemble `hstu_ranking` and the baseline `hstu_monolithic`, checks every score against the
reference scorer, prints throughput, latency and the KV-cache metrics, then stops everything.
"""
from __future__ import annotations

import argparse
import logging
import sys
import urllib.request

from deploy.client import check_scores, replay
from deploy.launcher import LaunchConfig, Server
from deploy.schema import ENSEMBLE, MONOLITHIC
from deploy.settings import DEFAULT_MODEL_REPOSITORY
from deploy.trace import TraceConfig, generate


def cache_metrics(metrics_url: str) -> list[str]:
    """The hstu_kv_* lines of Triton's Prometheus endpoint."""
    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    return [line for line in text.splitlines() if line.startswith("hstu_kv_")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    trace = generate(TraceConfig(num_users=a.users, num_requests=a.requests))
    config = LaunchConfig(http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port)
    failed = False
    with Server(config) as server:
        print(f"\nserving on grpc {server.grpc_url}, http {server.http_url}, metrics {server.metrics_url}\n")
        print(f"{'model':<18}{'ok':>6}{'errors':>8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max |diff|':>12}")
        for model in (ENSEMBLE, MONOLITHIC):
            result = replay(trace, server.grpc_url, model=model, concurrency=a.concurrency)
            worst = check_scores(trace, result, DEFAULT_MODEL_REPOSITORY)
            failed |= bool(result.errors) or worst > 1e-4
            print(f"{model:<18}{len(result.scores):>6}{len(result.errors):>8}{result.throughput:>9.1f}"
                  f"{result.percentile_ms(50):>9.1f}{result.percentile_ms(99):>9.1f}{worst:>12.2e}")
        print("\nKV-cache metrics:")
        for line in cache_metrics(server.metrics_url):
            print("  " + line)
    print("\nstopped cleanly" + ("; SOME CHECKS FAILED" if failed else "; all scores match the reference"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
