"""The host store's requests and replies over ``kvlifecycle.rpc`` (frames, header, ``RpcStatus``).

Requests (``op``; fields besides ``v``, ``seq``, ``client``):
- ``ping``                                       -> {}
- ``stats``                                      -> {"stats": {...}}
- ``register_pool`` handle                       -> {"pool": pool id, "slab": handle or null}
                                                    (attached, or already was; "slab": the shared
                                                    DRAM slab readers map, ``slab.SharedSlab``)
- ``locate`` pin_s, page_size; arrays keys
  (int64 [n, 2]: 16-byte page keys), offsets
  (int64 [r + 1]: request i's keys are
  keys[offsets[i]:offsets[i + 1]])               -> {"slab": handle, "rows": [[row, ...], ...],
                                                    "versions": [[v, ...], ...]}: per request, the
                                                    slab rows of its held prefix, pinned for pin_s,
                                                    and their versions (UNSUPPORTED: no shared slab)
- ``put``/``get`` task, ns, page_size, pool,
  accept_by, start_by; arrays tokens,
  seq_pages, pool_pages                          -> {} (accepted; poll for the outcome)
- ``get_prefix`` as ``get``; seq_pages are
  candidates (every full page from the first
  one asked)                                     -> {"pages": k, "copying": bool}: k is the held
                                                    prefix; the task copies the candidates below k
                                                    (no task when "copying" is false)
- ``poll`` tasks [, wait_s]                      -> {"tasks": {"<id>": "<Status>"}} (done ones are forgotten);
                                                    with wait_s > 0 the reply waits until one task
                                                    is done or wait_s passed (FlexKV's store
                                                    answers at once)
- ``cancel`` tasks                               -> {}

``pool`` names the device page pool the task copies to/from: ``pool_id(handle)`` of a handle
the server attached (``register_pool``). An unknown pool id, or none, is answered ``NO_POOL``;
the client then sends ``register_pool`` and retries once.
"""

from __future__ import annotations

import enum
import hashlib
import json
from typing import Any

import numpy as np

__all__ = ["Op", "MAX_PIN_S", "check_task_pages", "keys_from_words", "keys_to_words", "pool_id"]

MAX_PIN_S = 60.0  # the longest a locate may pin its rows


def keys_to_words(keys: list[bytes]) -> np.ndarray:
    """16-byte page keys as int64 [n, 2] (RPC arrays and compute plans carry int64 words)."""
    if not keys:
        return np.zeros((0, 2), dtype=np.int64)
    return np.frombuffer(b"".join(keys), dtype="<i8").reshape(-1, 2).copy()  # writable: torch.from_numpy takes it


def keys_from_words(words: np.ndarray) -> list[bytes]:
    data = np.ascontiguousarray(words, dtype="<i8").tobytes()
    return [data[i:i + 16] for i in range(0, len(data), 16)]


class Op(str, enum.Enum):
    PING = "ping"
    STATS = "stats"
    REGISTER_POOL = "register_pool"
    PUT = "put"
    GET = "get"
    GET_PREFIX = "get_prefix"  # match + get in one round trip (HostStoreClient.get_prefix_async)
    POLL = "poll"
    CANCEL = "cancel"
    LOCATE = "locate"  # where held pages sit in the shared slab, for a reader that copies them itself


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


def check_task_pages(num_tokens: int, seq_pages: np.ndarray, pool_pages: np.ndarray, page_size: int,
                     num_pool_pages: int) -> None:
    """A put/get's page arrays, as every store server checks them: one pool page per sequence
    page, sequence pages among the request's full pages, pool pages inside the pool. Raises
    ValueError naming the field (the server answers BAD_REQUEST)."""
    if seq_pages.shape != pool_pages.shape:
        raise ValueError("seq_pages/pool_pages: expected the same length")
    num_full = num_tokens // page_size
    if seq_pages.size and (seq_pages.min() < 0 or seq_pages.max() >= num_full):
        raise ValueError(f"seq_pages: expected page indices in [0, {num_full})")
    if pool_pages.size and (pool_pages.min() < 0 or pool_pages.max() >= num_pool_pages):
        raise ValueError(f"pool_pages: expected pool page ids in [0, {num_pool_pages})")
