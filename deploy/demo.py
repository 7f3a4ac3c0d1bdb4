"""The main job: start the host store and tritonserver, send real traffic, print the results.

    .venv/bin/python -m deploy.demo [--requests 200 --users 20 --concurrency 8] [--processes N]

It serves `model_repository/` through the launcher, replays a synthetic trace against the
ensemble `hstu_ranking` and the baseline `hstu_monolithic`, checks every score against the
reference scorer, prints throughput, latency and the KV-cache metrics, then stops everything.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from compute import HSTUConfig, default_tolerance
from compute.reference import BF16_TOLERANCE
from deploy.launcher import LaunchConfig, Server, new_run_dir
from deploy.metrics import Sample, scrape
from deploy.replay import default_processes, replay
from deploy.runtime.schema import COMPUTE, ENSEMBLE, LOOKUP, MONOLITHIC, OFFLOAD
from deploy.score_check import CheckFailed, check_scores, reference_scores
from deploy.server_stats import HopStats, hop_stats, read_model_stats
from deploy.serving_options import add_serving_options, serving_settings
from deploy.trace import TraceConfig, generate


def _ms_per_execution(h: HopStats) -> float:
    """Mean Triton compute time of one execute of the step (its batch's whole time)."""
    executions = sum(b.executions for b in h.batches.values())
    return sum(b.ms_per_execution * b.executions for b in h.batches.values()) / executions if executions else float("nan")


def cache_metrics(metrics_url: str) -> list[Sample]:
    """Every hstu_kv_* and hstu_compute_* series on Triton's metrics endpoint."""
    metrics = scrape(metrics_url)
    return [sample for prefix in ("hstu_kv_", "hstu_compute_") for name in metrics.names(prefix)
            for sample in metrics.samples(name)]


STEPS = (LOOKUP, COMPUTE, OFFLOAD)  # the ensemble's steps, whose batches the demo reports
DEMO_OPTIONS = ("device", "pool_pages", "store", "host_hit_copy", "cuda_graphs")  # the ServingSettings fields the demo takes as options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--users", type=int, default=20)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--median-events", type=float, default=200.0, help="median initial history, in events")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8],
                   help="one or more concurrency levels; every score is checked at each")
    p.add_argument("--processes", type=int,
                   help="client processes per replay, each owning whole users (default: one per 8 clients, "
                        "at most half the cores; see deploy.replay.default_processes)")
    add_serving_options(p, DEMO_OPTIONS, store="embedded")  # the main job shows the host tier
    p.add_argument("--tolerance", type=float,
                   help=f"max abs diff vs the float32 reference (default: 1e-4 for a float32 model, {BF16_TOLERANCE:g} "
                        "for bfloat16/float16)")
    p.add_argument("--json-out", type=Path, help="also write the results as JSON")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002)
    a = p.parse_args(argv)
    if a.processes is not None and a.processes < 1:
        p.error("--processes must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    try:
        serving = serving_settings(a, DEMO_OPTIONS, run_dir=new_run_dir())
    except ValueError as e:
        p.error(str(e))
    config = LaunchConfig(serving=serving, http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port)
    report: dict = {"device": a.device, "runs": []}
    failed = False
    with Server(config) as server:
        model_cfg = HSTUConfig.load(server.settings.model_dir)
        trace = generate(TraceConfig(num_users=a.users, num_requests=a.requests, initial_events_median=a.median_events,
                                     max_history_events=model_cfg.max_history_events))
        report["model_config"] = json.loads(model_cfg.to_json())
        tolerance = a.tolerance if a.tolerance is not None else default_tolerance(model_cfg)
        report["tolerance"] = tolerance
        expected = reference_scores(trace, server.settings.model_dir, a.device)  # on the GPU too: seconds, not minutes
        print(f"\nserving on grpc {server.grpc_url}, http {server.http_url}, metrics {server.metrics_url}\n")
        print(f"{'model':<18}{'conc':>5}{'procs':>6}{'ok':>6}{'errors':>8}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'max |diff|':>12}")
        for concurrency in a.concurrency:
            processes = min(a.processes or default_processes(concurrency), concurrency)  # replay caps it too
            for model in (ENSEMBLE, MONOLITHIC):
                stats_before = read_model_stats(server.http_url)
                result = replay(trace, server.grpc_url, model=model, concurrency=concurrency, processes=processes)
                try:
                    worst, failure = check_scores(trace, result, server.settings.model_dir, expected), None
                except CheckFailed as e:  # failed requests, or nothing scored: no max diff to speak of
                    worst, failure = float("nan"), str(e)
                failed |= failure is not None or worst > tolerance
                steps = hop_stats(stats_before, read_model_stats(server.http_url))
                steps = {name: steps[name] for name in (STEPS if model == ENSEMBLE else (MONOLITHIC,)) if name in steps}
                report["runs"].append({"model": model, "concurrency": concurrency, "processes": processes,
                                       "steps": {name: {"requests": h.requests, "executions": h.executions,
                                                        "mean_batch": h.mean_batch_size,
                                                        "ms_per_execution": _ms_per_execution(h)}
                                                 for name, h in steps.items()},
                                       "ok": len(result.scores),
                                       "errors": len(result.errors), "throughput": result.throughput,
                                       "p50_ms": result.percentile_ms(50), "p99_ms": result.percentile_ms(99),
                                       "max_abs_diff": worst, "failure": failure})
                print(f"{model:<18}{concurrency:>5}{processes:>6}{len(result.scores):>6}{len(result.errors):>8}"
                      f"{result.throughput:>9.1f}{result.percentile_ms(50):>9.1f}{result.percentile_ms(99):>9.1f}"
                      f"{worst:>12.2e}" + (f"  FAIL: {failure}" if failure else ""))
                print(" " * 23 + "; ".join(f"{name} batch {h.mean_batch_size:.1f}, {_ms_per_execution(h):.2f} ms/exec"
                                           for name, h in steps.items()))
        print("\nKV-cache metrics:")
        samples = cache_metrics(server.metrics_url)
        report["metrics"] = [sample._asdict() for sample in samples]
        for name, labels, value in samples:
            print(f"  {name}{{{','.join(f'{k}={v}' for k, v in labels.items())}}} {value:g}")
        stop_started = time.monotonic()
    report["stop_s"] = time.monotonic() - stop_started
    print(f"\nstopped in {report['stop_s']:.1f} s")
    if a.json_out:
        a.json_out.write_text(json.dumps(report, indent=2))
    print("\nstopped cleanly" + ("; SOME CHECKS FAILED" if failed else "; all scores match the reference"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
