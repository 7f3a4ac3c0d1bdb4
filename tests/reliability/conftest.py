"""Fixtures and helpers for the reliability tests (bad input, faults, load, restart, security).

- `fault_server` (package scope): a second tritonserver + host store for the tests that need a
  config of their own: a small page pool (384 pages of 32 tokens, far smaller than the soak's
  working set; 3 max-length histories fill it), a 512 MB store DRAM tier plus a disk tier, and
  a test model repository (`fault_repository`) whose hstu_compute is a subclass of the real one
  that raises on candidate `FAULT_CANDIDATE` (`fault_models/hstu_compute_model.py`) and whose
  kv_offload answers a request with candidate `SLOW_COMMIT_CANDIDATE` but commits it only once
  the test lets it (`FaultServer.commits_held()`; `fault_models/kv_offload_model.py`). It boots in the background from the first reliability test on, while the
  tests on the session `server` run. Tests that use it may kill and restart its store or the
  whole server; each leaves it serving. It is a `FaultServer`: `kill_store()` SIGKILLs its store
  process, and a store started while `store_copy_delay_s` or `store_match_delay_s` > 0 or
  `store_hold` is set runs `tests/slow_store.py` (the real store server whose copies, or
  matches, each sleep that long, or wait while the test holds them: `FaultServer.held()`), which
  logs each copy and match it starts and ends (`store_calls()`).
- `owner_stats(server)`: kv_lookup_alloc's page table counters, read over its control socket
  (exact and immediate; the metrics port lags by up to a second).
- `wait_drained(server)`: waits until no page is leased or pinned (every lease committed or
  returned, every offload reaped) and returns the owner's stats.
- `kv_metrics(server)`: the KV series of the metrics port that bad input must not change.
- `fire_together(url, requests, model=...)`: one stream per request, all released at once (batching, races).
- `send_in_order(server, groups)`: groups of requests sent one after the other, each once
  kv_lookup_alloc answered the ones before it, so hstu_compute queues them in that order;
  `could_run_alone(batch_sizes, position)` reads Triton's batch statistics of such a run.
- `Load(url, requests, concurrency, model=...)`: background closed-loop load with progress, for faults
  mid-load.
- `MODELS`, `KV_OWNER`: the two public models, and the `model` label of each one's KV series.
- `Users` and `EndlessLoad(url, users, concurrency)`: endless requests of many users with growing
  histories, sent by closed-loop clients until `stop()` (the soak, the rollout, `stress.py`).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from compute import HSTUConfig
from deploy.client import RankingClient, RequestFailed
from deploy.launcher import Server, build_model
from deploy.runtime.schema import COMPUTE, ENSEMBLE, MONOLITHIC, OFFLOAD, RankingRequest
from kvlifecycle.control import ControlClient
from kvlifecycle.store import open_store
from tests.conftest import LocalServer, launch_config
from tests.helpers import ModelStats, metric, wait_for

FAULT_CANDIDATE = 99_991  # never sent by the tests' traces (see `without_fault_candidate`)
SLOW_COMMIT_CANDIDATE = 99_993  # nor this one
FAULT_MODELS = {COMPUTE: Path(__file__).resolve().parent / "fault_models" / "hstu_compute_model.py",
                OFFLOAD: Path(__file__).resolve().parent / "fault_models" / "kv_offload_model.py"}
SLOW_STORE = Path(__file__).resolve().parents[1] / "slow_store.py"
REAL_REPOSITORY = Path(__file__).resolve().parents[2] / "model_repository"
FAULT_POOL_PAGES = 384
TOLERANCE = 1e-4
LOOKUP = "kv_lookup_alloc"
MODELS = [ENSEMBLE, MONOLITHIC]  # the two public models: every serving scenario runs against both
KV_OWNER = {ENSEMBLE: LOOKUP, MONOLITHIC: MONOLITHIC}  # the `model` label of each public model's page table series


def fault_repository(root: Path) -> Path:
    """A model repository of the real models (linked), except the `model.py` of those in
    `FAULT_MODELS`, which is the test subclass that injects the fault. The weights and the AOTI
    package stay in the real model folder (`HSTU_MODEL_DIR`)."""
    repository = root / "fault_repository"
    repository.mkdir(parents=True)
    for model in REAL_REPOSITORY.iterdir():
        if model.is_dir() and model.name not in FAULT_MODELS:
            (repository / model.name).symlink_to(model)
    for name, fault_model in FAULT_MODELS.items():
        version = repository / name / "1"
        version.mkdir(parents=True)
        (repository / name / "config.pbtxt").symlink_to(REAL_REPOSITORY / name / "config.pbtxt")
        (version / "model.py").symlink_to(fault_model)
    return repository


def fault_launch_config(root: Path):
    # host_hit_copy=store: these tests prove the store's copy path (its timeouts, quarantine and the
    # owner's counters); the reader's path has its own (tests/reliability/test_reader_onboard.py).
    return launch_config(root, pool_pages=FAULT_POOL_PAGES, store_disk_dir=root / "disk", store_dram_bytes=512 << 20,
                         host_hit_copy="store",
                         model_repository=fault_repository(root),
                         extra_env={"HSTU_TEST_FAULT_CANDIDATE": str(FAULT_CANDIDATE),
                                    "HSTU_TEST_SLOW_COMMIT_CANDIDATE": str(SLOW_COMMIT_CANDIDATE),
                                    "HSTU_TEST_COMMIT_HOLD_FILE": str(root / "commit.hold"),
                                    "HSTU_TEST_REAL_REPOSITORY": str(REAL_REPOSITORY)})


class FaultServer(LocalServer):
    """`LocalServer` whose store the tests can kill, or start with slow or held copies or
    matches, and whose kv_offload commits late when told."""

    # > 0: the next start_store() runs tests/slow_store.py with these delays
    store_copy_delay_s = 0.0
    store_match_delay_s = 0.0
    # "copy" or "match": the next start_store() runs tests/slow_store.py, whose copies (or matches)
    # wait while `held(fault_server.store_hold_file)` lasts
    store_hold: str | None = None

    @property
    def store_hold_file(self) -> Path:
        return self.settings.run_dir / "store.hold"

    @property
    def store_calls_file(self) -> Path:
        return self.settings.run_dir / "store-calls.log"

    def store_command(self) -> list[str]:
        cmd = super().store_command()
        if not (self.store_copy_delay_s or self.store_match_delay_s or self.store_hold):
            return cmd
        python, module = cmd[0], cmd[1:3]
        assert module == ["-m", "kvlifecycle.store"], f"store_command: expected python -m kvlifecycle.store, got {cmd}"
        hold = ["--hold", self.store_hold, "--hold-file", str(self.store_hold_file)] if self.store_hold else []
        return [python, str(SLOW_STORE), "--copy-delay-s", str(self.store_copy_delay_s),
                "--match-delay-s", str(self.store_match_delay_s), *hold, "--log-file", str(self.store_calls_file),
                *cmd[3:]]

    def start_store(self) -> None:
        self.store_calls_file.unlink(missing_ok=True)  # store_calls() tells this store's calls only
        super().start_store()

    def store_calls(self) -> list[str]:
        """The copies and matches a slow store started and ended so far ("copy start", "copy done", ...)."""
        return self.store_calls_file.read_text().splitlines() if self.store_calls_file.exists() else []

    def commits_held(self) -> contextlib.AbstractContextManager[None]:
        """kv_offload answers requests with SLOW_COMMIT_CANDIDATE but commits none of them (their
        leases stay LEASED) until the block ends (at most COMMIT_HOLD_MAX_S of
        fault_models/kv_offload_model.py)."""
        return held(Path(self.config.extra_env["HSTU_TEST_COMMIT_HOLD_FILE"]))

    def kill_store(self) -> None:
        """SIGKILL the store process; `start_store()` brings it back."""
        os.kill(self.store.pid, signal.SIGKILL)
        self.store.wait()


@contextlib.contextmanager
def held(hold_file: Path) -> Iterator[None]:
    """`hold_file` exists during the block: what it holds (a slow store's copies or matches,
    late commits) waits until the block ends."""
    hold_file.touch()
    try:
        yield
    finally:
        hold_file.unlink(missing_ok=True)


class _EarlyStart:
    """`fault_server` boots in the background from the first reliability test on, while the tests
    on the session `server` run (a startup is 20-40 s of this suite's budget).

    The booting thread lives as long as the server: the launcher's children die with the thread
    that started them (PR_SET_PDEATHSIG follows the parent thread), so it waits for `stop()`."""

    server: Server | None = None
    thread: threading.Thread | None = None
    error: BaseException | None = None
    ready = threading.Event()
    release = threading.Event()
    wanted = False

    @classmethod
    def begin(cls) -> None:
        if cls.server is not None or not cls.wanted:
            return
        cls.server = FaultServer(fault_launch_config(Path(tempfile.mkdtemp(prefix="hstu-fault-server-"))))
        # Build (or check) the model here, so two servers starting at once never build it together.
        build_model(cls.server.settings.model_dir, cls.server.settings.device)
        cls.thread = threading.Thread(target=cls._run, name="fault-server", daemon=True)
        cls.thread.start()

    @classmethod
    def wait_ready(cls) -> Server:
        cls.ready.wait()
        if cls.error is not None:
            raise cls.error
        return cls.server

    @classmethod
    def stop(cls) -> None:
        if cls.server is None:
            return
        cls.release.set()
        if cls.thread is not None:  # None when the session stopped during begin()'s model build
            cls.thread.join()
        cls.server.stop()  # idempotent; also stops what a test restarted from the main thread
        # The soak leaves ~1 GB in the disk tier; the logs (run dir) stay for a post-mortem.
        shutil.rmtree(cls.server.config.store_disk_dir, ignore_errors=True)
        cls.server = None

    @classmethod
    def _run(cls) -> None:
        try:
            cls.server.start()
        except BaseException as e:  # noqa: BLE001 - raised by wait_ready
            cls.error = e
        cls.ready.set()
        cls.release.wait()


def pytest_collection_modifyitems(session, config, items) -> None:
    _EarlyStart.wanted = any("fault_server" in getattr(item, "fixturenames", ()) for item in items)


def pytest_runtest_setup(item) -> None:  # only for tests under tests/reliability
    _EarlyStart.begin()


def pytest_sessionfinish(session, exitstatus) -> None:
    _EarlyStart.stop()  # when the fixture never ran (deselected, or the session was aborted)


@pytest.fixture(scope="package")
def fault_server() -> FaultServer:
    _EarlyStart.wanted = True
    _EarlyStart.begin()
    try:
        yield _EarlyStart.wait_ready()
    finally:
        _EarlyStart.stop()


def owner_stats(server: Server) -> dict[str, int]:
    with ControlClient(server.settings.control_endpoint, timeout_s=30.0) as control:
        return control.stats()


def wait_drained(server: Server, timeout_s: float = 90.0) -> dict[str, int]:
    """Owner stats once nothing is leased, pinned or quarantined; AssertionError (with the stats) on timeout.
    Leases left by a cancelled request return on expiry (lease_ttl_s, 30 s by default)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = owner_stats(server)
        if (stats["pages_leased"], stats["pages_pinned"], stats["leases_active"], stats["pages_quarantined"]) == (0, 0, 0, 0):
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"pool not back at baseline after {timeout_s:.0f}s: leased "
                                 f"{stats['pages_leased']}, pinned {stats['pages_pinned']}, "
                                 f"leases {stats['leases_active']}, quarantined {stats['pages_quarantined']}")
        time.sleep(0.25)


