"""Wire format between the embedded store client (DEALER) and server (ROUTER). No pickle.

A message is a list of zmq frames::

    [b"", header, array_0, array_1, ...]     (the ROUTER adds/strips the peer identity)

``header`` is UTF-8 JSON. Arrays are raw little-endian int64 bytes; the header's ``arrays``
field names them in frame order. Every reply header carries ``seq`` (echoing the request)
and ``rpc`` (an ``RpcStatus`` value).

Requests (``op``; fields besides ``v``, ``seq``, ``client``):
- ``ping``                                       -> {}
- ``stats``                                      -> {"stats": {...}}
- ``register_pool`` handle                       -> {}
- ``match`` ns, page_size; arrays tokens         -> {"pages": k}
- ``put``/``get`` task, ns, page_size;
  arrays tokens, seq_pages, pool_pages           -> {} (accepted; poll for the outcome)
- ``poll`` tasks                                 -> {"tasks": {"<id>": "<Status>"}} (done ones are forgotten)
- ``cancel`` tasks                               -> {}
"""

from __future__ import annotations

import enum
import json
from typing import Any, Sequence

import numpy as np

__all__ = ["PROTOCOL_VERSION", "Op", "RpcStatus", "encode", "decode"]

PROTOCOL_VERSION = 1
_INT64 = np.dtype("<i8")


class Op(str, enum.Enum):
    PING = "ping"
    STATS = "stats"
    REGISTER_POOL = "register_pool"
    MATCH = "match"
    PUT = "put"
    GET = "get"
    POLL = "poll"
    CANCEL = "cancel"


class RpcStatus(str, enum.Enum):
    """Outcome of one RPC (a task's outcome is a ``Status``, reported by ``poll``)."""

    OK = "ok"
    BAD_REQUEST = "bad_request"  # malformed or inconsistent request; ``error`` says which field
    NO_POOL = "no_pool"          # a transfer arrived before any page pool was registered
    BUSY = "busy"                # the server is stopping and takes no new tasks
    ERROR = "error"              # the server failed; ``error`` says why


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
