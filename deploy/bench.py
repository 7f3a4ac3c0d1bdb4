"""`hstu-bench`: hstu_ranking (ensemble) vs hstu_monolithic (baseline) on one tritonserver, side by side.

    .venv/bin/hstu-bench --quick                  # < 10 min on a 2-core CPU
    .venv/bin/hstu-bench [--repeats 5 --requests 200 --users 20] [--store embedded] [--pool-pages N]
                         [--model-config cfg.json] [--device cpu|cuda] [--no-perf-analyzer]

Phases, in this order, on server A (`--store`, default embedded):
  1. warm-up        each model replays a short trace (not measured).
  2. sweep          throughput and p50/p95/p99 at concurrency 1, 2, 4, 8, 16 with `deploy.client.replay`;
                    `--repeats` runs per point, the two models interleaved (ABBA order) so drift hits both.
                    Triton's per-model statistics (`/v2/models/<m>/stats`) are snapshotted around each run:
                    queue and compute time per hop, hstu_compute's batch sizes.
  3. perf_analyzer  the same points once per model (`-i grpc --streaming --async --input-data`), a cross-check.
  4. cache          concurrency 1, 64 candidates: a device hit (the user's history again + 8 new events),
                    a host hit (a history another model offloaded), and a miss (fresh history, same length),
                    for 256 / 1,024 / 4,096 history tokens.
  5. hop overhead   1 candidate, 2 events (compute negligible), concurrency 1: ensemble minus monolithic.
  6. offload        server B (`--store none`) starts next to A; hstu_ranking and hstu_monolithic at
                    concurrency 8 on A and B, interleaved: p99 with offload on over p99 with offload off.
The KV-cache metrics (`hstu_kv_*`) are scraped at every phase boundary; the report holds the deltas.

Every measured run replays the same trace relabelled into fresh user and item ids (`_relabel`): the
two models share the host store and its keys are content-addressed over tokens, so without it a
model would find the KV the other model (or an earlier run) offloaded and skip the misses.

Writes deploy/reports/<date>-<device>.json, three PNG plots next to it, and prints a summary.
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
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deploy.client import RankingClient, ReplayResult, replay
from deploy.launcher import LaunchConfig, Server
from deploy.runtime.schema import COMPUTE, ENSEMBLE, LOOKUP, MONOLITHIC, OFFLOAD, RankingRequest
from deploy.trace import TraceConfig, generate, perf_analyzer_data

logger = logging.getLogger("hstu-bench")

REPORTS = Path(__file__).resolve().parent / "reports"
MODELS = (ENSEMBLE, MONOLITHIC)
HOPS = (LOOKUP, COMPUTE, OFFLOAD)
PHASES = ("sweep", "perf_analyzer", "cache", "hop_overhead", "offload")
CACHE_HISTORY_TOKENS = (256, 1024, 4096)
CACHE_NEW_EVENTS = 8
CACHE_CANDIDATES = 64
COMMIT_WAIT_S = 0.5  # hstu_ranking commits a request's pages just after FINAL; let it land
METRICS_SETTLE_S = 1.5  # kv_lookup_alloc refreshes its gauges every second


@dataclass
class BenchConfig:
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16)
    repeats: int = 3
    users: int = 20
    requests: int = 200
    initial_events_median: float = 200.0
    warmup_requests: int = 32
    perf_analyzer: bool = True
    phases: tuple[str, ...] = ("sweep", "cache", "hop_overhead", "offload")
    pa_interval_ms: int = 3000  # perf_analyzer: 3 windows of this length per point
    overhead_requests: int = 30
    offload_concurrency: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats}: expected >= 1")
        if not self.concurrencies or min(self.concurrencies) < 1:
            raise ValueError(f"concurrencies={self.concurrencies}: expected positive integers")

    @classmethod
    def quick(cls) -> "BenchConfig":
        return cls(users=16, requests=128, initial_events_median=150.0, warmup_requests=24, pa_interval_ms=2000,
                   overhead_requests=20)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hstu-bench", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller traces and windows (< 10 min on 2 CPU cores)")
    p.add_argument("--repeats", type=int, help="runs per sweep point (default 3)")
    p.add_argument("--requests", type=int, help="requests per sweep run")
    p.add_argument("--users", type=int, help="users in the sweep trace")
    p.add_argument("--concurrency", type=int, nargs="+", help="sweep points (default 1 2 4 8 16)")
    p.add_argument("--no-perf-analyzer", action="store_true")
    p.add_argument("--no-offload-compare", action="store_true", help="skip server B (--store none)")
    p.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES), help="run only these phases")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--store", choices=["embedded", "none", "mooncake"], default="embedded")
    p.add_argument("--pool-pages", type=int, default=4096)
    p.add_argument("--model-config", type=Path, help="HSTUConfig JSON (default: the model dir's)")
    p.add_argument("--out-dir", type=Path, default=REPORTS)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("hstu-serve").setLevel(logging.WARNING)

    cfg = BenchConfig.quick() if a.quick else BenchConfig()
    overrides = {"repeats": a.repeats, "requests": a.requests, "users": a.users, "seed": a.seed,
                 "concurrencies": tuple(a.concurrency) if a.concurrency else None}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None},
                              perf_analyzer="perf_analyzer" in a.phases and not a.no_perf_analyzer,
                              phases=tuple(x for x in a.phases if x != "perf_analyzer"))
    launch = dict(device=a.device, pool_pages=a.pool_pages, model_config=a.model_config)

    started = time.monotonic()
    report: dict[str, Any] = {"date": dt.datetime.now().isoformat(timespec="seconds"), "command": sys.argv,
                              "bench_config": dataclasses.asdict(cfg), "machine": _machine(a.device),
                              "servers": {"A": {"store": a.store, **_jsonable(launch)}}}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(_server(a.store, **launch))
        report["model"] = _model_info(server)
        bench = Bench(server, cfg, report["model"])
        report["load_before"] = _loadavg()
        report["phases"] = bench.run_on_a()
        if a.store != "none" and not a.no_offload_compare and "offload" in cfg.phases:
            logger.info("starting server B (--store none) for the offload on/off comparison")
            report["servers"]["B"] = {"store": "none", **_jsonable(launch)}
            off = stack.enter_context(_server("none", **launch))
            report["offload"] = bench.offload_compare(off)
        report["load_after"] = _loadavg()
    report["elapsed_s"] = time.monotonic() - started
    report["summary"] = summarize(report)

    a.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{dt.date.today().isoformat()}-{a.device}"
    out = a.out_dir / f"{stem}.json"
    from deploy.bench_plots import plot_all

    report["plots"] = [str(p) for p in plot_all(report, a.out_dir, stem)]
    out.write_text(json.dumps(report, indent=1, default=float) + "\n")
    print(format_summary(report))
    print(f"\nwrote {out} (+ {len(report['plots'])} plots) in {report['elapsed_s']:.0f} s")
    if bench.failed_requests:
        print(f"hstu-bench: FAIL: {bench.failed_requests} requests failed; the figures above count only the "
              "answered ones", file=sys.stderr)
        return 1
    return 0


# ---- the measurements ----------------------------------------------------------------------------

class Bench:
    """All phases against one server (A); `offload_compare` adds a second one (B)."""

    def __init__(self, server: Server, cfg: BenchConfig, model: dict):
        self.server, self.cfg, self.model = server, cfg, model
        self.base = generate(TraceConfig(num_users=cfg.users, num_requests=cfg.requests, seed=cfg.seed,
                                         initial_events_median=cfg.initial_events_median,
                                         max_history_events=model["max_history_events"],
                                         item_vocab=model["item_vocab"], action_vocab=model["action_vocab"]))
        self._variant = 0
        self._rng = np.random.default_rng(cfg.seed + 1)
        self.failed_requests = 0  # over every replay; main exits non-zero when any failed

    def replay(self, trace: list[RankingRequest], server: Server, model: str, concurrency: int) -> ReplayResult:
        """`deploy.client.replay`, counting failed requests; a run that scored nothing raises (there is
        nothing to measure, and its throughput of 0 would read as a result)."""
        result = replay(trace, server.grpc_url, model=model, concurrency=concurrency)
        self.failed_requests += len(result.errors)
        if not result.scores:
            raise RuntimeError(f"hstu-bench: {model} at concurrency {concurrency} on {server.grpc_url}: "
                               f"{result.failure}; nothing to measure")
        return result

    def fresh_trace(self, trace: list[RankingRequest] | None = None) -> list[RankingRequest]:
        self._variant += 1
        return _relabel(self.base if trace is None else trace, self._variant, self.model["item_vocab"])

    def run_on_a(self) -> dict[str, Any]:
        phases: dict[str, Any] = {}
        metrics = [("start", scrape_metrics(self.server))]

        def boundary(name: str) -> None:
            time.sleep(METRICS_SETTLE_S)
            metrics.append((name, scrape_metrics(self.server)))

        self.warmup()
        boundary("warmup")
        steps = [("sweep", self.sweep), ("cache", self.cache), ("hop_overhead", self.hop_overhead)]
        if self.cfg.perf_analyzer:
            steps.insert(1, ("perf_analyzer", self.perf_analyzer_sweep))
        for name, step in steps:
            if name in self.cfg.phases or name == "perf_analyzer":
                phases[name] = step()
                boundary(name)
        phases["cache_stats"] = {name: cache_stats(prev, cur, self.model["page_bytes"])
                                 for (_, prev), (name, cur) in zip(metrics, metrics[1:])}
        phases["cache_stats"]["total"] = cache_stats(metrics[0][1], metrics[-1][1], self.model["page_bytes"])
        return phases

    def warmup(self) -> None:
        trace = self.base[: self.cfg.warmup_requests]
        for model in MODELS:
            logger.info("warm-up: %s", model)
            self.replay(self.fresh_trace(trace), self.server, model, 4)

    def sweep(self) -> dict[str, Any]:
        points = []
        for c in self.cfg.concurrencies:
            runs: dict[str, list[dict]] = {m: [] for m in MODELS}
            for r in range(self.cfg.repeats):
                for model in _order(r):
                    runs[model].append(self.measured_replay(self.server, model, c))
            point = {"concurrency": c}
            for model in MODELS:
                point[model] = _aggregate(runs[model])
                logger.info("c=%d %s: %.1f req/s, p99 %.1f ms", c, model, point[model]["throughput"]["median"],
                            point[model]["p99_ms"]["median"])
            points.append(point)
        return {"trace": {"users": self.cfg.users, "requests": self.cfg.requests,
                          "history_events_mean": float(np.mean([len(r.item_ids) for r in self.base])),
                          "candidates_mean": float(np.mean([len(r.candidate_ids) for r in self.base]))},
                "points": points}

    def measured_replay(self, server: Server, model: str, concurrency: int) -> dict[str, Any]:
        trace = self.fresh_trace()
        before, metrics_before = model_stats(server), scrape_metrics(server)
        result = self.replay(trace, server, model, concurrency)
        after, metrics_after = model_stats(server), scrape_metrics(server)
        run = _run_summary(result, stats_delta(before, after))
        owner = LOOKUP if model == ENSEMBLE else MONOLITHIC  # lookup counters move inside execute: no lag
        lookups = cache_stats(metrics_before, metrics_after, self.model["page_bytes"]).get(owner, {})
        run["miss_rate"] = lookups.get("miss_rate", float("nan"))
        run["device_hit_rate"] = lookups.get("device_hit_rate", float("nan"))
        return run

    def perf_analyzer_sweep(self) -> dict[str, Any]:
        points = []
        with tempfile.TemporaryDirectory(prefix="hstu-bench-pa-") as tmp:
            for i, c in enumerate(self.cfg.concurrencies):
                point: dict[str, Any] = {"concurrency": c}
                for model in _order(i):
                    data = Path(tmp) / f"{model}-{c}.json"
                    data.write_text(json.dumps(perf_analyzer_data(self.fresh_trace())))
                    point[model] = run_perf_analyzer(self.server, model, c, data, Path(tmp) / f"{model}-{c}.csv",
                                                     self.cfg.pa_interval_ms)
                    logger.info("perf_analyzer c=%d %s: %s req/s, p99 %s ms", c, model,
                                point[model].get("throughput"), point[model].get("p99_ms"))
                points.append(point)
        return {"points": points}

    def cache(self) -> dict[str, Any]:
        """Device hit vs host hit vs miss at concurrency 1, per history length and model."""
        cfg = self.model
        rows = []
        clients = {m: RankingClient(self.server.grpc_url, model=m, timeout_s=120) for m in MODELS}
        try:
            for tokens in CACHE_HISTORY_TOKENS:
                events = tokens // 2
                if events > cfg["max_history_events"]:
                    logger.warning("cache: %d tokens exceed the model's max history; skipped", tokens)
                    continue
                samples: dict[str, dict[str, list]] = {m: {"device_hit": [], "host_hit": [], "miss": []}
                                                       for m in MODELS}
                for r in range(self.cfg.repeats):
                    warm_histories = {}
                    for model in _order(r):
                        history = self._history(events)
                        user = self._user()
                        prime = RankingRequest(user, history.item_ids[:-CACHE_NEW_EVENTS],
                                               history.action_ids[:-CACHE_NEW_EVENTS], history.candidate_ids)
                        clients[model].score(prime)
                        time.sleep(COMMIT_WAIT_S)
                        warm = dataclasses.replace(history, user_id=user)
                        cold = self._history(events)
                        for kind, req in (("device_hit", warm), ("miss", cold))[:: 1 if r % 2 == 0 else -1]:
                            samples[model][kind].append(self._timed(clients[model], model, req))
                        warm_histories[model] = warm
                    time.sleep(COMMIT_WAIT_S)  # hstu_ranking offloads after FINAL
                    for model in MODELS:  # the other model's history: in the store, not in this pool
                        other = warm_histories[MONOLITHIC if model == ENSEMBLE else ENSEMBLE]
                        samples[model]["host_hit"].append(
                            self._timed(clients[model], model, dataclasses.replace(other, user_id=self._user())))
                row: dict[str, Any] = {"history_tokens": tokens, "new_tokens_on_hit": 2 * CACHE_NEW_EVENTS,
                                       "candidates": CACHE_CANDIDATES}
                for model in MODELS:
                    row[model] = {kind: _timed_summary(s, kind) for kind, s in samples[model].items()}
                    miss, hit = row[model]["miss"], row[model]["device_hit"]
                    row[model]["miss_over_device_hit"] = miss["latency_ms"]["median"] / hit["latency_ms"]["median"]
                    row[model]["miss_over_host_hit"] = (miss["latency_ms"]["median"]
                                                        / row[model]["host_hit"]["latency_ms"]["median"])
                    if hit.get("compute_ms"):
                        row[model]["compute_miss_over_device_hit"] = (miss["compute_ms"]["median"]
                                                                      / hit["compute_ms"]["median"])
                    logger.info("cache %d tokens %s: hit %.1f ms, host hit %.1f ms, miss %.1f ms", tokens, model,
                                hit["latency_ms"]["median"], row[model]["host_hit"]["latency_ms"]["median"],
                                miss["latency_ms"]["median"])
                rows.append(row)
        finally:
            for client in clients.values():
                client.close()
        return {"rows": rows}

    def hop_overhead(self) -> dict[str, Any]:
        """Trivial compute (2 events, 1 candidate), concurrency 1: the ensemble's three hops vs one call."""
        n = self.cfg.overhead_requests
        blocks: dict[str, list[dict]] = {m: [] for m in MODELS}
        clients = {m: RankingClient(self.server.grpc_url, model=m) for m in MODELS}
        try:
            for model in MODELS:  # untimed first calls
                for _ in range(3):
                    clients[model].score(self._tiny())
            for r in range(self.cfg.repeats):
                for model in _order(r):
                    before = model_stats(self.server)
                    latencies = []
                    for _ in range(n):
                        req = self._tiny()
                        t0 = time.perf_counter()
                        clients[model].score(req)
                        latencies.append(time.perf_counter() - t0)
                    run = ReplayResult(latencies_s=latencies, scores=dict.fromkeys(range(n)), wall_s=sum(latencies))
                    blocks[model].append(_run_summary(run, stats_delta(before, model_stats(self.server))))
        finally:
            for client in clients.values():
                client.close()
        out: dict[str, Any] = {"method": (
            f"{self.cfg.repeats} blocks of {n} sequential requests per model on one gRPC stream each, blocks "
            "interleaved; each request has a fresh user, 2 history events (4 tokens: no full page, nothing "
            "cached or offloaded) and 1 candidate, so compute is negligible. overhead = median latency of "
            "hstu_ranking - median latency of hstu_monolithic (client-side, p50 of each block, median over blocks)")}
        for model in MODELS:
            out[model] = _aggregate(blocks[model])
        out["overhead_ms"] = out[ENSEMBLE]["p50_ms"]["median"] - out[MONOLITHIC]["p50_ms"]["median"]
        out["overhead_per_block_ms"] = [e["p50_ms"] - m["p50_ms"] for e, m in zip(blocks[ENSEMBLE], blocks[MONOLITHIC])]
        return out

    def offload_compare(self, off: Server) -> dict[str, Any]:
        """The same load on A (offload on) and B (--store none), interleaved."""
        c = self.cfg.offload_concurrency
        for model in MODELS:  # warm B
            self.replay(self.fresh_trace(self.base[: self.cfg.warmup_requests]), off, model, 4)
        runs: dict[str, dict[str, list]] = {m: {"on": [], "off": []} for m in MODELS}
        for r in range(self.cfg.repeats):
            for model in _order(r):
                for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    server = self.server if side == "on" else off
                    runs[model][side].append(self.measured_replay(server, model, c))
                    _drain_offloads(server)  # a run's deferred offloads must not land in the next run
        out: dict[str, Any] = {"concurrency": c, "method": (
            "server A (--store embedded) and server B (--store none) up at once; per repeat and model, one run "
            "on each, order alternated, each followed by a wait until kv_offload's queue is empty; each run a "
            "fresh relabelling of the sweep trace")}
        for model in MODELS:
            on, off_ = _aggregate(runs[model]["on"]), _aggregate(runs[model]["off"])
            out[model] = {"on": on, "off": off_,
                          "p99_on_over_off": on["p99_ms"]["median"] / off_["p99_ms"]["median"],
                          "p50_on_over_off": on["p50_ms"]["median"] / off_["p50_ms"]["median"],
                          "throughput_on_over_off": on["throughput"]["median"] / off_["throughput"]["median"]}
            logger.info("offload %s c=%d: p99 on/off %.2f", model, c, out[model]["p99_on_over_off"])
        return out

    # ---- helpers --------------------------------------------------------------------------------

    def _user(self) -> int:
        return int(self._rng.integers(10**9, 2 * 10**9))

    def _history(self, events: int) -> RankingRequest:
        m = self.model
        return RankingRequest(self._user(), self._rng.integers(1, m["item_vocab"], events).tolist(),
                              self._rng.integers(0, m["action_vocab"], events).tolist(),
                              self._rng.integers(1, m["item_vocab"], CACHE_CANDIDATES).tolist())

    def _tiny(self) -> RankingRequest:
        m = self.model
        return RankingRequest(self._user(), self._rng.integers(1, m["item_vocab"], 2).tolist(),
                              self._rng.integers(0, m["action_vocab"], 2).tolist(),
                              self._rng.integers(1, m["item_vocab"], 1).tolist())

    def _timed(self, client: RankingClient, model: str, request: RankingRequest) -> dict[str, float]:
        """One request: client latency, and the server-side compute of the model doing the math."""
        before, metrics_before = model_stats(self.server), scrape_metrics(self.server)
        t0 = time.perf_counter()
        client.score(request)
        latency = time.perf_counter() - t0
        delta = stats_delta(before, model_stats(self.server))
        lookups = cache_stats(metrics_before, scrape_metrics(self.server), 0).get(LOOKUP if model == ENSEMBLE else model, {})
        outcome = next((o for o in ("device_hit", "host_hit", "miss") if lookups.get(f"lookups_{o}")), "unknown")
        hop = COMPUTE if model == ENSEMBLE else MONOLITHIC
        return {"latency_ms": latency * 1e3, "outcome": outcome,
                "compute_ms": delta.get(hop, {}).get("compute_infer_ms", float("nan"))}