KV_SERIES = [("hstu_kv_pages", {"state": s}) for s in ("free", "in_use", "pinned", "leased")] + \
    [("hstu_kv_lookups_total", {"outcome": o}) for o in ("device_hit", "host_hit", "miss")]


def kv_metrics(server: Server) -> dict[str, float]:
    """kv_lookup_alloc's page gauges and lookup counters, as the metrics port shows them."""
    return {f"{name}{labels}": metric(server, name, model=LOOKUP, **labels) for name, labels in KV_SERIES}


def settled_kv_metrics(server: Server, timeout_s: float = 30.0) -> dict[str, float]:
    """`kv_metrics` once the pool is drained and the metrics port shows the owner's page table
    (the gauges are refreshed every second)."""
    wait_drained(server)
    return wait_for(lambda: metrics_agree_with_owner(server), timeout_s,
                    lambda: f"the metrics port to show the owner's stats {owner_stats(server)}: {kv_metrics(server)}")


def metrics_agree_with_owner(server: Server) -> dict[str, float] | None:
    """`kv_metrics` when every series equals the owner's counter of the same name (exact, read over
    the control socket), else None."""
    shown, stats = kv_metrics(server), owner_stats(server)
    for name, labels in KV_SERIES:
        key = f"pages_{labels['state']}" if "state" in labels else f"lookups_{labels['outcome']}"
        if shown[f"{name}{labels}"] != stats[key]:
            return None
    return shown


