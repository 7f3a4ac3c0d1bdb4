"""Clients of `hstu_ranking` (and `hstu_monolithic`): unary gRPC, gRPC streams and HTTP `/generate`.

    client = RankingClient("127.0.0.1:8001")                # unary gRPC (ModelInfer), the default
    scores = client.score(request)                           # np.ndarray [c, num_tasks]
    client = RankingClient("127.0.0.1:8001", stream=True)   # a gRPC bidirectional stream
    client = RankingClient("127.0.0.1:8000", http=True)     # HTTP /generate

Unary by default: tritonserver 2.51 corrupts the inputs of a Python model that takes several
requests per execute, and crashes now and then, when those requests arrive on gRPC streams;
with unary calls it did not (docs/ARCHITECTURE.md, "Batching on tritonserver 2.51"). The
ensemble's steps batch, so streams are for a server rendered with `--lifecycle-max-batch-size 1`.

Routing by user (`route_header="x-user-id"`, `hstu-client --route-header`): every request
carries its user id in that header, so a proxy with consistent hashing on it (`hstu-cluster`'s
nginx) sends a user to the server that caches the user's KV. HTTP and unary gRPC set the header
per request. A gRPC stream's headers are fixed when the stream opens, and a proxy routes the whole stream
to one server, so one stream must carry one user: `RankingClient` (re)opens its stream with the
user's header when the user changes (and `deploy/replay.py` keeps one stream per user).

The load generator over many clients is `deploy/replay.py`; the check against the reference
scorer, `deploy/score_check.py`; the `hstu-client` command line, `deploy/client_cli.py`.
"""
from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import numpy as np

from deploy.runtime.schema import ENSEMBLE, RETRYABLE, RankingRequest


ROUTE_HEADER = "x-user-id"


class RequestFailed(RuntimeError):
    """The server answered with an error (bad input, pool exhausted, a failed step)."""


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
