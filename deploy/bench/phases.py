"""hstu-bench's measurements against running servers; each phase returns its typed result (deploy/bench/results.py).

    bench = Bench(server_a, config, model)          # model: the served HSTUConfig and its page size
    bench.run_on_a() -> PhaseResults                # warm-up, then the configured phases, in this order:
      sweep          throughput and p50/p95/p99 per concurrency (`deploy.replay.replay`), `repeats` runs
                     per point, the two models interleaved (ABBA) so drift hits both; Triton's per-model
                     statistics and the KV metrics read around every run.
      perf_analyzer  the same points once per model, a cross-check.
      cache          concurrency 1, 64 candidates: a device hit (the user's history again + 8 new events),
                     a host hit (a history the other model offloaded), a miss (fresh history, same length),
                     for 256 / 1,024 / 4,096 history tokens.
      hop_overhead   1 candidate, 2 events (compute negligible), concurrency 1: ensemble minus monolithic.
      device_hit     concurrency 1, back to back, at 1,024 and 4,096 history tokens: a user's next request
                     (its history cached, 8 new events, 64 candidates) and a miss of the same length, with
                     Triton's per-model times: where a request's time goes, and what the cache saves.
    bench.offload_compare(server_b) -> OffloadComparison   # B: --store none; the same load on A and B, interleaved
    bench.host_hits(server_c, ...) -> HostHitLoad  # C: a pool of `host_hit_pool_pages()`; one trace of 32 users
                     # per request in flight on A and on C, each replayed twice at c=8 and the second pass timed:
                     # device hits on A, mostly host hits on C (its pool holds a few histories, the store all)

Every timed request's scores are checked against the float32 reference scorer after its run
(`ScoreCheck`; perf_analyzer's cannot be: it keeps no responses).
The hstu_kv_* metrics are scraped at every phase boundary (`PhaseResults.kv_cache` holds the deltas).
Every measured run replays the same trace relabelled into fresh user and item ids (`relabel`): the
two models share the host store and its keys are content-addressed over tokens, so without it a
model would find the KV the other model (or an earlier run) offloaded and skip the misses.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np

from deploy.bench.config import MODELS, BenchConfig, ServedModel
from deploy.bench.metric_waits import (MODELS_CALLED, drain_offloads, lookup_owner, lookups_published, lookups_total,
                                       stats_counted)
from deploy.bench.perf_analyzer import run_perf_analyzer
from deploy.bench.results import (CacheCase, CacheModelRow, CacheRow, DeviceHit, HopOverhead, HostHitLoad,
                                  HostHitSides, MeasuredRun, OffloadComparison, OffloadSides, PerfAnalyzerPoint, PhaseResults, RunsSummary,
                                  Spread, Sweep, SweepPoint, TimedRequest, TraceSummary)
from deploy.client import RankingClient
from deploy.launcher import Server
from deploy.metrics import scrape
from deploy.replay import ReplayResult, default_processes, replay
from deploy.runtime.schema import COMPUTE, ENSEMBLE, MONOLITHIC, RankingRequest
from deploy.score_check import ScoreCheck
from deploy.server_stats import LOOKUP_OUTCOMES, hop_stats, kv_cache_stats, read_model_stats
from deploy.trace import TraceConfig, generate, perf_analyzer_data

logger = logging.getLogger("hstu-bench")

CACHE_NEW_EVENTS = 8
CACHE_CANDIDATES = 64
OFFLOAD_SETTLE_S = 0.5  # both models offload a request's pages after its answer; let the puts land
METRICS_SETTLE_S = 1.5  # the models publish their KV metrics every second
HOST_HIT_USERS_PER_REQUEST_IN_FLIGHT = 32  # host_hits' trace: users (one request each) per request in flight


class Bench:
    """All phases against one server (A); `offload_compare` adds a second one (B)."""

    def __init__(self, server: Server, cfg: BenchConfig, model: ServedModel, scores: ScoreCheck | None = None):
        self.server, self.cfg, self.model = server, cfg, model.config
        self.scores = scores  # every timed request's scores checked after its run (None: not checked)
        self.page_bytes = model.page_bytes
        self.base = self._trace(cfg.users, cfg.requests)
        # host_hits: many more users than the concurrency, so that a small pool holds few of them, and
        # one request each (a user's last of a uniform trace), so that the timed pass finds each
        # history where the first pass left it
        users = HOST_HIT_USERS_PER_REQUEST_IN_FLIGHT * cfg.offload_concurrency
        self.host_hit_base = list({r.user_id: r for r in self._trace(users, 4 * users, zipf_a=0.0)}.values())
        self._variant = 0
        self._rng = np.random.default_rng(cfg.seed + 1)
        self.failed_requests = 0  # over every replay; hstu-bench exits non-zero when any failed

    def run_on_a(self) -> PhaseResults:
        results = PhaseResults()
        scrapes = [("start", scrape(self.server.metrics_url))]

        def boundary(name: str) -> None:
            time.sleep(METRICS_SETTLE_S)
            scrapes.append((name, scrape(self.server.metrics_url)))

        self.warmup()
        boundary("warmup")
        for name, step in (("sweep", self.sweep), ("perf_analyzer", self.perf_analyzer_sweep),
                           ("cache", self.cache), ("hop_overhead", self.hop_overhead),
                           ("device_hit", self.device_hit)):
            if name in self.cfg.phases:
                setattr(results, name, step())
                boundary(name)
        for (_, before), (name, after) in zip(scrapes, scrapes[1:]):
            results.kv_cache[name] = kv_cache_stats(before, after, self.page_bytes)
        results.kv_cache["total"] = kv_cache_stats(scrapes[0][1], scrapes[-1][1], self.page_bytes)
        return results

    def warmup(self) -> None:
        trace = self.base[: self.cfg.warmup_requests]
        for model in MODELS:
            logger.info("warm-up: %s", model)
            self.replay(self.fresh_trace(trace), self.server, model, 4)

    def sweep(self) -> Sweep:
        points = []
        for c in self.cfg.concurrencies:
            runs: dict[str, list[MeasuredRun]] = {m: [] for m in MODELS}
            for r in range(self.cfg.repeats):
                for model in models_in_turn(r):
                    runs[model].append(self.measured_replay(self.server, model, c))
            point = SweepPoint(c, {m: RunsSummary.of(runs[m]) for m in MODELS})
            for model, s in point.models.items():
                logger.info("c=%d %s: %.1f req/s, p99 %.1f ms", c, model, s.throughput.median, s.p99_ms.median)
            points.append(point)
        trace = TraceSummary(self.cfg.users, self.cfg.requests,
                             history_events_mean=float(np.mean([len(r.item_ids) for r in self.base])),
                             candidates_mean=float(np.mean([len(r.candidate_ids) for r in self.base])))
        return Sweep(trace, points)

    def perf_analyzer_sweep(self) -> list[PerfAnalyzerPoint]:
        points = []
        with tempfile.TemporaryDirectory(prefix="hstu-bench-pa-") as tmp:
            for i, c in enumerate(self.cfg.concurrencies):
                point = PerfAnalyzerPoint(c, {})
                for model in models_in_turn(i):
                    data = Path(tmp) / f"{model}-{c}.json"
                    data.write_text(json.dumps(perf_analyzer_data(self.fresh_trace())))
                    result = run_perf_analyzer(self.server.grpc_url, model, c, data, Path(tmp) / f"{model}-{c}.csv",
                                               self.cfg.pa_interval_ms)
                    point.models[model] = result
                    logger.info("perf_analyzer c=%d %s: %.1f req/s, p99 %.1f ms", c, model, result.throughput,
                                result.p99_ms)
                points.append(point)
        return points

    def cache(self) -> list[CacheRow]:
        """Device hit vs host hit vs miss at concurrency 1, per history length and model."""
        rows = []
        clients = {m: RankingClient(self.server.grpc_url, model=m, timeout_s=120) for m in MODELS}
        try:
            for tokens in self.cfg.cache_tokens:
                events = tokens // 2
                if events > self.model.max_history_events:
                    logger.warning("cache: %d tokens exceed the model's max history; skipped", tokens)
                    continue
                if not rows:  # the store's first copy into a pool pays one-time CUDA costs: not timed
                    self._cache_round(clients, events, 0)
                samples = {m: {kind: [] for kind in LOOKUP_OUTCOMES} for m in MODELS}
                for r in range(self.cfg.repeats):
                    for model, timed in self._cache_round(clients, events, r).items():
                        for kind, request in timed.items():
                            samples[model][kind].append(request)
                row = CacheRow(tokens, 2 * CACHE_NEW_EVENTS, CACHE_CANDIDATES,
                               {m: _cache_model_row(samples[m]) for m in MODELS})
                for model, m in row.models.items():
                    logger.info("cache %d tokens %s: hit %.1f ms, host hit %.1f ms, miss %.1f ms", tokens, model,
                                *(m.cases[k].latency_ms.median for k in LOOKUP_OUTCOMES))
                rows.append(row)
        finally:
            for client in clients.values():
                client.close()
        return rows

    def _cache_round(self, clients: dict[str, RankingClient], events: int, r: int) -> dict[str, dict[str, TimedRequest]]:
        """One repeat of the cache phase: per model, a device hit and a miss (in turn order r), then
        a host hit on the other model's history (in the store, not in this model's pool)."""
        timed: dict[str, dict[str, TimedRequest]] = {m: {} for m in MODELS}
        warm_histories = {}
        for model in models_in_turn(r):
            history, user = self._history(events), self._user()
            prime = RankingRequest(user, history.item_ids[:-CACHE_NEW_EVENTS],
                                   history.action_ids[:-CACHE_NEW_EVENTS], history.candidate_ids)
            self._score_settled(clients[model], model, prime)
            time.sleep(OFFLOAD_SETTLE_S)
            warm = dataclasses.replace(history, user_id=user)
            cold = self._history(events)
            for kind, req in (("device_hit", warm), ("miss", cold))[:: 1 if r % 2 == 0 else -1]:
                timed[model][kind] = self._timed(clients[model], model, req)
            warm_histories[model] = warm
        time.sleep(OFFLOAD_SETTLE_S)  # the offloads of the histories read next
        for model in MODELS:
            other = warm_histories[MONOLITHIC if model == ENSEMBLE else ENSEMBLE]
            timed[model]["host_hit"] = self._timed(clients[model], model, dataclasses.replace(other, user_id=self._user()))
        return timed

    def hop_overhead(self) -> HopOverhead:
        """Trivial compute (2 events, 1 candidate), concurrency 1: the ensemble's three hops vs one call."""
        n = self.cfg.overhead_requests
        models = self._sequential_blocks(lambda client: [self._tiny() for _ in range(n)])
        per_block = [e.p50_ms - m.p50_ms for e, m in zip(models[ENSEMBLE].runs, models[MONOLITHIC].runs)]
        return HopOverhead(
            method=(f"{self.cfg.repeats} blocks of {n} sequential requests per model on one gRPC connection each, blocks "
                    "interleaved; each request has a fresh user, 2 history events (4 tokens: no full page, nothing "
                    "cached or offloaded) and 1 candidate, so compute is negligible. overhead = median over block "
                    "pairs of (hstu_ranking's p50 - hstu_monolithic's p50 in the adjacent block): a pair shares the "
                    "machine's state, so drift between pairs cancels"),
            models=models, overhead_ms=float(np.median(per_block)), overhead_per_block_ms=per_block)

    def device_hit(self) -> list[DeviceHit]:
        """Per history length, concurrency 1, back to back: a user's next request (its history again
        plus 8 new events, 64 candidates) and a miss of the same length."""
        n = self.cfg.device_hit_requests
        rows = []
        for tokens in self.cfg.device_hit_tokens:
            events = tokens // 2

            def primed_hits(client: RankingClient) -> list[RankingRequest]:
                hits = [self._history(events) for _ in range(n)]
                for hit in hits:  # the previous request of each user caches its history
                    client.score(dataclasses.replace(hit, item_ids=hit.item_ids[:-CACHE_NEW_EVENTS],
                                                     action_ids=hit.action_ids[:-CACHE_NEW_EVENTS]))
                return hits

            hits = self._sequential_blocks(primed_hits)
            misses = self._sequential_blocks(lambda client: [self._history(events) for _ in range(n)])
            rows.append(DeviceHit(
                method=(f"{self.cfg.repeats} blocks per model and kind, interleaved; a hit block primes {n} fresh "
                        f"users with {events - CACHE_NEW_EVENTS} events each, then times each user's next request "
                        f"({events} events, {2 * events} tokens, {CACHE_CANDIDATES} candidates) back to back on one "
                        f"gRPC connection; a miss block times {n} fresh users of the same length; Triton's per-model "
                        "statistics are read around the timed requests only"),
                history_tokens=2 * events, candidates=CACHE_CANDIDATES, models=hits, misses=misses,
                p50_ensemble_over_monolithic=hits[ENSEMBLE].p50_ms.median / hits[MONOLITHIC].p50_ms.median,
                miss_over_device_hit={m: misses[m].p50_ms.median / hits[m].p50_ms.median for m in MODELS}))
        return rows

    def offload_compare(self, off: Server) -> OffloadComparison:
        """The same load on A (offload on) and B (--store none), interleaved."""
        c = self.cfg.offload_concurrency
        for model in MODELS:  # warm B
            self.replay(self.fresh_trace(self.base[: self.cfg.warmup_requests]), off, model, 4)
        time.sleep(METRICS_SETTLE_S)  # the warm-up's lookups published before the first run's scrape
        runs: dict[str, dict[str, list[MeasuredRun]]] = {m: {"on": [], "off": []} for m in MODELS}
        for r in range(self.cfg.repeats):
            for model in models_in_turn(r):
                for side in (("on", "off") if r % 2 == 0 else ("off", "on")):
                    server = self.server if side == "on" else off
                    runs[model][side].append(self.measured_replay(server, model, c))
                    drain_offloads(server)  # a run's deferred offloads must not land in the next run
        models = {}
        for model in MODELS:
            on, off_ = RunsSummary.of(runs[model]["on"]), RunsSummary.of(runs[model]["off"])
            models[model] = OffloadSides(on, off_, p99_on_over_off=on.p99_ms.median / off_.p99_ms.median,
                                         p50_on_over_off=on.p50_ms.median / off_.p50_ms.median,
                                         throughput_on_over_off=on.throughput.median / off_.throughput.median)
            logger.info("offload %s c=%d: p99 on/off %.2f", model, c, models[model].p99_on_over_off)
        return OffloadComparison(c, (
            "server A (--store embedded) and server B (--store none) up at once; per repeat and model, one run "
            "on each, order alternated, each followed by a wait until kv_offload's queue is empty; each run a "
            "fresh relabelling of the sweep trace"), models)

    def host_hit_pool_pages(self) -> int:
        """Server C's pool: room for `offload_concurrency` of the host_hits trace's longest requests in
        flight, half again (their prefixes pinned, one batch more), a few of its many users' histories."""
        longest = max(len(r.item_ids) for r in self.host_hit_base) * 2  # two tokens per event
        return 3 * self.cfg.offload_concurrency * -(-longest // self.model.page_size) // 2

    def host_hits(self, small: Server, small_pool_pages: int, pool_pages: int) -> HostHitLoad:
        """The same trace on A and on C (small pool), twice each, the second pass timed."""
        c = self.cfg.offload_concurrency
        runs: dict[str, dict[str, list[MeasuredRun]]] = {m: {"device": [], "host": []} for m in MODELS}
        for r in range(self.cfg.repeats):
            for model in models_in_turn(r):
                for side in (("device", "host") if r % 2 == 0 else ("host", "device")):
                    server = self.server if side == "device" else small
                    trace = self.fresh_trace(self.host_hit_base)
                    lookups_before = lookups_total(scrape(server.metrics_url), model)
                    first = self.replay(trace, server, model, c)  # caches every history (A), or offloads it (C)
                    # its lookups (misses) published before the timed pass reads its own
                    lookups_published(server, lookup_owner(model), lookups_before + len(first.scores))
                    drain_offloads(server)
                    runs[model][side].append(self.measured_replay(server, model, c, trace))
                    drain_offloads(server)
        models = {}
        for model in MODELS:
            device, host = RunsSummary.of(runs[model]["device"]), RunsSummary.of(runs[model]["host"])
            rate = Spread.of([r.lookup_rate("host_hit") for r in runs[model]["host"]]).median
            models[model] = HostHitSides(device, host, p99_host_over_device=host.p99_ms.median / device.p99_ms.median,
                                         p50_host_over_device=host.p50_ms.median / device.p50_ms.median,
                                         host_hit_rate=rate)
            logger.info("host hits %s c=%d: p99 host/device %.2f, host hits %.0f%%", model, c,
                        models[model].p99_host_over_device, 100 * rate)
        return HostHitLoad(c, {"A": pool_pages, "C": small_pool_pages}, (
            f"servers A (pool of {pool_pages} pages) and C ({small_pool_pages} pages: a few histories) up at once, "
            f"both with a host store; per repeat, model and server (order alternated), a fresh relabelling of a "
            f"trace of one request for each of {len(self.host_hit_base)} users "
            f"replayed twice at c={c}, the second pass timed: on A its lookups are device hits, on C "
            "mostly host hits (the first pass offloaded every history); kv_offload's queue drained around each "
            "pass"), models)

    # ---- one request or run -----------------------------------------------------------------

    def replay(self, trace: list[RankingRequest], server: Server, model: str, concurrency: int) -> ReplayResult:
        """`deploy.replay.replay` (over `default_processes(concurrency)` processes, so that the
        client is not the limit), counting failed requests; a run that scored nothing raises
        (there is nothing to measure, and its throughput of 0 would read as a result)."""
        result = replay(trace, server.grpc_url, model=model, concurrency=concurrency,
                        processes=default_processes(concurrency))
        self.failed_requests += len(result.errors)
        if not result.scores:
            raise RuntimeError(f"hstu-bench: {model} at concurrency {concurrency} on {server.grpc_url}: "
                               f"{result.failure}; nothing to measure")
        if result.errors:
            logger.warning("%d errors, first: %s", len(result.errors), next(iter(result.errors.values())))
        return result

    def measured_replay(self, server: Server, model: str, concurrency: int,
                        trace: list[RankingRequest] | None = None) -> MeasuredRun:
        trace = self.fresh_trace() if trace is None else trace
        stats_before, metrics_before = read_model_stats(server.http_url), scrape(server.metrics_url)
        result = self.replay(trace, server, model, concurrency)
        stats_after = read_model_stats(server.http_url)
        if self.scores is not None:
            self.scores.check_replay(trace, result)
        metrics_after = lookups_published(server, lookup_owner(model),
                                          lookups_total(metrics_before, model) + len(result.scores))
        lookups = kv_cache_stats(metrics_before, metrics_after, self.page_bytes)[lookup_owner(model)].lookups
        return MeasuredRun.of(result, hop_stats(stats_before, stats_after), lookups)

    def fresh_trace(self, trace: list[RankingRequest] | None = None) -> list[RankingRequest]:
        self._variant += 1
        return relabel(self.base if trace is None else trace, self._variant, self.model.item_vocab)

    def _timed(self, client: RankingClient, model: str, request: RankingRequest) -> TimedRequest:
        """One request: client latency, the server-side compute of the model doing the math, and the
        outcome of its lookup."""
        stats_before, metrics_before = read_model_stats(self.server.http_url), scrape(self.server.metrics_url)
        t0 = time.perf_counter()
        scores = client.score(request)
        latency = time.perf_counter() - t0
        hops = hop_stats(stats_before, read_model_stats(self.server.http_url))
        if self.scores is not None:
            self.scores.check([request], [scores])
        metrics_after = lookups_published(self.server, lookup_owner(model), lookups_total(metrics_before, model) + 1)
        lookups = kv_cache_stats(metrics_before, metrics_after, 0)[lookup_owner(model)].lookups
        hop = hops.get(COMPUTE if model == ENSEMBLE else MONOLITHIC)
        return TimedRequest(latency * 1e3, hop.ms_per_request["compute_infer"] if hop else float("nan"),
                            lookups.outcome)

    def _sequential_blocks(self, block_requests) -> dict[str, RunsSummary]:
        """`repeats` blocks per model, interleaved (ABBA): `block_requests(client)` does any priming and
        returns the requests to time, which are sent one after another; Triton's statistics are
        read around them, each read once Triton has counted the requests before it
        (`stats_counted`), and only the block's own models kept. What is left: when the read
        before a block's priming still lacked the request before it, the block's window may count
        the priming's last request (one request more in its means, never another model's)."""
        blocks: dict[str, list[MeasuredRun]] = {m: [] for m in MODELS}
        clients = {m: RankingClient(self.server.grpc_url, model=m, timeout_s=120) for m in MODELS}
        try:
            for model in MODELS:  # untimed first calls
                for _ in range(3):
                    clients[model].score(self._tiny())
            for r in range(self.cfg.repeats):
                for model in models_in_turn(r):
                    unprimed = read_model_stats(self.server.http_url)
                    priming = _CountingClient(clients[model])
                    requests = block_requests(priming)
                    # the priming's requests counted before the window opens, the window's before it closes
                    before = stats_counted(self.server, unprimed, model, priming.calls)
                    latencies, served = [], []
                    for request in requests:
                        t0 = time.perf_counter()
                        served.append(clients[model].score(request))
                        latencies.append(time.perf_counter() - t0)
                    run = ReplayResult(latencies_s=latencies, scores=dict(enumerate(served)),
                                       wall_s=sum(latencies))
                    hops = hop_stats(before, stats_counted(self.server, before, model, len(requests)),
                                     MODELS_CALLED[model])
                    if self.scores is not None:
                        self.scores.check(requests, served)
                    blocks[model].append(MeasuredRun.of(run, hops, lookups=None))
        finally:
            for client in clients.values():
                client.close()
        return {m: RunsSummary.of(blocks[m]) for m in MODELS}

    def _score_settled(self, client: RankingClient, model: str, request: RankingRequest) -> None:
        """Score one request and wait until its lookup is published, so the next scrape starts clean."""
        before = lookups_total(scrape(self.server.metrics_url), model)
        client.score(request)
        lookups_published(self.server, lookup_owner(model), before + 1)

    def _trace(self, users: int, requests: int, **overrides) -> list[RankingRequest]:
        m = self.model
        return generate(TraceConfig(num_users=users, num_requests=requests, seed=self.cfg.seed, **overrides,
                                    initial_events_median=self.cfg.initial_events_median,
                                    max_history_events=m.max_history_events, item_vocab=m.item_vocab,
                                    action_vocab=m.action_vocab))

    def _user(self) -> int:
        return int(self._rng.integers(10**9, 2 * 10**9))

    def _history(self, events: int) -> RankingRequest:
        m = self.model
        return RankingRequest(self._user(), self._rng.integers(1, m.item_vocab, events).tolist(),
                              self._rng.integers(0, m.action_vocab, events).tolist(),
                              self._rng.integers(1, m.item_vocab, CACHE_CANDIDATES).tolist())

    def _tiny(self) -> RankingRequest:
        m = self.model
        return RankingRequest(self._user(), self._rng.integers(1, m.item_vocab, 2).tolist(),
                              self._rng.integers(0, m.action_vocab, 2).tolist(),
                              self._rng.integers(1, m.item_vocab, 1).tolist())


class _CountingClient:
    """A client's `score`, counting the calls (the requests a block's priming sent)."""

    def __init__(self, client: RankingClient) -> None:
        self.client = client
        self.calls = 0

    def score(self, request: RankingRequest):
        self.calls += 1
        return self.client.score(request)


def models_in_turn(r: int) -> tuple[str, str]:
    """Which model goes first alternates between repeats."""
    return MODELS if r % 2 == 0 else MODELS[::-1]


def relabel(trace: list[RankingRequest], variant: int, item_vocab: int) -> list[RankingRequest]:
    """The same trace (users, lengths, order) with user and item ids moved into a fresh id space.

    Items are shifted by a per-variant offset modulo the vocabulary (a bijection on 1..vocab-1, so
    a user's growing history stays a growing prefix); users get a per-variant offset."""
    shift = (variant * 7919) % (item_vocab - 1)
    move = lambda ids: [1 + (i - 1 + shift) % (item_vocab - 1) for i in ids]  # noqa: E731
    return [RankingRequest(r.user_id + variant * 1_000_000, move(r.item_ids), list(r.action_ids),
                           move(r.candidate_ids)) for r in trace]


# ---- helpers --------------------------------------------------------------------------------------

def _cache_model_row(samples: dict[str, list[TimedRequest]]) -> CacheModelRow:
    cases = {kind: _cache_case(s, kind) for kind, s in samples.items()}
    median = lambda kind, figure: getattr(cases[kind], figure).median  # noqa: E731
    return CacheModelRow(cases, miss_over_device_hit=median("miss", "latency_ms") / median("device_hit", "latency_ms"),
                         miss_over_host_hit=median("miss", "latency_ms") / median("host_hit", "latency_ms"),
                         compute_miss_over_device_hit=median("miss", "compute_ms") / median("device_hit", "compute_ms"))


def _cache_case(samples: list[TimedRequest], kind: str) -> CacheCase:
    """Median and spread over the samples whose lookup outcome (from the metrics) was `kind`."""
    good = [s for s in samples if s.outcome == kind]
    if len(good) < len(samples):
        logger.warning("cache: %d of %d '%s' samples had another lookup outcome (%s); left out",
                       len(samples) - len(good), len(samples), kind, [s.outcome for s in samples])
    return CacheCase(Spread.of([s.latency_ms for s in good]), Spread.of([s.compute_ms for s in good]),
                     outcome_mismatches=len(samples) - len(good), samples=samples)
