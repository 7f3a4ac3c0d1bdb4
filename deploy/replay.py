"""`replay(trace, ...)`, the load generator: a closed loop of `concurrency` clients
(`deploy.client.RankingClient`), each with its own stream, taking the trace's requests in order.
Every request of the trace ends up either scored or an error (a refused connection, a broken
stream, a client that could not start): `ReplayResult.failure` says why a run cannot pass, and
`check_scores` (`deploy/score_check.py`) raises `CheckFailed` on such a run, and on one that
scored nothing, instead of reporting a max diff over nothing.

Routing by user (`route_header="x-user-id"`): one gRPC stream carries one user
(`deploy/client.py`), so `replay` gives each worker whole users (balanced by request count) and
keeps one open stream per user (at most `MAX_USER_STREAMS` per worker), each user's requests in
trace order, one at a time.

Several processes (`replay(..., processes=N)`, `hstu-client --processes N`): one Python process
cannot drive a fast server (its client threads share one GIL: at the same concurrency a
one-process replay measured 2.6x less than perf_analyzer). With N > 1 the trace's users are
split over N worker processes (whole users, balanced by request count, so one user's requests
stay in one process in trace order) and the clients over the processes; each process runs the
same threaded replay on its share, and the results are merged under the original trace indexes.
The processes start, import and report ready first; the wall time runs from their common
release to the last process's end, so it covers sending only.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from deploy.client import RankingClient, RequestFailed
from deploy.runtime.schema import ENSEMBLE, RankingRequest

MAX_USER_STREAMS = 64  # open gRPC streams per replay worker in routing mode (least recently used closed)
PROCESS_START_TIMEOUT_S = 300.0  # a replay process's spawn and imports, on a busy host (not timed)


@dataclass
class ReplayResult:
    latencies_s: list[float] = field(default_factory=list)  # per successful request, in trace order
    scores: dict[int, np.ndarray] = field(default_factory=dict)  # trace index -> scores
    errors: dict[int, str] = field(default_factory=dict)  # trace index -> error message
    wall_s: float = 0.0

    @property
    def failure(self) -> str | None:
        """Why this run cannot pass (failed requests, or nothing scored); None when every request was scored."""
        if self.errors:
            first = min(self.errors)
            return (f"{len(self.errors)} of {len(self.errors) + len(self.scores)} requests failed "
                    f"(request {first}: {self.errors[first]})")
        if not self.scores:
            return "no request was scored"
        return None

    @property
    def throughput(self) -> float:
        return len(self.scores) / self.wall_s if self.wall_s else 0.0

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q) * 1e3) if self.latencies_s else float("nan")


def default_processes(concurrency: int) -> int:
    """Replay processes for `concurrency` clients: one per 8 clients, at most half the cores.

    Why 8: one Python process keeps about 8 streaming clients busy before their threads queue
    on its GIL (marshalling inputs, reading responses); more clients per process measure the
    client, not the server. Why half the cores: the server on the same host (tritonserver, its
    Python backend stubs, the host store) needs the other half, and a replay process that has
    no core of its own measures scheduling instead."""
    return max(1, min(concurrency // 8 or 1, (os.cpu_count() or 2) // 2 or 1))


def replay(trace: list[RankingRequest], url: str, model: str = ENSEMBLE, concurrency: int = 1,
           http: bool = False, timeout_s: float = 60.0, route_header: str | None = None,
           processes: int = 1, stream: bool = False) -> ReplayResult:
    """Send the trace with `concurrency` closed-loop clients; collect scores, latencies, errors.

    With `route_header` each worker owns whole users and keeps one stream per user (see the
    module docstring); without it the workers share the trace in order. Any exception of a
    request is that request's error (a broken gRPC stream raises from `async_stream_infer`, a
    refused HTTP connection from urlopen); a request a worker never sent, because the worker
    itself failed, is an error too.

    `processes` > 1 spreads the clients over that many worker processes (never more than
    `concurrency`, nor than the trace has users), each owning whole users: see the module
    docstring. The result is the same as one process's, under the same trace indexes.
    `http`: HTTP /generate; `stream`: gRPC streams; else unary gRPC (see the module docstring)."""
    transport = "http" if http else "stream" if stream else "grpc"
    processes = min(processes, concurrency)
    if processes > 1:
        parts = partition_by_user(trace, processes)
        if len(parts) > 1:  # one user (or none): one process is all there is, so stay in this one
            return _replay_processes(trace, parts, url, model, concurrency, transport, timeout_s, route_header)
    return _replay_threads(trace, url, model, concurrency, transport, timeout_s, route_header)


def _client(url: str, model: str, transport: str, timeout_s: float, route_header: str | None = None) -> RankingClient:
    return RankingClient(url, model=model, http=transport == "http", stream=transport == "stream", timeout_s=timeout_s,
                         route_header=route_header)


def _replay_threads(trace: list[RankingRequest], url: str, model: str, concurrency: int,
                    transport: str, timeout_s: float, route_header: str | None) -> ReplayResult:
    """`replay` in this process: `concurrency` client threads."""
    result = ReplayResult()
    lock = threading.Lock()
    latencies: dict[int, float] = {}
    worker_errors: list[str] = []

    def send(client: RankingClient, i: int) -> None:
        start = time.perf_counter()
        try:
            scores = client.score(trace[i])
        except Exception as e:  # noqa: BLE001 - every failure is this request's error, never a lost request
            with lock:
                result.errors[i] = str(e) if isinstance(e, RequestFailed) else f"{type(e).__name__}: {e}"
            return
        with lock:
            latencies[i] = time.perf_counter() - start
            result.scores[i] = scores

    next_index = iter(range(len(trace)))

    def shared_worker() -> None:
        with _client(url, model, transport, timeout_s) as client:
            while True:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                send(client, i)

    def user_worker(indexes: list[int]) -> None:
        streams: OrderedDict[int, RankingClient] = OrderedDict()  # user -> its stream, LRU order
        try:
            for i in indexes:
                user = int(trace[i].user_id)
                client = streams.pop(user, None)
                if client is None:
                    client = _client(url, model, transport, timeout_s, route_header)
                    if len(streams) >= MAX_USER_STREAMS:
                        streams.popitem(last=False)[1].close()
                streams[user] = client
                send(client, i)
        finally:
            for client in streams.values():
                client.close()

    def guarded(fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - recorded; its unsent requests become errors below
            with lock:
                worker_errors.append(f"{type(e).__name__}: {e}")

    if route_header is None:
        targets = [(shared_worker, ()) for _ in range(concurrency)]
    else:
        targets = [(user_worker, (indexes,)) for indexes in partition_by_user(trace, concurrency)]
    start = time.perf_counter()
    threads = [threading.Thread(target=guarded, args=(fn, *args), daemon=True) for fn, args in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    result.wall_s = time.perf_counter() - start
    for i in range(len(trace)):
        if i not in result.scores and i not in result.errors:
            result.errors[i] = "not sent: " + (worker_errors[0] if worker_errors else "no client worker took it")
    result.latencies_s = [latencies[i] for i in sorted(latencies)]
    return result


def _replay_processes(trace: list[RankingRequest], parts: list[list[int]], url: str, model: str,
                      concurrency: int, transport: str, timeout_s: float, route_header: str | None) -> ReplayResult:
    """`replay` over one worker process per part of `parts` (trace indexes of whole users), the
    `concurrency` clients dealt as evenly as possible (each part at least one: len(parts) <= concurrency).

    "spawn": a forked child would inherit the gRPC state of this process (a channel another
    thread opened), which gRPC does not support; a spawned child starts clean. Each child reports
    ready once it has imported its client, then waits for the common release, so neither the
    spawn nor the imports are timed."""
    ctx = multiprocessing.get_context("spawn")
    release = ctx.Event()
    shares = [concurrency // len(parts) + (k < concurrency % len(parts)) for k in range(len(parts))]
    workers: list[tuple[multiprocessing.connection.Connection, multiprocessing.process.BaseProcess, list[int]]] = []
    result = ReplayResult()
    failed: dict[int, str] = {}  # part -> why it gave no result
    try:
        for indexes, share in zip(parts, shares):
            receiver, sender = ctx.Pipe(duplex=False)
            process = ctx.Process(target=_replay_process, daemon=True, name="hstu-replay",
                                  args=(sender, release, [trace[i] for i in indexes], share, url, model, transport,
                                        timeout_s, route_header))
            process.start()
            sender.close()  # the child holds it now; our copy would keep EOF from ever arriving
            workers.append((receiver, process, indexes))
        for k, (receiver, process, _) in enumerate(workers):
            message = _receive(receiver, process, PROCESS_START_TIMEOUT_S)
            if message != "ready":
                failed[k] = f"replay process did not start: {message}"
                process.terminate()  # a late starter must not send its part after the release: its requests are errors
        released = time.monotonic()  # CLOCK_MONOTONIC is system-wide: the children's end times compare with it
        release.set()
        ends: list[float] = []
        latencies: dict[int, float] = {}
        for k, (receiver, process, indexes) in enumerate(workers):
            if k in failed:
                continue
            message = _receive(receiver, process, None)
            if not isinstance(message, tuple):
                failed[k] = f"replay process failed: {message}"
                continue
            scores, part_latencies, errors, end = message
            ends.append(end)
            # the child's indexes are positions in its part: back to the trace's indexes
            result.scores.update((indexes[j], v) for j, v in scores.items())
            latencies.update((indexes[j], v) for j, v in part_latencies.items())
            result.errors.update((indexes[j], v) for j, v in errors.items())
        result.wall_s = max(ends) - released if ends else 0.0
    finally:
        # Normally every child has sent its result and is exiting. When this replay broke off
        # (an exception, ^C), a child still waiting for the release or still sending is stopped:
        # releasing it would send its part with nobody reading the result.
        for receiver, process, _ in workers:
            receiver.close()
            process.join(timeout=10.0 if release.is_set() else 0.0)
            if process.is_alive():
                process.terminate()
                process.join()
    for k, why in failed.items():
        for i in workers[k][2]:
            result.errors[i] = f"not sent: {why}"
    result.latencies_s = [latencies[i] for i in sorted(latencies)]
    return result


def _receive(receiver: multiprocessing.connection.Connection, process: multiprocessing.process.BaseProcess,
             timeout_s: float | None) -> object:
    """The next message of a replay process, or a string saying why none came (it exited, or the timeout)."""
    multiprocessing.connection.wait([receiver, process.sentinel], timeout_s)
    if receiver.poll():  # checked first: a child that sent and exited has both ready
        try:
            return receiver.recv()
        except EOFError:
            pass
    if not process.is_alive():
        process.join()
        return f"exited with code {process.exitcode} before it answered"
    return f"no answer within {timeout_s:g} s"


def _replay_process(sender: multiprocessing.connection.Connection, release: multiprocessing.synchronize.Event,
                    trace: list[RankingRequest], concurrency: int, url: str, model: str, transport: str,
                    timeout_s: float, route_header: str | None) -> None:
    """A replay worker process: report ready, wait for the release, replay `trace` (one part of the
    parent's), send back (scores, latencies, errors keyed by position in `trace`, end time)."""
    try:
        if transport != "http":
            import tritonclient.grpc  # noqa: F401 - imported before the release, so its import is not timed
        sender.send("ready")
        release.wait()
        part = _replay_threads(trace, url, model, concurrency, transport, timeout_s, route_header)
        end = time.monotonic()
        # latencies_s is in trace order over the scored requests: the sorted score indexes
        latencies = dict(zip(sorted(part.scores), part.latencies_s, strict=True))
        sender.send((part.scores, latencies, part.errors, end))
    except Exception as e:  # noqa: BLE001 - the parent turns this part's requests into errors with this cause
        sender.send(f"{type(e).__name__}: {e}")
    finally:
        sender.close()


def partition_by_user(trace: list[RankingRequest], parts: int) -> list[list[int]]:
    """Trace indexes split into `parts` lists of whole users (greedy by request count, so the
    parts carry similar load), each list in trace order."""
    by_user: dict[int, list[int]] = {}
    for i, r in enumerate(trace):
        by_user.setdefault(int(r.user_id), []).append(i)
    loads = [0] * parts
    out: list[list[int]] = [[] for _ in range(parts)]
    for user in sorted(by_user, key=lambda u: (-len(by_user[u]), u)):
        k = loads.index(min(loads))
        out[k] += by_user[user]
        loads[k] += len(by_user[user])
    return [sorted(indexes) for indexes in out if indexes]