# ---- Triton statistics and metrics -----------------------------------------------------------------

_STAT_KEYS = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def model_stats(server: Server) -> dict[str, dict]:
    """Cumulative inference statistics of every model, from `/v2/models/stats`."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/stats", timeout=10) as r:
        body = json.loads(r.read())
    out = {}
    for m in body.get("model_stats", []):
        s = m["inference_stats"]
        out[m["name"]] = {"inference_count": int(m.get("inference_count", 0)),
                          "execution_count": int(m.get("execution_count", 0)),
                          **{k: (int(s[k]["count"]), int(s[k]["ns"])) for k in _STAT_KEYS},
                          "batches": {int(b["batch_size"]): (int(b["compute_infer"]["count"]),
                                                             int(b["compute_infer"]["ns"]))
                                      for b in m.get("batch_stats", [])}}
    return out


def stats_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Per model: requests, executions, mean batch size and mean ms per request of each stage."""
    out = {}
    for name, a in after.items():
        b = before.get(name)
        if b is None:
            continue
        n = a["success"][0] - b["success"][0]
        if n <= 0:
            continue
        row = {"requests": n, "executions": a["execution_count"] - b["execution_count"]}
        for k in _STAT_KEYS:
            row[f"{k}_ms"] = (a[k][1] - b[k][1]) / 1e6 / max(a[k][0] - b[k][0], 1)
        # Triton counts compute_* once per request, each with its whole batch's duration
        batches = {size: (c - b["batches"].get(size, (0, 0))[0], ns - b["batches"].get(size, (0, 0))[1])
                   for size, (c, ns) in a["batches"].items()}
        batches = {size: v for size, v in batches.items() if v[0] > 0}
        if batches:
            row["mean_batch_size"] = sum(s * c for s, (c, _) in batches.items()) / sum(c for c, _ in batches.values())
            row["batch_sizes"] = {s: c for s, (c, _) in batches.items()}  # executions per batch size
            row["execution_ms_by_batch_size"] = {s: ns / 1e6 / c for s, (c, ns) in batches.items()}
        out[name] = row
    return out


