"""The one pyzmq RPC layer of the project: the control plane (``control.py``) and the host store
(``store/``) both speak it. No pickle.

A message is a list of zmq frames::

    [b"", header, array_0, array_1, ...]     (a ROUTER adds/strips the peer identity)

``header`` is UTF-8 JSON carrying ``v`` (``PROTOCOL_VERSION``), ``seq`` (chosen by the client,
echoed by the reply) and ``arrays`` (the names of the array frames, in order). Arrays are raw
little-endian int64 bytes. Every reply header carries ``rpc``, an ``RpcStatus`` value; the
caller compares it as ``RpcStatus(reply["rpc"]) is RpcStatus.OK``, never as a string.

Endpoints are ``ipc://PATH`` in a directory private to this user (``prepare_ipc_dir``; a fresh
one from ``default_endpoint``) or, for the store only, ``tcp://HOST:PORT``.

Server side (a ROUTER socket, one thread): ``answer(frames, handle)`` turns one request into its
reply: ``handle(header, arrays)`` returns the reply body (status OK), raises ``RpcError`` for an
expected refusal, or ValueError/KeyError/TypeError for a malformed request (BAD_REQUEST, the
message names the field); anything else is a bug (ERROR, logged with its traceback).

Client side: ``RpcClient(endpoint).call(header, arrays, timeout_s)`` sends one request and waits
for the reply carrying its ``seq``; ``None`` when none came in time (the socket is then dropped
and made afresh on the next call, so a late reply is never read as another call's).

``Timeouts`` is the one table of how long the serving path waits on another process.
"""

from __future__ import annotations

import collections
import enum
import json
import logging
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import zmq

logger = logging.getLogger(__name__)

__all__ = ["PROTOCOL_VERSION", "RpcClient", "RpcError", "RpcStatus", "TIMEOUTS", "Timeouts", "answer", "decode",
           "default_endpoint", "encode", "prepare_ipc_dir"]

PROTOCOL_VERSION = 1
_INT64 = np.dtype("<i8")


class RpcStatus(str, enum.Enum):
    """Outcome of one RPC (a store task's outcome is a ``store.Status``, reported by ``poll``)."""

    OK = "ok"
    BAD_REQUEST = "bad_request"  # malformed or inconsistent request; ``error`` names the field
    NO_POOL = "no_pool"          # store: the transfer's page pool is not attached (register_pool, then retry)
    BUSY = "busy"                # store: stopping, or the request came after its accept deadline
    UNSUPPORTED = "unsupported"  # store: this store cannot do that (e.g. locate without a shared slab)
    ERROR = "error"              # the server failed (a bug); ``error`` says where


class RpcError(Exception):
    """An expected non-OK outcome a handler answers with (``status``, and a message naming the
    cause and the fix)."""

    def __init__(self, status: RpcStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Timeouts:
    """How long the serving path waits on another process, in seconds: one table, built from the
    one wait an operator sets, the store RPC timeout (``HSTU_STORE_TIMEOUT_S``).

    - ``store_rpc_s``: one store RPC on the request path (match, submit, poll). No answer in time
      is a miss: the request recomputes, and the client fails calls at once for ``store_retry_s``.
    - ``onboard_wait_s``: a request's host hits being copied into the device pool (the copy
      itself, several RPCs): 4 x ``store_rpc_s``, at least 2 s; past it the request recomputes.
    - ``store_register_s``: ``register_pool``, once per pool: the store maps the pool (a CUDA IPC
      open on a GPU), slower than a request's RPC, and a timeout there is no outage.
    - ``task_start_s``: a store task not started this long after it was sent fails without
      touching the pool, so its pages can be reused after it.
    - ``control_s``: a control-plane call to the page table's owner (commit, abort, offload_done).
    - ``offload_wait_s``: ``hstu_monolithic`` waits for its request's offload and reaps it inline
      (the baseline's shape); past it the request is answered and the puts finish later.

    Not request-path waits, so not here: the lease TTL (``HSTU_LEASE_TTL_S``), kv_offload's flush
    at unload, and the FlexKV store's start (``flexkv.READY_TIMEOUT_S``).
    """

    store_rpc_s: float = 0.5
    store_retry_s: float = 1.0
    store_register_s: float = 10.0
    task_start_s: float = 5.0
    control_s: float = 5.0
    offload_wait_s: float = 10.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"Timeouts.{name}: expected > 0 seconds, got {value}")

    @property
    def onboard_wait_s(self) -> float:
        return max(4 * self.store_rpc_s, 2.0)


TIMEOUTS = Timeouts()


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ValueError when it is not one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, got {address!r}")
    return host, int(port)


def encode(header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None) -> list[bytes]:
    """Frames for ``header`` plus named int64 arrays (the leading empty delimiter included)."""
    arrays = arrays or {}
    header = {**header, "v": PROTOCOL_VERSION, "arrays": list(arrays)}
    frames = [b"", json.dumps(header, separators=(",", ":")).encode("utf-8")]
    for values in arrays.values():
        frames.append(np.ascontiguousarray(values, dtype=_INT64).tobytes())
    return frames


