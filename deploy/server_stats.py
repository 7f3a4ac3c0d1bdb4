"""What a running tritonserver says about the work done between two reads, for hstu-bench.

- `read_model_stats(http_url) -> dict[str, ModelStats]`: every model's cumulative counters from
  Triton's statistics extension (`/v2/models/stats`).
- `hop_stats(before, after) -> dict[str, HopStats]`: per model that answered requests in
  between: requests, executions, mean ms per request in each of Triton's stages, batch sizes.
- `kv_cache_stats(before, after, page_bytes) -> dict[str, KVCacheStats]`: per model publishing
  `hstu_kv_*` series (two `deploy.metrics` scrapes): lookups by outcome, bytes onboarded and
  offloaded, store errors, mean ms per request in each KV stage. A series the model publishes
  (`deploy.runtime.triton_metrics`) that is missing raises `MissingSeries`.
"""
from __future__ import annotations

import json
import urllib.request
from dataclasses import dataclass, field

from deploy.metrics import Metrics
from kvlifecycle.stats_keys import LOOKUP_OUTCOMES
from deploy.runtime.schema import COMPUTE, LOOKUP, MONOLITHIC, OFFLOAD

TRITON_STAGES = ("queue", "compute_input", "compute_infer", "compute_output")  # per request, as Triton counts them
CACHE_OWNERS = (LOOKUP, MONOLITHIC)  # the models that look pages up (and publish hstu_kv_lookups_total)


@dataclass(frozen=True)
class Duration:
    """A Triton statistic: how many times, and nanoseconds in all."""

    count: int
    ns: int

    def __sub__(self, before: "Duration") -> "Duration":
        return Duration(self.count - before.count, self.ns - before.ns)

    @property
    def mean_ms(self) -> float:
        return self.ns / 1e6 / self.count if self.count else float("nan")


@dataclass
class ModelStats:
    """One model's cumulative counters (all versions of it)."""

    success: Duration  # requests answered
    fail: Duration  # requests failed
    inferences: int  # requests executed (batched or not)
    executions: int  # model executions (one per dynamic batch)
    stages: dict[str, Duration]  # TRITON_STAGES -> per-request time (each request counts its batch's time)
    batches: dict[int, Duration]  # batch size -> executions of that size and their compute_infer time


@dataclass
class BatchSizeStats:
    executions: int
    ms_per_execution: float


@dataclass
class HopStats:
    """One model between two reads."""

    requests: int
    executions: int
    ms_per_request: dict[str, float]  # TRITON_STAGES -> mean ms per request
    batches: dict[int, BatchSizeStats] = field(default_factory=dict)  # empty without dynamic batching

    @property
    def mean_batch_size(self) -> float:
        executions = sum(b.executions for b in self.batches.values())
        return sum(size * b.executions for size, b in self.batches.items()) / executions if executions else float("nan")


@dataclass
class LookupStats:
    """A cache owner's lookups (kv_lookup_alloc, hstu_monolithic)."""

    by_outcome: dict[str, float]  # LOOKUP_OUTCOMES -> lookups
    cached_tokens_served: float
    onboarded_pages: float
    onboarded_bytes: float
    pages_now: dict[str, float]  # the pool's pages by state at the second read
    uncommitted_prefix: float  # lookups whose prefix a request in flight was still writing (recomputed)

    @property
    def total(self) -> float:
        return sum(self.by_outcome.values())

    def rate(self, outcome: str) -> float:
        return self.by_outcome[outcome] / self.total if self.total else float("nan")

    @property
    def outcome(self) -> str | None:
        """The one outcome of the lookups in between (a single timed request's); None: none, or several."""
        seen = [o for o, n in self.by_outcome.items() if n]
        return seen[0] if len(seen) == 1 else None


@dataclass
class OffloadStats:
    """kv_offload's puts to the host store."""

    offloaded_pages: float
    offloaded_bytes: float
    reap_latency_ms_mean: float  # nan when nothing was reaped
    queue_depth_now: float


@dataclass
class KVCacheStats:
    """One model's hstu_kv_* series between two scrapes."""

    lookups: LookupStats | None  # the cache owners
    offloads: OffloadStats | None  # kv_offload
    store_errors: float | None  # None for hstu_compute, which never calls the store
    stage_ms_mean: dict[str, float]  # KV stage -> mean ms per request (compute_call: per call), for the stages that ran
    requests_per_call: float | None = None  # hstu_compute: requests per compiled call (compute over compute_call)


def read_model_stats(http_url: str) -> dict[str, ModelStats]:
    with urllib.request.urlopen(f"http://{http_url}/v2/models/stats", timeout=10) as r:
        body = json.loads(r.read())
    out: dict[str, ModelStats] = {}
    for m in body["model_stats"]:
        s = m["inference_stats"]
        stats = ModelStats(success=_duration(s["success"]), fail=_duration(s["fail"]),
                           inferences=int(m["inference_count"]), executions=int(m["execution_count"]),
                           stages={k: _duration(s[k]) for k in TRITON_STAGES},
                           batches={int(b["batch_size"]): _duration(b["compute_infer"])
                                    for b in m.get("batch_stats", [])})
        previous = out.get(m["name"])
        out[m["name"]] = stats if previous is None else _sum(previous, stats)
    return out


