"""torch custom ops (``torch.ops.kvlifecycle.*``) over a process-local KV-cache manager.

Why a registry: custom ops take only tensors and scalars, so an op cannot receive the
``KVCacheManager`` object. Each process registers its manager (and, where it offloads, an
``Offloader``) once with ``register(...) -> handle`` and passes the int ``handle`` to the ops;
``_REGISTRY`` below is the one place that maps handles to objects. Handles are process-local:
never send one to another process.

Ops, in call order (shapes; ``n`` tokens, ``S`` page size; every tensor is int64 on CPU)::

    hit  = lookup(handle, user_id[1], token_ids[n])                  -> [2] device_tokens, host_tokens
    meta, page_row = allocate(handle, user_id[1], token_ids[n], hit[2], S, ttl_s)
                                                                      -> [3] lease_id, cached_len, onboard_pages
                                                                         [ceil(n / S)] page ids
    task = onboard_launch(handle, meta[3])                            -> [1] store task id, -1 if none
    meta = onboard_wait(handle, meta[3], task[1], timeout_s)          -> [3] cached_len may shrink
    ... compute ...
    pages = offload_launch(handle, meta[3], token_ids[n])             -> [1] pages whose put was launched
    reaped = offload_reap(handle, timeout_s)                          -> [1] puts reaped (0 s: no blocking)

``offload_launch`` commits the lease (through the registered manager: a ``KVCacheManager`` in
the owner, a ``ControlClient`` elsewhere) and submits the put through the registered
``Offloader``; without one the pages are reported not offloaded at once. ``allocate`` raises
``PoolExhausted`` like ``KVCacheManager.allocate``.

The ops are the single-request lifecycle as a traceable graph; the Triton models do not use
them (kv_lookup_alloc serves whole batches through ``KVCacheManager.*_many``). A lookup's keys
cannot cross an op boundary (tensors only), so ``allocate`` hashes the chain again here.

Every op has a fake (meta) implementation, so ``torch.export`` traces graphs that call them.
The ops have side effects but are declared functional (``mutates_args=()``): a traced graph
must use each op's output (as the call order above does) so that it is neither dropped nor
reordered.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from kvlifecycle.manager import LookupResult
from kvlifecycle.offload_worker import Offloader
from kvlifecycle.hashing import page_keys, tokens_as_int64

logger = logging.getLogger(__name__)

__all__ = ["Registered", "register", "unregister", "registered"]


@dataclass(frozen=True)
class Registered:
    manager: Any  # KVCacheManager, or anything with commit/offload_done (ControlClient)
    offloader: Offloader | None = None


_REGISTRY: dict[int, Registered] = {}
_REGISTRY_LOCK = threading.Lock()
_HANDLES = itertools.count(1)


def register(manager: Any, offloader: Offloader | None = None) -> int:
    """Make ``manager`` (and ``offloader``) reachable from the ops by the returned handle."""
    with _REGISTRY_LOCK:
        handle = next(_HANDLES)
        _REGISTRY[handle] = Registered(manager, offloader)
        return handle


def unregister(handle: int) -> None:
    with _REGISTRY_LOCK:
        _REGISTRY.pop(handle, None)


def registered(handle: int) -> Registered:
    with _REGISTRY_LOCK:
        entry = _REGISTRY.get(handle)
    if entry is None:
        raise KeyError(f"kvlifecycle ops: no manager registered under handle {handle} in this process")
    return entry


@torch.library.custom_op("kvlifecycle::lookup", mutates_args=())
def lookup(handle: int, user_id: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    mgr = registered(handle).manager
    hit = mgr.lookup(int(user_id.reshape(-1)[0]), token_ids)
    return torch.tensor([hit.device_tokens, hit.host_tokens], dtype=torch.int64)


@torch.library.custom_op("kvlifecycle::allocate", mutates_args=())
def allocate(handle: int, user_id: torch.Tensor, token_ids: torch.Tensor, hit: torch.Tensor,
             page_size: int, ttl_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    mgr = registered(handle).manager
    assert page_size == mgr.page_size, (
        f"kvlifecycle::allocate: expected page_size {mgr.page_size} (the manager's), got {page_size}"
    )
    uid = int(user_id.reshape(-1)[0])
    tokens = tokens_as_int64(token_ids)
    device_tokens, host_tokens = (int(v) for v in hit.tolist())
    result = LookupResult(
        user_id=uid,
        namespace=mgr.namespace,
        tokens=tokens,
        keys=tuple(page_keys(tokens, mgr.namespace, page_size)),
        device_tokens=device_tokens,
        host_tokens=host_tokens,
        device_pages=(),
    )
    alloc = mgr.allocate(uid, tokens, result, ttl_s=ttl_s)
    meta = torch.tensor([alloc.lease_id, alloc.cached_len, alloc.num_onboard_pages], dtype=torch.int64)
    return meta, torch.tensor(alloc.page_row, dtype=torch.int64)


@torch.library.custom_op("kvlifecycle::onboard_launch", mutates_args=())
def onboard_launch(handle: int, meta: torch.Tensor) -> torch.Tensor:
    mgr = registered(handle).manager
    task = mgr.onboard_launch(int(meta[0]))
    return torch.tensor([-1 if task is None else int(task)], dtype=torch.int64)


@torch.library.custom_op("kvlifecycle::onboard_wait", mutates_args=())
def onboard_wait(handle: int, meta: torch.Tensor, task: torch.Tensor, timeout_s: float) -> torch.Tensor:
    mgr = registered(handle).manager
    task_id = int(task[0])
    alloc = mgr.onboard_wait(int(meta[0]), None if task_id < 0 else task_id, timeout_s)
    return torch.tensor([alloc.lease_id, alloc.cached_len, alloc.num_onboard_pages], dtype=torch.int64)


@torch.library.custom_op("kvlifecycle::offload_launch", mutates_args=())
def offload_launch(handle: int, meta: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    entry = registered(handle)
    committed = entry.manager.commit_many([int(meta[0])])[0]
    if committed.items and entry.offloader is None:
        entry.manager.offload_done([it.page_id for it in committed.items], False)
    elif committed.items:
        entry.offloader.launch(committed.namespace, token_ids, committed.items)
    return torch.tensor([len(committed.items)], dtype=torch.int64)


@torch.library.custom_op("kvlifecycle::offload_reap", mutates_args=())
def offload_reap(handle: int, timeout_s: float) -> torch.Tensor:
    offloader = registered(handle).offloader
    if offloader is None:
        return torch.zeros(1, dtype=torch.int64)
    reaped = offloader.reap() if timeout_s <= 0 else offloader.flush(timeout_s)
    return torch.tensor([reaped], dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# fake implementations (shapes only) for torch.export / FakeTensor tracing


@lookup.register_fake
def _lookup_fake(handle: int, user_id: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return token_ids.new_empty((2,), dtype=torch.int64)


@allocate.register_fake
def _allocate_fake(handle: int, user_id: torch.Tensor, token_ids: torch.Tensor, hit: torch.Tensor,
                   page_size: int, ttl_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    num_pages = (token_ids.shape[0] + page_size - 1) // page_size
    return token_ids.new_empty((3,), dtype=torch.int64), token_ids.new_empty((num_pages,), dtype=torch.int64)


@onboard_launch.register_fake
def _onboard_launch_fake(handle: int, meta: torch.Tensor) -> torch.Tensor:
    return meta.new_empty((1,))


@onboard_wait.register_fake
def _onboard_wait_fake(handle: int, meta: torch.Tensor, task: torch.Tensor, timeout_s: float) -> torch.Tensor:
    return meta.new_empty((3,))


@offload_launch.register_fake
def _offload_launch_fake(handle: int, meta: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    return meta.new_empty((1,))


@offload_reap.register_fake
def _offload_reap_fake(handle: int, timeout_s: float) -> torch.Tensor:
    return torch.empty((1,), dtype=torch.int64)
