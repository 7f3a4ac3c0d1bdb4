"""PNG plots of an `hstu-bench` report (deploy/bench/report.py), written next to its JSON.

    plot_all(report, out_dir, stem) -> [<stem>-throughput.png, <stem>-latency-cdf.png, <stem>-cache.png]

Throughput vs concurrency (median, min-max bars, perf_analyzer dashed), the latency CDF of every
measured request at each model's concurrency-1 and concurrency-8 points (runs pooled), and device
hit / host hit / miss latency per history length.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from deploy.bench.report import BenchReport
from deploy.runtime.schema import ENSEMBLE, MONOLITHIC
from deploy.server_stats import LOOKUP_OUTCOMES

COLORS = {ENSEMBLE: "tab:blue", MONOLITHIC: "tab:orange"}


def plot_all(report: BenchReport, out_dir: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    phases = report.phases
    out = []
    if phases.sweep is not None:
        out += [_throughput(report, out_dir / f"{stem}-throughput.png"),
                _latency_cdf(report, out_dir / f"{stem}-latency-cdf.png")]
    if phases.cache:
        out.append(_cache(report, out_dir / f"{stem}-cache.png"))
    return out


def _throughput(report: BenchReport, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, (ax, ax99) = plt.subplots(1, 2, figsize=(11, 4))
    points = report.phases.sweep.points
    cs = [p.concurrency for p in points]
    for model, color in COLORS.items():
        for axis, figure in ((ax, "throughput"), (ax99, "p99_ms")):
            spreads = [getattr(p.models[model], figure) for p in points]
            med = np.array([s.median for s in spreads])
            err = [med - [s.min for s in spreads], [s.max for s in spreads] - med]
            axis.errorbar(cs, med, yerr=err, marker="o", capsize=3, color=color, label=f"{model} (replay)")
        pa = report.phases.perf_analyzer or []
        if pa:
            ax.plot([p.concurrency for p in pa], [p.models[model].throughput for p in pa], "--x",
                    color=color, alpha=0.7, label=f"{model} (perf_analyzer)")
            ax99.plot([p.concurrency for p in pa], [p.models[model].p99_ms for p in pa], "--x",
                      color=color, alpha=0.7, label=f"{model} (perf_analyzer)")
    for axis, label in ((ax, "throughput (req/s)"), (ax99, "p99 latency (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(cs, [str(c) for c in cs])
        axis.set_xlabel("concurrency (closed-loop streams)")
        axis.set_ylabel(label)
        axis.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(f"hstu_ranking vs hstu_monolithic, {report.machine.cpu} "
                 f"(median of {report.bench_config.repeats} runs, bars min-max)", fontsize=9)
    return _save(fig, path)


def _latency_cdf(report: BenchReport, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for point in report.phases.sweep.points:
        if point.concurrency not in (1, 8):
            continue
        style = "-" if point.concurrency == 8 else ":"
        for model, color in COLORS.items():
            lat = np.sort(np.concatenate([run.latencies_ms for run in point.models[model].runs]))
            ax.plot(lat, np.arange(1, lat.size + 1) / lat.size, style, color=color,
                    label=f"{model}, c={point.concurrency}")
    ax.set_xscale("log")
    ax.set_xlabel("latency (ms, client side)")
    ax.set_ylabel("fraction of requests")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("latency CDF, all sweep runs pooled", fontsize=9)
    return _save(fig, path)


def _cache(report: BenchReport, path: Path) -> Path:
    import matplotlib.pyplot as plt

    rows = report.phases.cache
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.13
    x = np.arange(len(rows))
    for mi, (model, color) in enumerate(COLORS.items()):
        for ki, kind in enumerate(LOOKUP_OUTCOMES):
            spreads = [r.models[model].cases[kind].latency_ms for r in rows]
            med = np.array([s.median for s in spreads])
            lo = med - [s.min for s in spreads]
            hi = [s.max for s in spreads] - med
            ax.bar(x + (mi * 3 + ki - 2.5) * width, med, width, yerr=[lo, hi], capsize=2, color=color,
                   alpha=(1.0, 0.65, 0.35)[ki], label=f"{model} {kind.replace('_', ' ')}")
    ax.set_xticks(x, [f"{r.history_tokens} tokens" for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("latency (ms, concurrency 1)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"cached prefix (device hit: +{rows[0].new_tokens_on_hit} new tokens; "
                 f"host hit: onboarded) vs miss, {rows[0].candidates} candidates", fontsize=9)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