def hop_stats(before: dict[str, ModelStats], after: dict[str, ModelStats],
              models: tuple[str, ...] | None = None) -> dict[str, HopStats]:
    """Each model's requests and times between two reads (only `models`, when given: a window's
    own models, so that a late-counted request of another model is not read as one of them)."""
    out = {}
    for name, a in after.items():
        if models is not None and name not in models:
            continue
        b = before.get(name)
        if b is None or a.success.count <= b.success.count:
            continue
        batches = {size: d - b.batches.get(size, Duration(0, 0)) for size, d in a.batches.items()}
        out[name] = HopStats(requests=a.success.count - b.success.count, executions=a.executions - b.executions,
                             ms_per_request={k: (a.stages[k] - b.stages[k]).mean_ms for k in TRITON_STAGES},
                             batches={size: BatchSizeStats(d.count, d.mean_ms) for size, d in sorted(batches.items())
                                      if d.count > 0})
    return out


def kv_cache_stats(before: Metrics, after: Metrics, page_bytes: int) -> dict[str, KVCacheStats]:
    """Every model with hstu_kv_* series (`hstu_kv_stage_seconds_count` or store errors) at `after`."""
    models = set(after.label_values("hstu_kv_stage_seconds_count", "model"))
    models |= set(after.label_values("hstu_kv_store_errors_total", "model"))
    return {model: _model_cache_stats(before, after, model, page_bytes) for model in sorted(models)}


def offload_queue_depth(metrics: Metrics) -> float:
    return metrics.value("hstu_kv_offload_queue_depth", model=OFFLOAD)


# ---- helpers ------------------------------------------------------------------------------------

def _duration(stat: dict) -> Duration:
    return Duration(int(stat["count"]), int(stat["ns"]))


def _sum(a: ModelStats, b: ModelStats) -> ModelStats:
    plus = lambda x, y: Duration(x.count + y.count, x.ns + y.ns)  # noqa: E731
    zero = Duration(0, 0)
    return ModelStats(plus(a.success, b.success), plus(a.fail, b.fail), a.inferences + b.inferences,
                      a.executions + b.executions,
                      {k: plus(a.stages[k], b.stages[k]) for k in TRITON_STAGES},
                      {s: plus(a.batches.get(s, zero), b.batches.get(s, zero)) for s in {*a.batches, *b.batches}})


def _model_cache_stats(before: Metrics, after: Metrics, model: str, page_bytes: int) -> KVCacheStats:
    def delta(name: str, **labels: str) -> float:
        return after.value(name, model=model, **labels) - before.value(name, model=model, **labels)

    lookups = offloads = None
    if model in CACHE_OWNERS:
        onboarded = delta("hstu_kv_onboarded_pages_total")
        if model == LOOKUP:  # host hits hstu_compute copied from the store's slab (host_hit_copy=reader)
            copied = lambda m: sum(s.value for s in m.samples("hstu_kv_onboarded_pages_total", model=COMPUTE))  # noqa: E731
            onboarded += copied(after) - copied(before)
        lookups = LookupStats(
            by_outcome={o: delta("hstu_kv_lookups_total", outcome=o) for o in LOOKUP_OUTCOMES},
            cached_tokens_served=delta("hstu_kv_cached_tokens_total"),
            onboarded_pages=onboarded, onboarded_bytes=onboarded * page_bytes,
            pages_now={s.labels["state"]: s.value for s in after.samples("hstu_kv_pages", model=model)},
            uncommitted_prefix=delta("hstu_kv_uncommitted_prefix_lookups_total"))
    if model == OFFLOAD:
        reaps = delta("hstu_kv_reap_latency_seconds_count")
        offloads = OffloadStats(
            offloaded_pages=delta("hstu_kv_offloaded_pages_total"),
            offloaded_bytes=delta("hstu_kv_offloaded_bytes_total"),
            reap_latency_ms_mean=delta("hstu_kv_reap_latency_seconds_sum") / reaps * 1e3 if reaps else float("nan"),
            queue_depth_now=offload_queue_depth(after))
    stage_ms = {}
    for stage in after.label_values("hstu_kv_stage_seconds_count", "stage", model=model):
        count = delta("hstu_kv_stage_seconds_count", stage=stage)
        if count:
            stage_ms[stage] = delta("hstu_kv_stage_seconds_sum", stage=stage) / count * 1e3
    calls = delta("hstu_kv_stage_seconds_count", stage="compute_call") if "compute_call" in stage_ms else 0
    per_call = delta("hstu_kv_stage_seconds_count", stage="compute") / calls if calls else None
    publishes_errors = bool(after.samples("hstu_kv_store_errors_total", model=model))
    store_errors = delta("hstu_kv_store_errors_total") if publishes_errors else None
    return KVCacheStats(lookups, offloads, store_errors, stage_ms, per_call)
