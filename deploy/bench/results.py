"""hstu-bench's results, typed: what each phase measured, before any formatting.

- `MeasuredRun.of(replay_result, hops, lookups)`: one replay of a trace against one model.
- `RunsSummary.of(runs)`: the median and min-max of each figure over repeated runs, latencies pooled,
  and per hop (Triton model) the median stage times and the batch sizes.
- The phase results (`Sweep`, `PerfAnalyzerPoint`, `CacheRow`, `HopOverhead`, `DeviceHit`, `OffloadComparison`)
  hold these per model name (`hstu_ranking`, `hstu_monolithic`).

`dataclasses.asdict` of a result is its form in the JSON report (deploy/bench/report.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from deploy.bench.perf_analyzer import PerfAnalyzerResult
from deploy.replay import ReplayResult
from deploy.server_stats import BatchSizeStats, HopStats, KVCacheStats, LookupStats

PERCENTILES = (50, 95, 99)


@dataclass
class Spread:
    """Median, min and max over runs (nan runs left out)."""

    median: float
    min: float
    max: float
    n: int

    @classmethod
    def of(cls, values: list[float]) -> "Spread":
        v = [x for x in values if x == x]
        if not v:
            return cls(float("nan"), float("nan"), float("nan"), 0)
        return cls(float(np.median(v)), float(min(v)), float(max(v)), len(v))


@dataclass
class MeasuredRun:
    """One replay against one model: client-side figures, and what the server counted meanwhile."""

    throughput: float  # requests answered per second of the run's wall time
    ok: int
    errors: int
    wall_s: float
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    latencies_ms: list[float]  # every answered request's, in trace order
    hops: dict[str, HopStats]  # Triton model -> its statistics during the run
    lookups: LookupStats | None  # the cache owner's lookups during the run (None: not scraped)

    @classmethod
    def of(cls, result: ReplayResult, hops: dict[str, HopStats], lookups: LookupStats | None) -> "MeasuredRun":
        lat = np.asarray(result.latencies_s) * 1e3
        return cls(throughput=result.throughput, ok=len(result.latencies_s), errors=len(result.errors),
                   wall_s=result.wall_s, mean_ms=float(lat.mean()) if lat.size else float("nan"),
                   **{f"p{q}_ms": result.percentile_ms(q) for q in PERCENTILES},
                   latencies_ms=[round(float(x), 3) for x in lat], hops=hops, lookups=lookups)

    def lookup_rate(self, outcome: str) -> float:
        return self.lookups.rate(outcome) if self.lookups is not None else float("nan")


@dataclass
class HopSummary:
    """One Triton model over repeated runs: medians of the per-run figures, batch sizes pooled."""

    requests: int
    executions: int
    ms_per_request: dict[str, float]  # Triton stage -> median over runs of the mean ms per request
    mean_batch_size: float  # median over runs
    batches: dict[int, BatchSizeStats]  # every run's executions pooled, by batch size


@dataclass
class RunsSummary:
    throughput: Spread
    mean_ms: Spread
    p50_ms: Spread
    p95_ms: Spread
    p99_ms: Spread
    miss_rate: Spread
    device_hit_rate: Spread
    pooled_ms: dict[int, float]  # PERCENTILES over every run's latencies together
    errors: int
    hops: dict[str, HopSummary]
    runs: list[MeasuredRun]

    @classmethod
    def of(cls, runs: list[MeasuredRun]) -> "RunsSummary":
        pooled = np.concatenate([r.latencies_ms for r in runs]) if runs else np.array([])
        return cls(throughput=Spread.of([r.throughput for r in runs]),
                   mean_ms=Spread.of([r.mean_ms for r in runs]),
                   p50_ms=Spread.of([r.p50_ms for r in runs]), p95_ms=Spread.of([r.p95_ms for r in runs]),
                   p99_ms=Spread.of([r.p99_ms for r in runs]),
                   miss_rate=Spread.of([r.lookup_rate("miss") for r in runs]),
                   device_hit_rate=Spread.of([r.lookup_rate("device_hit") for r in runs]),
                   pooled_ms={q: float(np.percentile(pooled, q)) for q in PERCENTILES} if pooled.size else {},
                   errors=sum(r.errors for r in runs), hops=_hop_summaries(runs), runs=runs)


@dataclass
class TraceSummary:
    users: int
    requests: int
    history_events_mean: float
    candidates_mean: float


@dataclass
class SweepPoint:
    concurrency: int
    models: dict[str, RunsSummary]


@dataclass
class Sweep:
    trace: TraceSummary
    points: list[SweepPoint]


@dataclass
class PerfAnalyzerPoint:
    concurrency: int
    models: dict[str, PerfAnalyzerResult]


@dataclass
class TimedRequest:
    """One request of the cache phase: client latency, the compute model's time, the lookup outcome seen."""

    latency_ms: float
    compute_ms: float
    outcome: str | None  # None: no lookup, or lookups of several outcomes, between the scrapes


