"""hstu-bench's report: what was run where, the phase results, and the ratios the goals are stated in.

- `BenchReport`: the whole run, typed; `to_json(report)` is the file written next to the plots.
- `summarize(report) -> Summary`: per sweep point ensemble vs monolithic, the goals (README,
  "Benchmarks"), and warnings on what makes the numbers mean less than they seem.
- `format_summary(report) -> str`: the printed summary. Formatting happens here only.
- `write_dated_report(report_dir, kind, suffix, data)`: the JSON file of a one-off bench tool
  (hstu-bench-compute, hstu-bench-store): `<kind>-<date>-<suffix>.json`.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from deploy.bench.config import MODELS, BenchConfig
from deploy.bench.results import PhaseResults
from deploy.runtime.schema import ENSEMBLE, MONOLITHIC, OFFLOAD
from deploy.server_stats import LOOKUP_OUTCOMES

THROUGHPUT_RATIO_GOAL = 2.0  # ensemble over monolithic at concurrency 8, CPU
P99_RATIO_GOAL = 1.0
OFFLOAD_P99_GOAL = 1.05  # p99 with offload on over off
HOST_HIT_P99_GOAL = 1.5  # p99 of a host-hit-heavy load over an all-device-hit one, at c=8


@dataclass
class Machine:
    host: str
    cpu: str
    cores: int
    device: str
    torch: str
    python: str
    gpu: str = ""  # the CUDA device's name, on --device cuda


@dataclass
class ServerSetup:
    store: str
    device: str
    pool_pages: int
    model_dir: str


@dataclass
class ComputeBatching:
    """hstu_compute's dynamic batching, as the server reports its loaded config."""

    max_batch_size: int
    max_queue_delay_us: int


@dataclass
class ServedModelInfo:
    hstu_config: dict  # the HSTUConfig fields
    page_bytes: int
    compute_batching: ComputeBatching


@dataclass
class SummaryRow:
    concurrency: int
    ensemble_rps: float
    monolithic_rps: float
    throughput_ratio: float
    ensemble_p99_ms: float
    monolithic_p99_ms: float
    p99_ratio: float
    ensemble_miss_rate: float
    monolithic_miss_rate: float
    ensemble_rps_spread: tuple[float, float]
    monolithic_rps_spread: tuple[float, float]
    pa_ensemble_rps: float | None = None  # perf_analyzer at the same point, when it ran
    pa_monolithic_rps: float | None = None

    @property
    def pa_throughput_ratio(self) -> float | None:
        if self.pa_ensemble_rps is None or self.pa_monolithic_rps is None:
            return None
        return self.pa_ensemble_rps / self.pa_monolithic_rps


@dataclass
class Goals:
    throughput_ratio_c8: float | None = None  # None: no sweep point at concurrency 8
    p99_ratio_c8: float | None = None
    offload_p99_on_over_off: float | None = None  # None: no offload comparison
    hop_overhead_ms: float | None = None
    host_hit_p99_over_device: float | None = None  # None: no host_hits phase

    @property
    def c8_met(self) -> bool:
        return self.throughput_ratio_c8 >= THROUGHPUT_RATIO_GOAL and self.p99_ratio_c8 <= P99_RATIO_GOAL

    @property
    def offload_met(self) -> bool:
        return self.offload_p99_on_over_off <= OFFLOAD_P99_GOAL

    @property
    def host_hit_met(self) -> bool:
        return self.host_hit_p99_over_device <= HOST_HIT_P99_GOAL


@dataclass
class ScoreCheckResult:
    """Every request the bench timed (sweep, device_hit, cache, hop_overhead, offload and host_hits
    runs) against the float32 reference scorer. perf_analyzer keeps no responses: not checked."""

    checked: int
    failed: int  # requests whose max abs diff exceeds the tolerance
    max_abs_diff: float
    tolerance: float
    reference_device: str

    @property
    def passed(self) -> bool:
        return self.checked > 0 and self.failed == 0


@dataclass
class Summary:
    rows: list[SummaryRow]
    goals: Goals
    warnings: list[str]


@dataclass
class BenchReport:
    date: str
    command: list[str]
    bench_config: BenchConfig
    machine: Machine
    servers: dict[str, ServerSetup]  # "A" (--store), "B" (--store none) for the offload comparison, "C" (small pool)
    model: ServedModelInfo
    load_before: str  # the 1, 5 and 15 min load averages
    phases: PhaseResults = field(default_factory=PhaseResults)
    scores: ScoreCheckResult | None = None  # None: run with --no-score-check
    load_after: str = ""
    elapsed_s: float = 0.0
    summary: Summary | None = None
    plots: list[str] = field(default_factory=list)


def to_json(report: BenchReport) -> str:
    return json.dumps(dataclasses.asdict(report), indent=1) + "\n"