_METRIC_LINE = re.compile(r"^(hstu_kv_\w+)\{(.*)\} (\S+)$")


def scrape_metrics(server: Server) -> dict[tuple[str, str, str], float]:
    """hstu_kv_* series keyed by (name, model, other labels)."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        model = labels.pop("model", "")
        out[(m.group(1), model, ",".join(f"{k}={v}" for k, v in sorted(labels.items())))] = float(m.group(3))
    return out


def cache_stats(before: dict, after: dict, page_bytes: int) -> dict[str, dict[str, float]]:
    """Per model: lookups and hit rates by tier, tokens served from cache, bytes offloaded and onboarded."""
    def d(name: str, model: str, labels: str = "") -> float:
        return after.get((name, model, labels), 0.0) - before.get((name, model, labels), 0.0)

    out = {}
    for model in sorted({k[1] for k in after}):
        hits = {o: d("hstu_kv_lookups_total", model, f"outcome={o}") for o in ("device_hit", "host_hit", "miss")}
        total = sum(hits.values())
        row: dict[str, float] = {f"lookups_{o}": v for o, v in hits.items()}
        if total:
            row.update({f"{o}_rate": v / total for o, v in hits.items()})
        row["cached_tokens_served"] = d("hstu_kv_cached_tokens_total", model)
        onboarded = d("hstu_kv_onboarded_pages_total", model)
        row["onboarded_pages"], row["onboarded_bytes"] = onboarded, onboarded * page_bytes
        row["offloaded_pages"] = d("hstu_kv_offloaded_pages_total", model)
        row["offloaded_bytes"] = d("hstu_kv_offloaded_bytes_total", model)
        reaps = d("hstu_kv_reap_latency_seconds_count", model)
        if reaps:
            row["reap_latency_ms_mean"] = d("hstu_kv_reap_latency_seconds_sum", model) / reaps * 1e3
        row["store_errors"] = d("hstu_kv_store_errors_total", model)
        for name, key_model, labels in after:  # per-request stage times (hstu_kv_stage_seconds{stage})
            if name == "hstu_kv_stage_seconds_count" and key_model == model:
                count = d(name, model, labels)
                if count:
                    stage = labels.split("=", 1)[1]
                    row[f"stage_{stage}_ms_mean"] = d("hstu_kv_stage_seconds_sum", model, labels) / count * 1e3
        for key, value in after.items():  # gauges: the value now
            if key[1] == model and key[0] in ("hstu_kv_pages", "hstu_kv_offload_queue_depth"):
                row[f"{key[0].removeprefix('hstu_kv_')}{'_' + key[2].split('=')[1] if key[2] else ''}_now"] = value
        if any(v for k, v in row.items() if not k.endswith("_now")):
            out[model] = row
    return out


# ---- perf_analyzer ---------------------------------------------------------------------------------

def run_perf_analyzer(server: Server, model: str, concurrency: int, data: Path, csv: Path,
                      interval_ms: int) -> dict[str, Any]:
    cmd = [str(Path(sys.executable).parent / "perf_analyzer"), "-m", model, "-u", server.grpc_url, "-i", "grpc",
           "--streaming", "--async", "--input-data", str(data), "--concurrency-range", str(concurrency),
           # A cross-check, not a search: 3 time windows taken whatever their spread. The default check
           # (max/min of 3 windows within 10%) never passes on a trace mixing 5 ms hits and 1 s misses,
           # and --request-count reports count / 1 s as the throughput.
           "--measurement-interval", str(interval_ms), "--max-trials", "3", "--stability-percentage", "100000",
           "-f", str(csv)]
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    row: dict[str, Any] = {"wall_s": time.monotonic() - t0, "returncode": out.returncode}
    if csv.exists():
        lines = csv.read_text().splitlines()
        if len(lines) >= 2:
            rec = dict(zip(lines[0].split(","), lines[1].split(",")))
            row["throughput"] = float(rec["Inferences/Second"])
            for q in (50, 90, 95, 99):
                row[f"p{q}_ms"] = float(rec[f"p{q} latency"]) / 1e3
    if "throughput" not in row:  # fall back to the text report
        m = re.search(r"Throughput: ([\d.]+) infer/sec", out.stdout)
        if m:
            row["throughput"] = float(m.group(1))
        m = re.search(r"p99 latency: (\d+) usec", out.stdout)
        if m:
            row["p99_ms"] = int(m.group(1)) / 1e3
    if out.returncode != 0:
        row["error"] = (out.stdout + out.stderr)[-600:]
        logger.warning("perf_analyzer %s c=%d exited %d", model, concurrency, out.returncode)
    return row


# ---- summary ---------------------------------------------------------------------------------------

def summarize(report: dict) -> dict[str, Any]:
    """The ratios the goals are stated in (README, "Benchmarks"), and validity warnings."""
    phases = report["phases"]
    rows = []
    for point in phases.get("sweep", {}).get("points", []):
        e, m = point[ENSEMBLE], point[MONOLITHIC]
        row = {"concurrency": point["concurrency"],
               "ensemble_rps": e["throughput"]["median"], "monolithic_rps": m["throughput"]["median"],
               "throughput_ratio": e["throughput"]["median"] / m["throughput"]["median"],
               "ensemble_p99_ms": e["p99_ms"]["median"], "monolithic_p99_ms": m["p99_ms"]["median"],
               "p99_ratio": e["p99_ms"]["median"] / m["p99_ms"]["median"],
               "ensemble_miss_rate": e["miss_rate"]["median"], "monolithic_miss_rate": m["miss_rate"]["median"],
               "ensemble_rps_spread": [e["throughput"]["min"], e["throughput"]["max"]],
               "monolithic_rps_spread": [m["throughput"]["min"], m["throughput"]["max"]]}
        pa = next((p for p in phases.get("perf_analyzer", {}).get("points", [])
                   if p["concurrency"] == point["concurrency"]), None)
        if pa and pa[ENSEMBLE].get("throughput") and pa[MONOLITHIC].get("throughput"):
            row["pa_ensemble_rps"], row["pa_monolithic_rps"] = pa[ENSEMBLE]["throughput"], pa[MONOLITHIC]["throughput"]
            row["pa_throughput_ratio"] = pa[ENSEMBLE]["throughput"] / pa[MONOLITHIC]["throughput"]
        rows.append(row)
    at8 = next((r for r in rows if r["concurrency"] == 8), None)
    goals: dict[str, Any] = {}
    if at8:
        goals["throughput_ratio_c8"] = {"measured": at8["throughput_ratio"], "goal": ">= 2.0 (CPU)",
                                        "p99_ratio": at8["p99_ratio"], "p99_goal": "<= 1.0",
                                        "met": at8["throughput_ratio"] >= 2.0 and at8["p99_ratio"] <= 1.0}
    if "offload" in report:
        r = report["offload"][ENSEMBLE]["p99_on_over_off"]
        goals["offload_p99_on_over_off"] = {"measured": r, "goal": "<= 1.05", "met": r <= 1.05}
    if "hop_overhead" in phases:
        goals["hop_overhead_ms"] = phases["hop_overhead"]["overhead_ms"]
    return {"rows": rows, "goals": goals, "warnings": _warnings(report)}


def _warnings(report: dict) -> list[str]:
    """What makes this report's numbers mean less than they seem."""
    out = []
    stats = report["phases"].get("cache_stats", {}).get("total", {})
    off = stats.get(OFFLOAD, {})
    if off.get("store_errors") and not off.get("offloaded_bytes"):
        out.append(f"kv_offload offloaded nothing and counted {off['store_errors']:.0f} store errors: the ensemble's "
                   "offloads failed, so 'offload on' did no offload work and host hits in the ensemble are absent")
    for model, st in stats.items():
        if st.get("store_errors") and model != OFFLOAD:
            out.append(f"{model}: {st['store_errors']:.0f} store errors")
    errors = sum(point[m]["errors"] for point in report["phases"].get("sweep", {}).get("points", []) for m in MODELS)
    if errors:
        out.append(f"{errors} failed requests in the sweep")
    for point in report["phases"].get("perf_analyzer", {}).get("points", []):
        for m in MODELS:
            if point[m].get("returncode"):
                out.append(f"perf_analyzer {m} c={point['concurrency']} exited {point[m]['returncode']}")
    load = float(report["load_before"].split()[0])
    if load > 0.5:
        out.append(f"1-min load average {report['load_before'].split()[0]} before the run on "
                   f"{report['machine']['cores']} cores: other work shared the CPU")
    return out