@dataclass
class CacheCase:
    """One kind of request (device hit, host hit, miss) over the repeats; samples of another outcome left out."""

    latency_ms: Spread
    compute_ms: Spread
    outcome_mismatches: int
    samples: list[TimedRequest]


@dataclass
class CacheModelRow:
    cases: dict[str, CacheCase]  # device_hit, host_hit, miss
    miss_over_device_hit: float  # median latency ratio
    miss_over_host_hit: float
    compute_miss_over_device_hit: float


@dataclass
class CacheRow:
    history_tokens: int
    new_tokens_on_hit: int
    candidates: int
    models: dict[str, CacheModelRow]


@dataclass
class HopOverhead:
    method: str
    models: dict[str, RunsSummary]
    overhead_ms: float  # median latency of hstu_ranking - that of hstu_monolithic
    overhead_per_block_ms: list[float]


@dataclass
class DeviceHit:
    method: str
    history_tokens: int
    candidates: int
    models: dict[str, RunsSummary]  # device hits, each model with its Triton per-model times (hops)
    misses: dict[str, RunsSummary]  # fresh histories of the same length
    p50_ensemble_over_monolithic: float  # of the device hits
    miss_over_device_hit: dict[str, float]  # per model, of the p50s


@dataclass
class OffloadSides:
    on: RunsSummary
    off: RunsSummary
    p99_on_over_off: float
    p50_on_over_off: float
    throughput_on_over_off: float


@dataclass
class OffloadComparison:
    concurrency: int
    method: str
    models: dict[str, OffloadSides]


@dataclass
class HostHitSides:
    device: RunsSummary  # on A: every history in the pool
    host: RunsSummary  # on C: a small pool, histories onboarded from the host store
    p99_host_over_device: float
    p50_host_over_device: float
    host_hit_rate: float  # C's lookups that were host hits (median over runs)


@dataclass
class HostHitLoad:
    concurrency: int
    pool_pages: dict[str, int]  # "A", "C"
    method: str
    models: dict[str, HostHitSides]


@dataclass
class PhaseResults:
    """Everything measured on server A (and B for `offload`, C for `host_hits`); None: the phase did not run."""

    sweep: Sweep | None = None
    perf_analyzer: list[PerfAnalyzerPoint] | None = None
    cache: list[CacheRow] | None = None
    hop_overhead: HopOverhead | None = None
    device_hit: list[DeviceHit] | None = None
    offload: OffloadComparison | None = None
    host_hits: HostHitLoad | None = None
    # hstu_kv_* deltas per model between phase boundaries ("warmup", then each phase), and "total"
    kv_cache: dict[str, dict[str, KVCacheStats]] = field(default_factory=dict)


# ---- helpers ------------------------------------------------------------------------------------

def _hop_summaries(runs: list[MeasuredRun]) -> dict[str, HopSummary]:
    out = {}
    for name in sorted({n for r in runs for n in r.hops}):
        hops = [r.hops[name] for r in runs if name in r.hops]
        pooled: dict[int, list[BatchSizeStats]] = {}
        for hop in hops:
            for size, b in hop.batches.items():
                pooled.setdefault(size, []).append(b)
        batches = {}
        for size, bs in sorted(pooled.items()):
            executions = sum(b.executions for b in bs)
            batches[size] = BatchSizeStats(executions, sum(b.executions * b.ms_per_execution for b in bs) / executions)
        out[name] = HopSummary(requests=sum(h.requests for h in hops), executions=sum(h.executions for h in hops),
                               ms_per_request={k: Spread.of([h.ms_per_request[k] for h in hops]).median
                                               for k in hops[0].ms_per_request},
                               mean_batch_size=Spread.of([h.mean_batch_size for h in hops]).median, batches=batches)
    return out