def decode(frames: Sequence[bytes]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of ``encode`` (frames after the empty delimiter). Raises ValueError naming what
    is malformed."""
    if not frames:
        raise ValueError("message: expected a JSON header frame, got no frames")
    try:
        header = json.loads(bytes(frames[0]).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"message header: expected UTF-8 JSON ({e})") from e
    if not isinstance(header, dict):
        raise ValueError(f"message header: expected a JSON object, got {type(header).__name__}")
    if header.get("v") != PROTOCOL_VERSION:
        raise ValueError(f"message header 'v': expected {PROTOCOL_VERSION}, got {header.get('v')!r}")
    names = header.get("arrays", [])
    if not isinstance(names, list) or len(names) != len(frames) - 1:
        raise ValueError(f"message 'arrays': names {names!r} but {len(frames) - 1} array frames")
    arrays: dict[str, np.ndarray] = {}
    for name, frame in zip(names, frames[1:]):
        data = bytes(frame)
        if len(data) % _INT64.itemsize:
            raise ValueError(f"message array {name!r}: {len(data)} bytes is not a whole number of int64")
        arrays[str(name)] = np.frombuffer(data, dtype=_INT64)
    return header, arrays


def default_endpoint(name: str) -> str:
    """A fresh ``ipc://`` endpoint named ``name`` in a new private (0700) temporary directory."""
    return f"ipc://{os.path.join(tempfile.mkdtemp(prefix='kvlifecycle-'), name)}"


def prepare_ipc_dir(endpoint: str) -> None:
    """Create the directory of an ``ipc://`` endpoint with mode 0700, or check that an existing
    one belongs to this user and nobody else can enter it: its sockets take commands without
    authentication. Raises ValueError for another scheme, PermissionError naming the fix."""
    if not endpoint.startswith("ipc://"):
        raise ValueError(f"endpoint: expected ipc://PATH, got {endpoint!r}")
    directory = os.path.dirname(os.path.abspath(endpoint[len("ipc://"):]))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.stat(directory)
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid != os.getuid() or mode & 0o077:
        raise PermissionError(
            f"endpoint directory {directory}: expected owner uid {os.getuid()} and mode 0700, got uid "
            f"{st.st_uid} mode {mode:o}; the sockets need a private directory (chmod 700 {directory})")


Handler = Callable[[dict[str, Any], dict[str, np.ndarray]], dict[str, Any]]


def answer(frames: Sequence[bytes], handle: Handler) -> tuple[list[bytes], RpcStatus]:
    """The reply frames (peer identity first) to one request ``[identity, b"", header, arrays...]``
    received on a ROUTER socket, and the reply's status. See the module docstring."""
    identity = bytes(frames[0]) if frames else b""
    header: dict[str, Any] = {}
    try:
        if len(frames) < 3 or frames[1] != b"":
            raise ValueError("message: expected [identity, b'', header, arrays...]")
        header, arrays = decode(frames[2:])
        body = {**handle(header, arrays), "rpc": RpcStatus.OK.value}
    except RpcError as e:
        body = {"rpc": e.status.value, "error": e.message}
    except (ValueError, KeyError, TypeError) as e:
        # A malformed request, or a handler's bug of the same type: the traceback tells them apart.
        logger.warning("rpc: request %r refused as bad: %s", header.get("op"), e, exc_info=True)
        body = {"rpc": RpcStatus.BAD_REQUEST.value, "error": f"{type(e).__name__}: {e}"}
    except Exception as e:
        logger.error("rpc: request %r failed", header.get("op"), exc_info=True)
        body = {"rpc": RpcStatus.ERROR.value, "error": f"{type(e).__name__}: {e}"}
    body["seq"] = header.get("seq")
    return [identity, *encode(body)], RpcStatus(body["rpc"])


class RpcClient:
    """One DEALER socket to a ROUTER server. Not thread-safe: its owner serializes calls."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.counters = collections.Counter[str]()  # bad_replies, stale_replies
        self._ctx = zmq.Context()
        self._sock: zmq.Socket | None = None
        self._seq = 0

    def call(self, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None,
             timeout_s: float = TIMEOUTS.control_s) -> tuple[dict[str, Any], dict[str, np.ndarray]] | None:
        """Send ``header`` (``seq`` is set here) and ``arrays``; the reply, or None when none came
        within ``timeout_s`` (the socket is dropped)."""
        self._seq += 1
        seq = self._seq
        deadline = time.monotonic() + timeout_s
        sock = self._socket()
        if not sock.poll(_ms_left(deadline), zmq.POLLOUT):
            self._drop_socket()
            return None
        try:
            sock.send_multipart(encode({**header, "seq": seq}, arrays), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop_socket()
            return None
        while True:
            if not sock.poll(_ms_left(deadline), zmq.POLLIN):
                self._drop_socket()
                return None
            raw = sock.recv_multipart()
            try:
                reply = decode(raw[1:] if raw and raw[0] == b"" else raw)
            except ValueError:
                logger.error("rpc %s: malformed reply dropped", self.endpoint, exc_info=True)
                self.counters["bad_replies"] += 1
                continue
            if reply[0].get("seq") == seq:
                return reply
            self.counters["stale_replies"] += 1

    def close(self) -> None:
        self._drop_socket()
        self._ctx.term()

    # -- helpers ------------------------------------------------------------------------

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing until the server is connected
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.connect(self.endpoint)
            self._sock = sock
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None


def _ms_left(deadline: float) -> int:
    return max(0, int((deadline - time.monotonic()) * 1000))
