"""Clients of `hstu_ranking` (and `hstu_monolithic`): unary gRPC, gRPC streams and HTTP `/generate`.

    client = RankingClient("127.0.0.1:8001")                # unary gRPC (ModelInfer), the default
    scores = client.score(request)                           # np.ndarray [c, num_tasks]
    client = RankingClient("127.0.0.1:8001", stream=True)   # a gRPC bidirectional stream
    client = RankingClient("127.0.0.1:8000", http=True)     # HTTP /generate

Unary by default: tritonserver 2.51 corrupts the inputs of a Python model that takes several
requests per execute, and crashes now and then, when those requests arrive on gRPC streams;
with unary calls it did not (docs/ARCHITECTURE.md, "Batching on tritonserver 2.51"). The
ensemble's steps batch, so streams are for a server rendered with `--lifecycle-max-batch-size 1`.

`replay(trace, ...)` is the load generator: a closed loop of `concurrency` clients, each with
its own stream, taking the trace's requests in order. Every request of the trace ends up either
scored or an error (a refused connection, a broken stream, a client that could not start):
`ReplayResult.failure` says why a run cannot pass, and `check_scores` raises `CheckFailed` on
such a run, and on one that scored nothing, instead of reporting a max diff over nothing.

Routing by user (`route_header="x-user-id"`, `hstu-client --route-header`): every request
carries its user id in that header, so a proxy with consistent hashing on it (`hstu-cluster`'s
nginx) sends a user to the server that caches the user's KV. HTTP and unary gRPC set the header
per request. A gRPC stream's headers are fixed when the stream opens, and a proxy routes the whole stream
to one server, so one stream must carry one user: `RankingClient` (re)opens its stream with the
user's header when the user changes, and `replay` gives each worker whole users (balanced by
request count) and keeps one open stream per user (at most `MAX_USER_STREAMS` per worker), each
user's requests in trace order, one at a time.

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

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import queue
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from deploy import trace as trace_mod
from deploy.runtime.schema import ENSEMBLE, RETRYABLE, RankingRequest


ROUTE_HEADER = "x-user-id"
MAX_USER_STREAMS = 64  # open gRPC streams per replay worker in routing mode (least recently used closed)
PROCESS_START_TIMEOUT_S = 300.0  # a replay process's spawn and imports, on a busy host (not timed)


class RequestFailed(RuntimeError):
    """The server answered with an error (bad input, pool exhausted, a failed step)."""


class CheckFailed(RuntimeError):
    """A score check that cannot pass: requests failed, or nothing was scored to compare."""


class RankingClient:
    """One connection (gRPC, one gRPC stream, or HTTP keep-alive) sending one request at a time."""

    def __init__(self, url: str, model: str = ENSEMBLE, http: bool = False, timeout_s: float = 60.0,
                 headers: dict[str, str] | None = None, route_header: str | None = None, retries: int = 2,
                 stream: bool = False):
        """`route_header`: a header name (e.g. "x-user-id") that carries each request's user id
        (a stream is reopened with it whenever the user changes). `retries`: how often a request
        whose error is marked retryable is resent. `stream`: a gRPC stream instead of unary calls
        (see the module docstring before using one against batched steps)."""
        self.url, self.model, self.http, self.timeout_s = url, model, http, timeout_s
        self.stream = stream and not http
        self.retries = retries
        self.retried = 0  # requests resent after a retryable error
        self.headers = headers or {}
        self.route_header = route_header
        self._responses: queue.Queue = queue.Queue()
        self._next_id = 0
        self._stream_headers: dict[str, str] | None = None  # of the open gRPC stream
        if not http:
            import tritonclient.grpc as grpcclient

            from tritonclient.utils import InferenceServerException

            self._grpc = grpcclient
            self._grpc_error = InferenceServerException
            self._client = grpcclient.InferenceServerClient(url)
            if self.stream and route_header is None:
                self._open_stream(self.headers)  # else on the first request, with its user's header

    def score(self, request: RankingRequest) -> np.ndarray:
        """Scores [c, num_tasks] for one request; raises RequestFailed on a server error. An
        error the server marks retryable (a model version changed while the request was in
        flight) is resent, up to `retries` times."""
        for attempt in range(self.retries + 1):
            try:
                if self.http:
                    return self._score_http(request)
                return self._score_stream(request) if self.stream else self._score_unary(request)
            except RequestFailed as e:
                if RETRYABLE not in str(e) or attempt == self.retries:
                    raise
                self.retried += 1
        raise AssertionError("unreachable")

    def close(self) -> None:
        if not self.http:
            if self._stream_headers is not None:
                self._client.stop_stream()
            self._client.close()

    def __enter__(self) -> "RankingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------------------

    def _request_headers(self, request: RankingRequest) -> dict[str, str]:
        if self.route_header is None:
            return self.headers
        return {**self.headers, self.route_header: str(int(request.user_id))}

    def _open_stream(self, headers: dict[str, str]) -> None:
        if self._stream_headers is not None:
            self._client.stop_stream()
            self._responses = queue.Queue()  # a late response of the old stream must not be read
        responses = self._responses
        self._client.start_stream(callback=lambda result, error: responses.put((result, error)), headers=headers)
        self._stream_headers = headers

    def _grpc_inputs(self, request: RankingRequest) -> list:
        inputs = []
        for name, arr in request.arrays().items():
            t = self._grpc.InferInput(name, list(arr.shape), "INT64")
            t.set_data_from_numpy(arr)
            inputs.append(t)
        return inputs

    def _score_unary(self, request: RankingRequest) -> np.ndarray:
        try:
            result = self._client.infer(self.model, self._grpc_inputs(request), headers=self._request_headers(request),
                                        outputs=[self._grpc.InferRequestedOutput("scores")],
                                        client_timeout=self.timeout_s)
        except self._grpc_error as e:
            if "Deadline" in str(e):
                raise TimeoutError(f"no response from {self.model} within {self.timeout_s}s") from None
            raise RequestFailed(str(e)) from None
        return result.as_numpy("scores")

    def _score_stream(self, request: RankingRequest) -> np.ndarray:
        headers = self._request_headers(request)
        if headers != self._stream_headers:
            self._open_stream(headers)
        inputs = self._grpc_inputs(request)
        self._next_id += 1
        request_id = str(self._next_id)
        try:
            self._client.async_stream_infer(self.model, inputs, request_id=request_id,
                                            outputs=[self._grpc.InferRequestedOutput("scores")])
        except Exception as e:  # the stream broke before this request went out; its callback has the cause
            raise RequestFailed(f"{self._queued_error() or e}") from None
        while True:
            try:
                result, error = self._responses.get(timeout=self.timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no response from {self.model} within {self.timeout_s}s") from None
            if error is not None:
                raise RequestFailed(str(error))
            if result.get_response().id != request_id:
                continue  # a late response to an earlier, timed-out request
            return result.as_numpy("scores")

    def _queued_error(self) -> str | None:
        """The error a broken stream reported through its callback, if it is waiting in the queue."""
        try:
            while True:
                _, error = self._responses.get_nowait()
                if error is not None:
                    return str(error)
        except queue.Empty:
            return None

    def _score_http(self, request: RankingRequest) -> np.ndarray:
        body = json.dumps(request.to_json()).encode()
        req = urllib.request.Request(f"http://{self.url}/v2/models/{self.model}/generate", data=body,
                                     headers={"Content-Type": "application/json", **self._request_headers(request)})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                reply = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise RequestFailed(e.read().decode(errors="replace")) from None
        scores = np.asarray(reply["scores"], dtype=np.float32)
        return scores.reshape(len(request.candidate_ids), -1)


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


def reference_scores(trace: list[RankingRequest], model_repository: str | Path,
                     device: str = "cpu") -> list[np.ndarray]:
    """The reference scorer's scores of every request of ``trace``: compute once, then check
    every run over the same trace against them (``check_scores(..., expected=...)``)."""
    from compute import load_reference

    ref = load_reference(str(model_repository), device)
    return [ref.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids) for r in trace]


class ScoreCheck:
    """Served scores against the reference scorer, tallied over many runs: hstu-bench checks every
    request it times, after its run (the check itself is never timed). ``device``: where the
    float32 reference runs ("cuda" checks thousands of requests in seconds)."""

    def __init__(self, model_repository: str | Path, tolerance: float, device: str = "cpu") -> None:
        from compute import load_reference

        self.reference = load_reference(str(model_repository), device)
        self.tolerance = tolerance
        self.checked = 0
        self.failed = 0  # requests whose max abs diff exceeds the tolerance
        self.max_abs_diff = 0.0

    def check(self, requests: list[RankingRequest], served: list[np.ndarray]) -> float:
        """The max abs diff over ``requests`` and their ``served`` scores (same order)."""
        worst = 0.0
        for r, scores in zip(requests, served, strict=True):
            diff = max_abs_diff(scores, self.reference.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids))
            worst = max(worst, diff)
            self.failed += diff > self.tolerance
        self.checked += len(requests)
        self.max_abs_diff = max(self.max_abs_diff, worst)
        return worst

    @property
    def device(self) -> str:
        return str(self.reference.device)

    def check_replay(self, trace: list[RankingRequest], result: ReplayResult) -> float:
        """``check`` over the requests of ``trace`` that ``result`` scored."""
        indexes = sorted(result.scores)
        return self.check([trace[i] for i in indexes], [result.scores[i] for i in indexes])


def check_scores(trace: list[RankingRequest], result: ReplayResult, model_repository: str | Path,
                 expected: list[np.ndarray] | None = None) -> float:
    """Max abs difference between the served scores and the reference scorer's (invariant 1).
    ``expected``: ``reference_scores(trace, ...)`` when already computed.

    Raises CheckFailed unless every request of ``trace`` was scored: a max diff over failed or
    missing requests (0 over none at all) would read as a pass."""
    if result.failure is not None:
        raise CheckFailed(result.failure)
    if set(result.scores) != set(range(len(trace))):
        raise CheckFailed(f"{len(result.scores)} requests scored for a trace of {len(trace)}: not this trace's run")
    if expected is None:
        from compute import load_reference

        ref = load_reference(str(model_repository))
    worst = 0.0
    for i, served in result.scores.items():
        r = trace[i]
        want = expected[i] if expected is not None else ref.score(r.user_id, r.item_ids, r.action_ids, r.candidate_ids)
        worst = max(worst, max_abs_diff(served, want))
    return worst


def max_abs_diff(served, want: np.ndarray) -> float:
    """The largest absolute difference between served scores and the reference's."""
    return float(np.abs(np.asarray(served) - want).max())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hstu-client", description="Send ranking requests to hstu_ranking.")
    p.add_argument("--url", help="host:port (default 127.0.0.1:8001 for gRPC, :8000 with --http)")
    p.add_argument("--http", action="store_true", help="use HTTP /generate instead of unary gRPC")
    p.add_argument("--stream", action="store_true",
                   help="use a gRPC stream instead of unary gRPC (only against a server whose lifecycle steps take "
                        "one request per execute: tritonserver 2.51 corrupts batched inputs that came on streams)")
    p.add_argument("--model", default=ENSEMBLE, help="hstu_ranking or hstu_monolithic")
    p.add_argument("--trace", type=Path, help="JSONL trace (see hstu-trace)")
    p.add_argument("--user", type=int, help="user id (single request mode)")
    p.add_argument("--items", help="comma-separated item ids, oldest first")
    p.add_argument("--actions", help="comma-separated action ids, one per item")
    p.add_argument("--candidates", help="comma-separated candidate item ids")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--processes", type=int, default=1,
                   help="spread the clients over this many processes, each owning whole users (one Python "
                        "process cannot drive a fast server)")
    p.add_argument("--route-header", nargs="?", const=ROUTE_HEADER, default=None, metavar="NAME",
                   help=f"carry the user id in this header (default {ROUTE_HEADER}) for a routing proxy "
                        "(hstu-cluster); each worker owns whole users (with --stream: one stream per user)")
    p.add_argument("--check", action="store_true", help="compare every response with the reference scorer")
    p.add_argument("--model-repository", default="model_repository")
    p.add_argument("--tolerance", type=float, default=1e-4)
    a = p.parse_args(argv)
    url = a.url or ("127.0.0.1:8000" if a.http else "127.0.0.1:8001")

    if a.trace:
        trace = trace_mod.load(a.trace)
    elif a.user is not None and a.items and a.actions and a.candidates:
        ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
        trace = [RankingRequest(a.user, ints(a.items), ints(a.actions), ints(a.candidates))]
    else:
        p.error("give --trace FILE, or --user, --items, --actions and --candidates")

    result = replay(trace, url, model=a.model, concurrency=a.concurrency, http=a.http, stream=a.stream,
                    route_header=a.route_header, processes=a.processes)
    if len(trace) == 1 and result.scores:
        print(json.dumps({"scores": result.scores[0].tolist()}))
    print(f"{a.model}: {len(result.scores)}/{len(trace)} ok, {len(result.errors)} errors, "
          f"{result.throughput:.1f} req/s, p50 {result.percentile_ms(50):.1f} ms, "
          f"p99 {result.percentile_ms(99):.1f} ms (concurrency {a.concurrency}, processes {a.processes})")
    for i, err in list(result.errors.items())[:5]:
        print(f"  request {i}: {err}", file=sys.stderr)
    code = 0 if result.failure is None else 1  # failed requests, or nothing scored
    if a.check:
        try:
            worst = check_scores(trace, result, a.model_repository)
        except CheckFailed as e:
            print(f"check vs reference scorer: FAIL ({e})")
            return 1
        ok = worst <= a.tolerance
        print(f"check vs reference scorer: max abs diff {worst:.2e} ({'OK' if ok else 'FAIL'}, tolerance {a.tolerance:g})")
        code = code or (0 if ok else 1)
    return code


if __name__ == "__main__":
    sys.exit(main())
