"""`hstu-bench`: hstu_ranking (ensemble) vs hstu_monolithic (baseline) on one tritonserver, side by side.

    .venv/bin/hstu-bench --quick                  # < 10 min on a 2-core CPU
    .venv/bin/hstu-bench [--repeats 5 --requests 200 --users 20] [--store embedded] [--pool-pages N]
                         [--model-config cfg.json] [--device cpu|cuda] [--no-perf-analyzer]

Starts server A (`--store`, default embedded), runs the phases on it (deploy/bench/phases.py: warm-up,
sweep, perf_analyzer, cache, hop overhead, device hit), then starts server B (`--store none`) next to A
for the offload on/off comparison, and server C (a small pool) for the host-hit-heavy load. Writes deploy/reports/<date>-<device>.json (deploy/bench/report.py), three
PNG plots next to it (deploy/bench/plots.py), and prints a summary.

The modules, one job each: config (the phases, the load, the served model), phases (the
measurements), metric_waits (waits on the KV metrics between runs), results (their typed results),
deploy.server_stats (Triton's statistics and the hstu_kv_* metrics around a run), perf_analyzer,
report (summary, goals, formatting, JSON), plots.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

from compute import default_tolerance
from compute.reference import BF16_TOLERANCE
from deploy.bench.config import PHASES, BenchConfig, ServedModel
from deploy.bench.phases import Bench
from deploy.bench.plots import plot_all
from deploy.bench.report import (BenchReport, ComputeBatching, Machine, ScoreCheckResult, ServedModelInfo, ServerSetup,
                                 format_summary, summarize, to_json)
from deploy.launcher import LaunchConfig, Server, new_run_dir
from deploy.processes import free_loopback_ports
from deploy.runtime.schema import COMPUTE
from deploy.runtime.settings import ServingSettings
from deploy.score_check import ScoreCheck
from deploy.serving_options import add_serving_options, serving_settings

logger = logging.getLogger("hstu-bench")

REPORTS = Path(__file__).resolve().parents[1] / "reports"
BENCH_OPTIONS = ("device", "store", "pool_pages", "host_hit_copy", "cuda_graphs")  # the ServingSettings fields hstu-bench takes as options


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hstu-bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller traces and windows (< 10 min on 2 CPU cores)")
    p.add_argument("--repeats", type=int, help="runs per sweep point (default 3)")
    p.add_argument("--requests", type=int, help="requests per sweep run")
    p.add_argument("--users", type=int, help="users in the sweep trace")
    p.add_argument("--concurrency", type=int, nargs="+", help="sweep points (default 1 2 4 8 16)")
    p.add_argument("--cache-tokens", type=int, nargs="+",
                   help="the cache phase's history lengths in tokens (default 256 1024 4096): where a host hit "
                        "starts to beat a miss on this hardware")
    p.add_argument("--no-perf-analyzer", action="store_true")
    p.add_argument("--no-offload-compare", action="store_true", help="skip server B (--store none)")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="run only these phases")
    add_serving_options(p, BENCH_OPTIONS, store="embedded")
    p.add_argument("--tolerance", type=float,
                   help="max abs diff of a served score from the float32 reference (default: 1e-4 for a float32 "
                        f"model, {BF16_TOLERANCE:g} for bfloat16/float16)")
    p.add_argument("--no-score-check", action="store_true",
                   help="do not check the timed requests' scores against the reference scorer")
    p.add_argument("--out-dir", type=Path, default=REPORTS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("hstu-serve").setLevel(logging.WARNING)

    phases = [x for x in a.phases if not (x == "perf_analyzer" and a.no_perf_analyzer)
              and not (x == "offload" and (a.no_offload_compare or a.store == "none"))
              and not (x == "host_hits" and a.store == "none")]
    overrides = {"repeats": a.repeats, "requests": a.requests, "users": a.users,
                 "concurrencies": tuple(a.concurrency) if a.concurrency else None,
                 "cache_tokens": tuple(a.cache_tokens) if a.cache_tokens else None}
    cfg = dataclasses.replace(BenchConfig.quick() if a.quick else BenchConfig(), seed=a.seed, phases=tuple(phases),
                              **{k: v for k, v in overrides.items() if v is not None})
    try:
        serving_a = serving_settings(a, BENCH_OPTIONS, run_dir=new_run_dir())
    except ValueError as e:
        p.error(str(e))

    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_serving(serving_a))
        model = ServedModel.load(serving_a)
        report = BenchReport(date=dt.datetime.now().isoformat(timespec="seconds"), command=sys.argv, bench_config=cfg,
                             machine=_machine(a.device), servers={"A": _setup(serving_a)},
                             model=_model_info(server, model), load_before=_loadavg())
        scores = None if a.no_score_check else ScoreCheck(
            serving_a.model_dir, a.tolerance if a.tolerance is not None else default_tolerance(model.config), a.device)
        bench = Bench(server, cfg, model, scores)
        report.phases = bench.run_on_a()
        if "offload" in cfg.phases:
            logger.info("starting server B (--store none) for the offload on/off comparison")
            serving_b = dataclasses.replace(serving_a, run_dir=new_run_dir(), store="none", store_endpoint="")
            report.servers["B"] = _setup(serving_b)
            report.phases.offload = bench.offload_compare(stack.enter_context(_serving(serving_b)))
        if "host_hits" in cfg.phases:
            pages = bench.host_hit_pool_pages()
            logger.info("starting server C (--pool-pages %d) for the host-hit-heavy load", pages)
            serving_c = dataclasses.replace(serving_a, run_dir=new_run_dir(), pool_pages=pages)
            report.servers["C"] = _setup(serving_c)
            with _serving(serving_c) as server_c:
                report.phases.host_hits = bench.host_hits(server_c, pages, serving_a.pool_pages)
        report.load_after = _loadavg()
        if scores is not None:
            report.scores = ScoreCheckResult(scores.checked, scores.failed, scores.max_abs_diff, scores.tolerance,
                                             scores.device)
    report.elapsed_s = time.monotonic() - started
    report.summary = summarize(report)

    a.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{dt.date.today().isoformat()}-{a.device}"
    out = a.out_dir / f"{stem}.json"
    report.plots = [str(path) for path in plot_all(report, a.out_dir, stem)]
    out.write_text(to_json(report))
    print(format_summary(report))
    print(f"\nwrote {out} (+ {len(report.plots)} plots) in {report.elapsed_s:.0f} s")
    failed = False
    if bench.failed_requests:
        print(f"hstu-bench: FAIL: {bench.failed_requests} requests failed; the figures above count only the "
              "answered ones", file=sys.stderr)
        failed = True
    if report.scores is not None and not report.scores.passed:
        print(f"hstu-bench: FAIL: {report.scores.failed} of {report.scores.checked} timed requests scored more than "
              f"{report.scores.tolerance:g} from the reference", file=sys.stderr)
        failed = True
    return 1 if failed else 0


# ---- helpers ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _serving(serving: ServingSettings) -> Iterator[Server]:
    """A started server on free loopback ports, stopped on exit."""
    http, grpc, metrics = free_loopback_ports(3)
    server = Server(LaunchConfig(serving, http_port=http, grpc_port=grpc, metrics_port=metrics))
    t0 = time.monotonic()
    server.start()
    logger.info("server (--store %s) ready in %.0f s on grpc %s", serving.store, time.monotonic() - t0,
                server.grpc_url)
    try:
        yield server
    finally:
        server.stop()


def _setup(serving: ServingSettings) -> ServerSetup:
    return ServerSetup(serving.store, serving.device, serving.pool_pages, str(serving.model_dir))


def _model_info(server: Server, model: ServedModel) -> ServedModelInfo:
    """The served HSTUConfig, and hstu_compute's batching as the server loaded it (its config API)."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{COMPUTE}/config", timeout=10) as r:
        compute = json.loads(r.read())
    batching = ComputeBatching(int(compute["max_batch_size"]),
                               int(compute["dynamic_batching"]["max_queue_delay_microseconds"]))
    return ServedModelInfo(dataclasses.asdict(model.config), model.page_bytes, batching)


def _machine(device: str) -> Machine:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return Machine(platform.node(), cpu, os.cpu_count(), device, torch.__version__, platform.python_version(),
                   gpu=torch.cuda.get_device_name() if device == "cuda" else "")


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    sys.exit(main())