def check_scores(reference, request: RankingRequest, served: np.ndarray, what: str = "") -> None:
    expected = reference.score(request.user_id, request.item_ids, request.action_ids, request.candidate_ids)
    assert served.shape == expected.shape, f"{what} user {request.user_id}: shape {served.shape} vs {expected.shape}"
    diff = float(np.abs(served - expected).max())
    assert diff <= TOLERANCE, f"{what} user {request.user_id}: max abs diff {diff:.2e} vs the reference"


def without_fault_candidate(request: RankingRequest) -> RankingRequest:
    cands = [c + 1 if c in (FAULT_CANDIDATE, SLOW_COMMIT_CANDIDATE) else c for c in request.candidate_ids]
    return RankingRequest(request.user_id, request.item_ids, request.action_ids, cands)


def history(user_id: int, events: int, candidates: int = 16, seed: int = 0) -> RankingRequest:
    """A random valid request: `events` history events, `candidates` candidates."""
    rng = np.random.default_rng([user_id, events, seed])
    return without_fault_candidate(RankingRequest(
        user_id, rng.integers(1, 100_000, events).tolist(), rng.integers(0, 16, events).tolist(),
        rng.integers(1, 100_000, candidates).tolist()))


def evict_from_device(client, first_user: int, pages: int = FAULT_POOL_PAGES + 128) -> None:
    """Push every committed page out of `fault_server`'s device pool by serving `pages` pages of
    fresh users' histories (max-length histories, 128 pages each), one at a time."""
    for i in range(max(1, pages // 128)):
        client.score(history(first_user + i, 2048, candidates=1))



def fire_together(url: str, requests: list[RankingRequest], timeout_s: float = 120.0, model: str = ENSEMBLE) -> list:
    """Send each request to `model` on its own stream, all released at once; returns per request
    its scores or the exception (RequestFailed, TimeoutError: a hang) it raised."""
    barrier = threading.Barrier(len(requests))

    def start(threads: list[threading.Thread]) -> None:
        for t in threads:
            t.start()

    return _each_on_its_own_stream(url, requests, timeout_s, start, before_send=barrier.wait, model=model)


BLOCKER_EVENTS = 2048  # a fresh max-length history: ~0.7 s of hstu_compute on 2 CPU cores, 128 pages


def blocker(user_id: int, seed: int = 0) -> RankingRequest:
    """A request that keeps hstu_compute busy while requests sent after it queue up behind it."""
    return history(user_id, BLOCKER_EVENTS, candidates=4, seed=seed)


def send_in_order(server: Server, groups: list[list[RankingRequest]], timeout_s: float = 180.0) -> list:
    """Send `groups` of requests, each request on its own stream; a group goes out once
    kv_lookup_alloc (one instance) answered every request sent before it,
    so hstu_compute's queue holds the groups in this order. Returns each request's scores or the
    exception it raised, flattened in order."""
    requests = [r for group in groups for r in group]

    def answered() -> int:
        s = ModelStats.read(server, LOOKUP)
        return s.success + s.fail

    def start(threads: list[threading.Thread]) -> None:
        lookups, sent = answered(), 0
        for group in groups:
            for _ in group:
                threads[sent].start()
                sent += 1
            wait_for(lambda: answered() >= lookups + sent, timeout_s, f"kv_lookup_alloc to answer {sent} requests",
                     interval_s=0.01)

    return _each_on_its_own_stream(server.grpc_url, requests, timeout_s, start)


def _each_on_its_own_stream(url: str, requests: list[RankingRequest], timeout_s: float,
                            start: Callable[[list[threading.Thread]], None],
                            before_send: Callable[[], object] | None = None, model: str = ENSEMBLE) -> list:
    """One client and one thread per request; `start(threads)` starts the threads (thread `i`
    sends request `i`, after `before_send()`). Returns each request's scores or the exception it
    raised; a thread still running after the timeout fails the test."""
    out: list = [None] * len(requests)
    clients = [RankingClient(url, model=model, timeout_s=timeout_s) for _ in requests]

    def one(i: int) -> None:
        if before_send is not None:
            before_send()
        try:
            out[i] = clients[i].score(requests[i])
        except Exception as e:  # noqa: BLE001 - reported to the test as the outcome
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    try:
        start(threads)
        for t in threads:
            t.join(timeout_s + 30)
        assert not any(t.is_alive() for t in threads), "a client thread hung"
    finally:
        for c in clients:
            c.close()
    return out


def could_run_alone(batch_sizes: Counter, position: int) -> bool:
    """Whether the request at `position` (0-based) of requests a model ran in queue order, in
    batches of these sizes (Triton's batch statistics: size -> executions; their order is not
    known), may have been alone in its batch: then batches holding exactly `position` requests
    ran before it."""
    sizes = list(batch_sizes.elements())
    if 1 not in sizes:
        return False
    sizes.remove(1)
    before = {0}  # request counts that some of the other batches add up to
    for size in sizes:
        before |= {n + size for n in before}
    return position in before


class Load:
    """Closed-loop clients in the background sending `requests` to `model` in order; `done`
    counts answered requests; `results` maps request index -> scores or the exception raised."""

    def __init__(self, url: str, requests: list[RankingRequest], concurrency: int, timeout_s: float = 120.0,
                 model: str = ENSEMBLE):
        self.requests = requests
        self.results: dict[int, object] = {}
        self._next = iter(range(len(requests)))
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._worker, args=(url, model, timeout_s), daemon=True)
                         for _ in range(concurrency)]
        for t in self._threads:
            t.start()

    @property
    def done(self) -> int:
        with self._lock:
            return len(self.results)

    def wait_done(self, n: int, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.done < n:
            assert time.monotonic() < deadline, f"load made no progress: {self.done} of {n} answered"
            time.sleep(0.05)

    def join(self, timeout_s: float = 600.0) -> dict[int, object]:
        for t in self._threads:
            t.join(timeout_s)
        assert not any(t.is_alive() for t in self._threads), "a load client hung"
        return self.results

    def _worker(self, url: str, model: str, timeout_s: float) -> None:
        with RankingClient(url, model=model, timeout_s=timeout_s) as client:
            while True:
                with self._lock:
                    i = next(self._next, None)
                if i is None:
                    return
                try:
                    outcome: object = client.score(self.requests[i])
                except Exception as e:  # noqa: BLE001 - reported to the test as the outcome
                    outcome = e
                with self._lock:
                    self.results[i] = outcome


def register_pool(server: Server, timeout_s: float = 120.0) -> None:
    """Attach the ensemble's pool in a freshly started store now (as kv_lookup_alloc's client does
    on its next NO_POOL), waiting as long as the store takes to set up its tiers."""
    handle = json.loads(server.settings.pool_handle_path.read_text())
    page_size = HSTUConfig.load(server.settings.model_dir).page_size
    store = open_store("embedded", endpoint=server.settings.store_endpoint, page_size=page_size,
                       rpc_timeout_s=timeout_s)
    try:
        assert store.register_pool(handle), f"the store at {server.settings.store_endpoint} refused the pool"
    finally:
        store.close()


def store_errors(server: Server, models: tuple[str, ...] = ()) -> float:
    """hstu_kv_store_errors_total of `models` (each a `model` label), or of every model."""
    if not models:
        return metric(server, "hstu_kv_store_errors_total")
    return sum(metric(server, "hstu_kv_store_errors_total", model=m) for m in models)


class Users:
    """Endless requests: `num_users` users, picked uniformly, each history growing by 1..8 events
    per request from a lognormal start (median 40 events); a user reaching `max_events` starts
    over as a new user. Thread-safe."""

    def __init__(self, seed: int = 21, num_users: int = 600, max_events: int = 120):
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()
        self._histories: dict[int, tuple[list[int], list[int]]] = {}
        self._ids = list(range(1_000_000, 1_000_000 + num_users))
        self._max_events = max_events

    def next(self) -> RankingRequest:
        with self._lock:
            rng = self._rng
            slot = int(rng.integers(len(self._ids)))
            user = self._ids[slot]
            items, actions = self._histories.get(user, ([], []))
            grow = int(rng.lognormal(np.log(40), 0.5)) if not items else int(rng.integers(1, 9))
            if len(items) + grow > self._max_events:
                user = self._ids[slot] = user + len(self._ids)  # a new user takes the slot
                items, actions = [], []
                grow = int(rng.integers(1, 60))
            items = items + rng.integers(1, 100_000, grow).tolist()
            actions = actions + rng.integers(0, 16, grow).tolist()
            self._histories[user] = (items, actions)
            candidates = [c for c in rng.integers(1, 100_000, int(rng.integers(8, 48))).tolist() if c != FAULT_CANDIDATE]
            return RankingRequest(user, items, actions, candidates)


@dataclass
class Served:
    sent_at: float  # time.monotonic() when the request went out
    request: RankingRequest
    scores: np.ndarray


class EndlessLoad:
    """`concurrency` closed-loop clients sending `users.next()` until `stop()`. `count` counts the
    answered requests; `served` keeps the answers `keep(count)` selects (all by default);
    `errors` the failures; `retried` the requests resent after a retryable error."""

    def __init__(self, url: str, users: Users, concurrency: int, keep: Callable[[int], bool] = lambda n: True,
                 timeout_s: float = 120.0):
        self.count, self.retried = 0, 0
        self.served: list[Served] = []
        self.errors: list[str] = []
        self._users, self._keep = users, keep
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._worker, args=(url, timeout_s), daemon=True)
                         for _ in range(concurrency)]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()

    def running(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    def join(self, timeout_s: float = 150.0) -> None:
        """Stop and wait for every client; AssertionError when one hung (a request never answered)."""
        self.stop()
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not self.running(), f"a load client hung ({self.count} answered, {len(self.errors)} failed)"

    def _worker(self, url: str, timeout_s: float) -> None:
        with RankingClient(url, timeout_s=timeout_s) as client:
            while not self._stop.is_set():
                request = self._users.next()
                sent = time.monotonic()
                try:
                    scores = client.score(request)
                except (RequestFailed, TimeoutError) as e:
                    with self._lock:
                        self.errors.append(f"{type(e).__name__}: {e}")
                    continue
                with self._lock:
                    self.count += 1
                    if self._keep(self.count):
                        self.served.append(Served(sent, request, scores))
            with self._lock:
                self.retried += client.retried