def format_summary(report: dict) -> str:
    s, phases = report["summary"], report["phases"]
    lines = [f"\nhstu-bench on {report['machine']['cpu']} ({report['machine']['cores']} cores), "
             f"load average {report['load_before']} -> {report['load_after']}"]
    if s["rows"]:
        lines.append(f"{'conc':>4} {'ens req/s':>10} {'mono req/s':>10} {'ens/mono':>8} {'ens p99':>8} {'mono p99':>8}"
                     f" {'p99 e/m':>7} {'miss e':>6} {'miss m':>6} {'PA ens':>7} {'PA mono':>7} {'PA e/m':>7}")
    for r in s["rows"]:
        pa = (f"{r['pa_ensemble_rps']:>7.1f} {r['pa_monolithic_rps']:>7.1f} {r['pa_throughput_ratio']:>6.2f}x"
              if "pa_throughput_ratio" in r else f"{'-':>7} {'-':>7} {'-':>7}")
        lines.append(f"{r['concurrency']:>4} {r['ensemble_rps']:>10.1f} {r['monolithic_rps']:>10.1f}"
                     f" {r['throughput_ratio']:>7.2f}x {r['ensemble_p99_ms']:>8.1f} {r['monolithic_p99_ms']:>8.1f}"
                     f" {r['p99_ratio']:>7.2f} {r['ensemble_miss_rate']:>6.0%} {r['monolithic_miss_rate']:>6.0%} {pa}")
    g = s["goals"]
    if "throughput_ratio_c8" in g:
        t = g["throughput_ratio_c8"]
        lines.append(f"ensemble/monolithic throughput at c=8: {t['measured']:.2f}x (goal >= 2x), p99 ratio "
                     f"{t['p99_ratio']:.2f} (goal <= 1): {'MET' if t['met'] else 'MISSED'}")
    if "offload_p99_on_over_off" in g:
        o = report["offload"]
        lines.append(f"offload on/off p99 at c={o['concurrency']}: hstu_ranking {o[ENSEMBLE]['p99_on_over_off']:.2f} "
                     f"(goal <= 1.05: {'MET' if g['offload_p99_on_over_off']['met'] else 'MISSED'}), "
                     f"hstu_monolithic {o[MONOLITHIC]['p99_on_over_off']:.2f}")
    if "hop_overhead_ms" in g:
        h = phases["hop_overhead"]
        lines.append(f"hop overhead (2 events, 1 candidate, c=1): {g['hop_overhead_ms']:+.2f} ms "
                     f"(p50 hstu_ranking {h[ENSEMBLE]['p50_ms']['median']:.2f} ms, "
                     f"hstu_monolithic {h[MONOLITHIC]['p50_ms']['median']:.2f} ms)")
    if "cache" in phases:
        lines.append(f"{'cache, c=1, ms':<16}" + "".join(
            f" | {m:<15} {'hit':>7} {'host':>7} {'miss':>7} {'miss/hit':>8}" for m in MODELS))
        for row in phases["cache"]["rows"]:
            cells = "".join(f" | {'':<15} {row[m]['device_hit']['latency_ms']['median']:>7.1f}"
                            f" {row[m]['host_hit']['latency_ms']['median']:>7.1f}"
                            f" {row[m]['miss']['latency_ms']['median']:>7.1f} {row[m]['miss_over_device_hit']:>7.1f}x"
                            for m in MODELS)
            lines.append(f"{row['history_tokens']:>5} tokens    {cells}")
    for model, st in phases.get("cache_stats", {}).get("total", {}).items():
        rates = " ".join(f"{o} {st.get(o + '_rate', 0):.0%}" for o in ("device_hit", "host_hit", "miss"))
        lines.append(f"cache stats {model:<16} lookups {rates}; offloaded {st['offloaded_bytes'] / 2**20:.1f} MiB, "
                     f"onboarded {st['onboarded_bytes'] / 2**20:.1f} MiB, store errors {st['store_errors']:.0f}")
    for model, st in phases.get("cache_stats", {}).get("total", {}).items():
        stages = ", ".join(f"{k.removeprefix('stage_').removesuffix('_ms_mean')} {v:.2f}"
                           for k, v in st.items() if k.startswith("stage_"))
        if stages:
            lines.append(f"stage time, mean ms per request, {model:<16} {stages}")
    for w in s["warnings"]:
        lines.append(f"WARNING: {w}")
    return "\n".join(lines)


