"""perf_analyzer as hstu-bench's cross-check: one concurrency point of one model, read from its CSV.

    run_perf_analyzer(grpc_url, model, concurrency, data, csv, interval_ms) -> PerfAnalyzerResult

`data` is `deploy.trace.perf_analyzer_data` of a trace; the run sends it over unary gRPC
(`--async`; not `--streaming`: tritonserver 2.51 corrupts batched inputs that came on streams,
docs/ARCHITECTURE.md) for 3 measurement windows of `interval_ms`, whatever their spread.
"""
from __future__ import annotations

import csv as csv_module
import logging
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("hstu-bench")

PERCENTILES = (50, 90, 95, 99)


@dataclass
class PerfAnalyzerResult:
    concurrency: int
    returncode: int
    wall_s: float
    throughput: float  # inferences per second; nan when perf_analyzer wrote no figures
    percentile_ms: dict[int, float]  # PERCENTILES -> latency; empty when perf_analyzer wrote no figures
    error: str = ""  # the output's tail when perf_analyzer failed

    @property
    def p99_ms(self) -> float:
        return self.percentile_ms.get(99, float("nan"))


def run_perf_analyzer(grpc_url: str, model: str, concurrency: int, data: Path, csv: Path,
                      interval_ms: int) -> PerfAnalyzerResult:
    cmd = [str(Path(sys.executable).parent / "perf_analyzer"), "-m", model, "-u", grpc_url, "-i", "grpc",
           "--async", "--input-data", str(data), "--concurrency-range", str(concurrency),
           # A cross-check, not a search: 3 time windows taken whatever their spread. The default check
           # (max/min of 3 windows within 10%) never passes on a trace mixing 5 ms hits and 1 s misses,
           # and --request-count reports count / 1 s as the throughput.
           "--measurement-interval", str(interval_ms), "--max-trials", "3", "--stability-percentage", "100000",
           "-f", str(csv)]
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    result = PerfAnalyzerResult(concurrency, done.returncode, time.monotonic() - started, float("nan"), {})
    rows = []
    if csv.exists():
        with csv.open() as f:
            rows = list(csv_module.DictReader(f))
    if rows:  # one row per concurrency point; latencies in microseconds
        result.throughput = float(rows[0]["Inferences/Second"])
        result.percentile_ms = {q: float(rows[0][f"p{q} latency"]) / 1e3 for q in PERCENTILES}
    if done.returncode != 0:
        result.error = (done.stdout + done.stderr)[-600:]
        logger.warning("perf_analyzer %s c=%d exited %d", model, concurrency, done.returncode)
    return result