def summarize(report: BenchReport) -> Summary:
    phases = report.phases
    rows = []
    for point in phases.sweep.points if phases.sweep else []:
        e, m = point.models[ENSEMBLE], point.models[MONOLITHIC]
        row = SummaryRow(point.concurrency, e.throughput.median, m.throughput.median,
                         e.throughput.median / m.throughput.median, e.p99_ms.median, m.p99_ms.median,
                         e.p99_ms.median / m.p99_ms.median, e.miss_rate.median, m.miss_rate.median,
                         (e.throughput.min, e.throughput.max), (m.throughput.min, m.throughput.max))
        pa = next((p for p in phases.perf_analyzer or [] if p.concurrency == point.concurrency), None)
        if pa and all(math.isfinite(pa.models[x].throughput) for x in MODELS):
            row.pa_ensemble_rps = pa.models[ENSEMBLE].throughput
            row.pa_monolithic_rps = pa.models[MONOLITHIC].throughput
        rows.append(row)
    goals = Goals()
    at8 = next((r for r in rows if r.concurrency == 8), None)
    if at8:
        goals.throughput_ratio_c8, goals.p99_ratio_c8 = at8.throughput_ratio, at8.p99_ratio
    if phases.offload:
        goals.offload_p99_on_over_off = phases.offload.models[ENSEMBLE].p99_on_over_off
    if phases.hop_overhead:
        goals.hop_overhead_ms = phases.hop_overhead.overhead_ms
    if phases.host_hits:
        goals.host_hit_p99_over_device = phases.host_hits.models[ENSEMBLE].p99_host_over_device
    return Summary(rows, goals, _warnings(report))


def format_summary(report: BenchReport) -> str:
    s, phases, machine = report.summary, report.phases, report.machine
    lines = [f"\nhstu-bench on {machine.cpu} ({machine.cores} cores), "
             f"load average {report.load_before} -> {report.load_after}"]
    if s.rows:
        lines.append(f"{'conc':>4} {'ens req/s':>10} {'mono req/s':>10} {'ens/mono':>8} {'ens p99':>8} {'mono p99':>8}"
                     f" {'p99 e/m':>7} {'miss e':>6} {'miss m':>6} {'PA ens':>7} {'PA mono':>7} {'PA e/m':>7}")
    for r in s.rows:
        pa = (f"{r.pa_ensemble_rps:>7.1f} {r.pa_monolithic_rps:>7.1f} {r.pa_throughput_ratio:>6.2f}x"
              if r.pa_throughput_ratio is not None else f"{'-':>7} {'-':>7} {'-':>7}")
        lines.append(f"{r.concurrency:>4} {r.ensemble_rps:>10.1f} {r.monolithic_rps:>10.1f}"
                     f" {r.throughput_ratio:>7.2f}x {r.ensemble_p99_ms:>8.1f} {r.monolithic_p99_ms:>8.1f}"
                     f" {r.p99_ratio:>7.2f} {r.ensemble_miss_rate:>6.0%} {r.monolithic_miss_rate:>6.0%} {pa}")
    g = s.goals
    if g.throughput_ratio_c8 is not None:
        lines.append(f"ensemble/monolithic throughput at c=8: {g.throughput_ratio_c8:.2f}x (goal >= "
                     f"{THROUGHPUT_RATIO_GOAL:g}x), p99 ratio {g.p99_ratio_c8:.2f} (goal <= {P99_RATIO_GOAL:g}): "
                     f"{'MET' if g.c8_met else 'MISSED'}")
    if g.offload_p99_on_over_off is not None:
        o = phases.offload
        lines.append(f"offload on/off p99 at c={o.concurrency}: hstu_ranking {g.offload_p99_on_over_off:.2f} "
                     f"(goal <= {OFFLOAD_P99_GOAL:g}: {'MET' if g.offload_met else 'MISSED'}), "
                     f"hstu_monolithic {o.models[MONOLITHIC].p99_on_over_off:.2f}")
    if g.host_hit_p99_over_device is not None:
        hh = phases.host_hits
        e, m = hh.models[ENSEMBLE], hh.models[MONOLITHIC]
        lines.append(f"host-hit-heavy / all-device-hit p99 at c={hh.concurrency} (pool {hh.pool_pages['C']} vs "
                     f"{hh.pool_pages['A']} pages): hstu_ranking {e.p99_host_over_device:.2f} "
                     f"({e.host.p99_ms.median:.1f} vs {e.device.p99_ms.median:.1f} ms, {e.host_hit_rate:.0%} host "
                     f"hits; goal <= {HOST_HIT_P99_GOAL:g}: {'MET' if g.host_hit_met else 'MISSED'}), "
                     f"hstu_monolithic {m.p99_host_over_device:.2f} ({m.host.p99_ms.median:.1f} vs "
                     f"{m.device.p99_ms.median:.1f} ms, {m.host_hit_rate:.0%} host hits)")
    if g.hop_overhead_ms is not None:
        h = phases.hop_overhead.models
        lines.append(f"hop overhead (2 events, 1 candidate, c=1): {g.hop_overhead_ms:+.2f} ms "
                     f"(p50 hstu_ranking {h[ENSEMBLE].p50_ms.median:.2f} ms, "
                     f"hstu_monolithic {h[MONOLITHIC].p50_ms.median:.2f} ms)")
    for row in phases.device_hit or []:
        d = row.models
        infer = {hop: summary.ms_per_request["compute_infer"] for m in MODELS for hop, summary in d[m].hops.items()
                 if hop != ENSEMBLE}
        lines.append(f"device hit ({row.history_tokens} tokens, {row.candidates} candidates, c=1, back to back): "
                     f"p50 hstu_ranking {d[ENSEMBLE].p50_ms.median:.2f} ms, hstu_monolithic "
                     f"{d[MONOLITHIC].p50_ms.median:.2f} ms ({row.p50_ensemble_over_monolithic:.2f}x); miss/hit "
                     f"{row.miss_over_device_hit[ENSEMBLE]:.2f}x and {row.miss_over_device_hit[MONOLITHIC]:.2f}x; "
                     "Triton compute per hit: "
                     + ", ".join(f"{hop} {ms:.2f}" for hop, ms in infer.items()) + " ms")
    if phases.cache is not None:
        lines.append(f"{'cache, c=1, ms':<16}" + "".join(
            f" | {m:<15} {'hit':>7} {'host':>7} {'miss':>7} {'miss/hit':>8}" for m in MODELS))
        for row in phases.cache:
            cells = "".join(f" | {'':<15}" + "".join(f" {row.models[m].cases[o].latency_ms.median:>7.1f}"
                                                      for o in LOOKUP_OUTCOMES)
                            + f" {row.models[m].miss_over_device_hit:>7.1f}x" for m in MODELS)
            lines.append(f"{row.history_tokens:>5} tokens    {cells}")
    for model, st in phases.kv_cache.get("total", {}).items():
        parts = []
        if st.lookups is not None:
            rates = " ".join(f"{o} {st.lookups.rate(o):.0%}" for o in LOOKUP_OUTCOMES)
            parts.append(f"lookups {rates}; onboarded {st.lookups.onboarded_bytes / 2**20:.1f} MiB; "
                         f"prefixes still being written {st.lookups.uncommitted_prefix:.0f}")
        if st.offloads is not None:
            parts.append(f"offloaded {st.offloads.offloaded_bytes / 2**20:.1f} MiB")
        if st.store_errors is not None:
            parts.append(f"store errors {st.store_errors:.0f}")
        if parts:
            lines.append(f"cache stats {model:<16} " + ", ".join(parts))
        if st.stage_ms_mean:
            stages = ", ".join(f"{stage} {ms:.2f}" for stage, ms in st.stage_ms_mean.items())
            per_call = f" (compute_call: ms per call; {st.requests_per_call:.1f} requests per call)" \
                if st.requests_per_call else ""
            lines.append(f"stage time, mean ms per request, {model:<16} {stages}{per_call}")
    if report.scores is not None:
        c = report.scores
        lines.append(f"scores: {c.checked} timed requests checked against the float32 reference "
                     f"({c.reference_device}), max abs diff {c.max_abs_diff:.2e}, tolerance {c.tolerance:g}: "
                     + ("all match" if c.passed else f"FAILED ({c.failed} over the tolerance)"))
    for w in s.warnings:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)


