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
"""

from __future__ import annotations

import enum
import json
import os
import stat
import tempfile
from typing import Any, Sequence

import numpy as np

__all__ = ["PROTOCOL_VERSION", "RpcStatus", "decode", "default_endpoint", "encode",
           "prepare_ipc_dir"]

PROTOCOL_VERSION = 1
_INT64 = np.dtype("<i8")


class RpcStatus(str, enum.Enum):
    """Outcome of one RPC (a store task's outcome is a ``store.Status``, reported by ``poll``)."""

    OK = "ok"
    BAD_REQUEST = "bad_request"  # malformed or inconsistent request; ``error`` names the field
    NO_POOL = "no_pool"          # store: the transfer's page pool is not attached (register_pool, then retry)
    BUSY = "busy"                # store: stopping, or the request came after its accept deadline
    ERROR = "error"              # the server failed (a bug); ``error`` says where


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
