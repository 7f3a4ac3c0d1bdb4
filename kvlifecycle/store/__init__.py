"""The host KV store: pages of the device pool kept in host memory (and on disk), keyed by
the page hash chain, behind an API shaped like FlexKV's ``KVManager``.

Operations, in the order they are called (``store = open_store(kind, **cfg)``):

0. ``store.register_pool(pool.handle())`` once per process that owns or attaches the pool,
   so the store knows which memory this client's slots refer to (sent again by the client
   when a restarted store asks for it). Equivalently pass ``pool_handle=`` to ``open_store``:
   the client registers on first need. Several pools (owners) may share one store; each
   client's transfers go to its own pool, and stored pages (keyed by content) are shared.
1. Lookup and onboard (store -> pool) in one RPC: ``task_id, held =
   store.get_prefix_async(token_ids, slot_mapping, namespace, first_page)``. ``held`` is the
   longest prefix of whole pages of ``token_ids`` the store holds (keys:
   ``kvlifecycle.hashing.page_keys(token_ids, namespace, page_size)``); the task copies the
   pages from ``first_page`` on that lie in it (``task_id`` None when there are none). Never
   blocks longer than the RPC timeout; ``(None, 0)`` when the store is down (fail open,
   invariant 6).
2. Onboard of chosen pages: ``task_id = store.get_async(token_ids, slot_mapping, namespace,
   token_mask)`` copies any whole pages the store holds (NOTFOUND if one is missing).
3. Offload (pool -> store): ``task_id = store.put_async(token_ids, slot_mapping, namespace,
   token_mask=None)`` copies the selected whole pages' KV (all layers, K and V). The pool
   pages must stay untouched until the task is done.
4. Completion: ``store.wait(task_ids, timeout_s) -> {task_id: Status}`` or the non-blocking
   ``store.try_wait(task_ids)``; a done status is returned once, then the task is forgotten.
   ``store.cancel(task_ids)`` cancels tasks whose copy has not started.
5. ``store.stats()`` (counters, errors), ``store.close()``.

Statuses (``Status``): SUCCESS, NOTFOUND (a get found a page missing; nothing copied: recompute),
UNREADY (``try_wait``: in flight), TIMEOUT (``wait``'s deadline passed; still in flight),
CANCELLED, FAILED (store down, task lost, or copy failed; pool pages are free to reuse).

Ordering guarantee (every backend): one client's tasks are copied in submission order, so a get
after a put of the same pages by the same client sees the put; tasks of different clients are
not ordered. A task is SUCCESS only when its last byte is in place.

Backends (``open_store(kind, **cfg)``):
- ``embedded`` (default): our store server process (``python -m kvlifecycle.store``, see
  ``server.py``) over pyzmq; it attaches the pool and copies pages itself into its backing,
  shared by every attached pool of one page geometry (another geometry is refused). The local
  backing: a DRAM tier (LRU, byte capacity) and optional disk tier (write-behind, checksummed,
  survives restarts).
  cfg: ``endpoint``, ``page_size``, ``rpc_timeout_s``, ``retry_interval_s``,
  ``task_start_timeout_s``, ``pool_handle`` (the pool this client's slots refer to; a process
  that only offloads another process's pool passes that owner's published handle).
- ``mooncake``: the same client and store process, the process started with ``--backing
  mooncake``: pages are objects in Mooncake Store (``mooncake.py``). The Mooncake client lives
  in the store process only, so a dead Mooncake master costs the caller a store timeout, never
  a stall. cfg: as ``embedded``.
- ``flexkv``: FlexKV (built with ``deploy/build_flexkv.sh``; CUDA pools only) in a store process
  of its own (``python -m kvlifecycle.store.flexkv``), reached with the embedded protocol; the
  owner also registers its pool's memory with FlexKV's transfer engine (``flexkv_client.py``).
  cfg: as ``embedded``, plus ``owned_pool`` (the ``PagePool`` this process allocated).
- ``none``: no host tier and no client: the caller serves from the device cache alone
  (``KVCacheManager(store=None)``).
"""

from __future__ import annotations

import logging
from typing import Any

from kvlifecycle.store.api import HostStoreClient, Status

logger = logging.getLogger(__name__)

__all__ = ["Status", "HostStoreClient", "open_store", "STORE_KINDS"]

STORE_KINDS = ("embedded", "mooncake", "flexkv", "none")


def open_store(kind: str = "embedded", **cfg: Any) -> HostStoreClient:
    """A client of the host store backend ``kind`` (one of ``STORE_KINDS``); ``cfg`` goes to
    that backend's client (see the module docstring)."""
    if kind in ("embedded", "mooncake"):  # one protocol; the store process's backing differs
        from kvlifecycle.store.embedded import StoreProcessClient
        return StoreProcessClient(**cfg)
    if kind == "flexkv":
        from kvlifecycle.store.flexkv_client import FlexKVStoreClient
        return FlexKVStoreClient(**cfg)
    if kind == "none":
        raise ValueError("open_store kind 'none' has no client: serve without one (store=None)")
    raise ValueError(f"open_store kind: expected one of {STORE_KINDS}, got {kind!r}")