# ---- helpers ---------------------------------------------------------------------------------------

@contextlib.contextmanager
def _server(store: str, **launch):
    http, grpc, metrics = _free_ports(3)
    server = Server(LaunchConfig(http_port=http, grpc_port=grpc, metrics_port=metrics, store=store, **launch))
    t0 = time.monotonic()
    server.start()
    logger.info("server (--store %s) ready in %.0f s on grpc %s", store, time.monotonic() - t0, server.grpc_url)
    try:
        yield server
    finally:
        server.stop()


def _drain_offloads(server: Server, timeout_s: float = 30.0) -> None:
    """Wait until kv_offload has no put in flight (the gauge is refreshed as puts are reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        depth = sum(v for (name, model, _), v in scrape_metrics(server).items()
                    if name == "hstu_kv_offload_queue_depth" and model == OFFLOAD)
        if depth == 0:
            return
        time.sleep(0.1)
    logger.warning("kv_offload still has offloads in flight after %.0f s", timeout_s)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _order(r: int) -> tuple[str, str]:
    """ABBA: which model goes first alternates between repeats."""
    return MODELS if r % 2 == 0 else MODELS[::-1]


def _relabel(trace: list[RankingRequest], variant: int, item_vocab: int) -> list[RankingRequest]:
    """The same trace (users, lengths, order) with user and item ids moved into a fresh id space.

    Items are shifted by a per-variant offset modulo the vocabulary (a bijection on 1..vocab-1, so
    a user's growing history stays a growing prefix); users get a per-variant offset."""
    shift = (variant * 7919) % (item_vocab - 1)
    move = lambda ids: [1 + (i - 1 + shift) % (item_vocab - 1) for i in ids]  # noqa: E731
    return [RankingRequest(r.user_id + variant * 1_000_000, move(r.item_ids), list(r.action_ids),
                           move(r.candidate_ids)) for r in trace]


def _run_summary(result: ReplayResult, stats: dict) -> dict[str, Any]:
    if result.errors:
        logger.warning("%d errors, first: %s", len(result.errors), next(iter(result.errors.values())))
    lat = np.asarray(result.latencies_s) * 1e3
    return {"throughput": result.throughput, "ok": len(result.latencies_s), "errors": len(result.errors),
            "wall_s": result.wall_s, "mean_ms": float(lat.mean()) if lat.size else float("nan"),
            **{f"p{q}_ms": result.percentile_ms(q) for q in (50, 95, 99)},
            "latencies_ms": [round(float(x), 3) for x in lat], "triton": stats}


def _spread(values: list[float]) -> dict[str, float]:
    v = [x for x in values if x == x]
    if not v:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": float(np.median(v)), "min": float(min(v)), "max": float(max(v)), "n": len(v)}


def _aggregate(runs: list[dict]) -> dict[str, Any]:
    """Median and spread over runs of each figure, pooled percentiles, and per-hop statistics."""
    out: dict[str, Any] = {k: _spread([r[k] for r in runs if k in r])
                           for k in ("throughput", "p50_ms", "p95_ms", "p99_ms", "mean_ms", "miss_rate",
                                     "device_hit_rate")}
    pooled = np.concatenate([r["latencies_ms"] for r in runs]) if runs else np.array([])
    out["pooled"] = {f"p{q}_ms": float(np.percentile(pooled, q)) for q in (50, 95, 99)} if pooled.size else {}
    out["errors"] = sum(r["errors"] for r in runs)
    out["runs"] = [{k: v for k, v in r.items() if k not in ("latencies_ms", "triton")} for r in runs]
    out["latencies_ms"] = [r["latencies_ms"] for r in runs]
    hops: dict[str, dict[str, Any]] = {}
    for name in sorted({n for r in runs for n in r["triton"]}):
        keys = sorted({k for r in runs for k, v in r["triton"].get(name, {}).items() if not isinstance(v, dict)})
        hops[name] = {k: _spread([r["triton"][name][k] for r in runs if k in r["triton"].get(name, {})])["median"]
                      for k in keys}
        sizes: dict[int, list] = {}
        for r in runs:
            for size, c in r["triton"].get(name, {}).get("batch_sizes", {}).items():
                sizes.setdefault(size, []).append((c, r["triton"][name]["execution_ms_by_batch_size"][size]))
        if sizes:  # all runs pooled: executions and mean ms per execution, by batch size
            hops[name]["by_batch_size"] = {s: {"executions": sum(c for c, _ in v),
                                               "ms_per_execution": sum(c * ms for c, ms in v) / sum(c for c, _ in v)}
                                           for s, v in sorted(sizes.items())}
    out["triton_per_hop"] = hops
    return out


def _timed_summary(samples: list[dict], kind: str) -> dict[str, Any]:
    """Median and spread over the samples whose lookup outcome (from the metrics) was `kind`."""
    good = [s for s in samples if s["outcome"] == kind]
    if len(good) < len(samples):
        logger.warning("cache: %d of %d '%s' samples had another lookup outcome (%s); left out",
                       len(samples) - len(good), len(samples), kind, [s["outcome"] for s in samples])
    return {"latency_ms": _spread([s["latency_ms"] for s in good]),
            "compute_ms": _spread([s["compute_ms"] for s in good]), "outcome_mismatches": len(samples) - len(good),
            "samples": samples}


def _model_info(server: Server) -> dict[str, Any]:
    from compute import HSTUConfig

    c = HSTUConfig.load(server.settings.model_dir)
    itemsize = np.dtype({"float32": np.float32, "bfloat16": np.float16, "float16": np.float16}[c.dtype]).itemsize
    page_bytes = c.num_layers * 2 * c.page_size * c.num_heads * c.head_dim * itemsize
    return {**dataclasses.asdict(c), "page_bytes": page_bytes, "model_dir": str(server.settings.model_dir),
            "compute_config": _compute_config()}


def _compute_config() -> dict[str, Any]:
    text = (Path(__file__).resolve().parent.parent / "model_repository" / COMPUTE / "config.pbtxt").read_text()
    batch = re.search(r"max_batch_size: (\d+)", text)
    delay = re.search(r"max_queue_delay_microseconds: (\d+)", text)
    return {"max_batch_size": int(batch.group(1)) if batch else None,
            "max_queue_delay_us": int(delay.group(1)) if delay else None}


def _machine(device: str) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    info = {"host": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "device": device,
            "torch": torch.__version__, "python": platform.python_version()}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _jsonable(d: dict) -> dict:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in d.items()}


if __name__ == "__main__":
    sys.exit(main())