# ---- helpers --------------------------------------------------------------------------------------

def _warnings(report: BenchReport) -> list[str]:
    """What makes this report's numbers mean less than they seem."""
    out = []
    total = report.phases.kv_cache.get("total", {})
    offload = total.get(OFFLOAD)
    if offload is not None and offload.store_errors and not offload.offloads.offloaded_bytes:
        out.append(f"kv_offload offloaded nothing and counted {offload.store_errors:.0f} store errors: the ensemble's "
                   "offloads failed, so 'offload on' did no offload work and host hits in the ensemble are absent")
    for model, st in total.items():
        if st.store_errors and model != OFFLOAD:
            out.append(f"{model}: {st.store_errors:.0f} store errors")
    if report.scores is None:
        out.append("scores not checked (--no-score-check)")
    sweep = report.phases.sweep
    errors = sum(point.models[m].errors for point in sweep.points for m in MODELS) if sweep else 0
    if errors:
        out.append(f"{errors} failed requests in the sweep")
    for point in report.phases.perf_analyzer or []:
        for m in MODELS:
            if point.models[m].returncode:
                out.append(f"perf_analyzer {m} c={point.concurrency} exited {point.models[m].returncode}")
    load = float(report.load_before.split()[0])
    if load > 0.5:
        out.append(f"1-min load average {load:.2f} before the run on {report.machine.cores} cores: "
                   "other work shared the CPU")
    return out


def write_dated_report(report_dir: Path, kind: str, suffix: str, data: dict) -> Path:
    """Write `data` to `report_dir/<kind>-<today>-<suffix>.json`, say so, and return the path."""
    report_dir.mkdir(parents=True, exist_ok=True)
    path = report_dir / f"{kind}-{datetime.date.today().isoformat()}-{suffix}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
    return path
