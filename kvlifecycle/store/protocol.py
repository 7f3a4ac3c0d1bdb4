"""Wire format between the embedded store client (DEALER) and server (ROUTER). No pickle.

A message is a list of zmq frames::

    [b"", header, array_0, array_1, ...]     (the ROUTER adds/strips the peer identity)

``header`` is UTF-8 JSON. Arrays are raw little-endian int64 bytes; the header's ``arrays``
field names them in frame order. Every reply header carries ``seq`` (echoing the request)
and ``rpc`` (an ``RpcStatus`` value).

Requests (``op``; fields besides ``v``, ``seq``, ``client``):
- ``ping``                                       -> {}
- ``stats``                                      -> {"stats": {...}}
- ``register_pool`` handle                       -> {"pool": pool id} (attached, or already was)
- ``match`` ns, page_size; arrays tokens         -> {"pages": k}
- ``put``/``get`` task, ns, page_size, [pool];
  arrays tokens, seq_pages, pool_pages           -> {} (accepted; poll for the outcome)
- ``poll`` tasks                                 -> {"tasks": {"<id>": "<Status>"}} (done ones are forgotten)
- ``cancel`` tasks                               -> {}

``pool`` names the device page pool the task copies to/from: ``pool_id(handle)`` of a handle
the server attached (``register_pool``). Without it the task uses the server's own pool
(``--pool-handle``). An unknown pool id, or none when the server has no pool of its own,
is answered ``NO_POOL``; the client then sends ``register_pool`` and retries once.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any, Sequence

import numpy as np

__all__ = ["PROTOCOL_VERSION", "Op", "RpcStatus", "encode", "decode", "pool_id"]

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
    NO_POOL = "no_pool"          # the transfer's page pool is not attached (register_pool, then retry)
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


# Fields of a CUDA IPC handle that change on every ``PagePool.handle()`` export of one pool.
_PER_EXPORT_IPC_FIELDS = ("ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")


def pool_id(handle: dict[str, Any]) -> str:
    """A stable name (32 hex digits) for the page pool a ``PagePool.handle()`` describes: the
    same for every handle of one pool (the per-export fields of a CUDA IPC handle are left
    out), different for two pools alive at once (a shm handle names its unique file, a CUDA
    handle its IPC memory handle and offsets; a handle carrying a ``uuid`` is named by it).
    Computed the same way by client and server."""
    if isinstance(handle.get("uuid"), str):
        return hashlib.blake2b(handle["uuid"].encode("utf-8"), digest_size=16).hexdigest()
    stable = dict(handle)
    ipc = stable.get("ipc")
    if isinstance(ipc, dict):
        stable["ipc"] = {k: v for k, v in ipc.items() if k not in _PER_EXPORT_IPC_FIELDS}
    text = json.dumps(stable, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()
