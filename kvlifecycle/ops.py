"""torch custom ops (``torch.ops.kvlifecycle.*``): the KV-cache lifecycle of a batch of users, as
the serving path calls it (kv_lookup_alloc and kv_offload) and as a graph can trace it.

Why a registry: custom ops take only tensors and scalars, so an op cannot receive the
``KVCacheManager`` object. Each process registers its manager (and, where it offloads, the
``OffloadWorker`` that puts the pages) once with ``register(...) -> handle`` and passes the int
``handle`` to the ops; ``_REGISTRY`` below is the one place that maps handles to objects.
Handles are process-local: never send one to another process.

Ops, in call order. A batch of ``B`` users is ``user_ids [B]``, the users' token ids
concatenated ``tokens [T]`` and ``offsets [B+1]`` (user ``b``'s tokens are
``tokens[offsets[b]:offsets[b+1]]``); every tensor is int64 on CPU::

    hits = lookup(handle, user_ids, tokens, offsets)                      -> [B, 2]
        device_tokens (committed pages on the device), host_tokens (the full pages after them:
        candidates for the host store, asked at the onboard's launch; 0 without a store)
    leases, page_rows = allocate(handle, user_ids, tokens, offsets, hits, ttl_s)
        -> [B, 3] lease_id (-1: the pool cannot hold the request now), cached_len, onboard_pages
           [B, max_pages] each lease's page row, -1 past its end
    leases = onboard_launch(handle, leases)                               -> [B, 3]
        the same columns once each onboard has started (the store is asked on the owner's control
        thread); onboard_pages > 0: those pages are being copied, not settled yet; lease_id -1:
        the lease ended meanwhile
    ... compute ...
    done = offload_launch(handle, lease_ids [B], tokens, offsets)         -> [B]
        commits each lease and has the registered ``OffloadWorker`` put the pages the commit
        pinned, off the caller's path: the worker announces the batch's commit to the owner
        without a round trip (``kvlifecycle.commit_channel``; a round trip where it cannot), and
        the owner applies it before its next lookup. In the owner itself (no worker) the manager
        commits at once. Per lease, the pages pinned to put; -1 when the commit was announced
        (the owner tells the worker)

Each op is one ``*_many`` call of the manager for the whole batch: the same table lock, store
round trip and control round trip per batch as direct calls. What the tensors cannot carry
(a lookup's page keys, a lease's namespace) the manager keeps: ``allocate`` takes the keys from
``PrefixKeys``, which the lookup just filled (no page is hashed twice), and the lease keeps its
namespace.

Every op has a fake (meta) implementation, so ``torch.export`` traces graphs that call them.
The ops have side effects but are declared functional (their schemas mutate nothing): a traced graph
must use each op's output (as the call order above does) so that it is neither dropped nor
reordered.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvlifecycle.leases import Lease
from kvlifecycle.manager import LookupResult

logger = logging.getLogger(__name__)

__all__ = ["Registered", "join_tokens", "register", "unregister", "registered", "split_tokens"]


@dataclass(frozen=True)
class Registered:
    manager: Any  # KVCacheManager in the owner, a ControlClient to it elsewhere (offload_launch only)
    offloader: Any = None  # OffloadWorker: launch(lease_ids, token_ids); None: nothing is put


_REGISTRY: dict[int, Registered] = {}
_REGISTRY_LOCK = threading.Lock()
_HANDLES = itertools.count(1)


def register(manager: Any, offloader: Any = None) -> int:
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


def join_tokens(per_user: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The users' tokens as the ops take them: concatenated ``[T]`` and ``offsets [B+1]``."""
    tokens = torch.cat(per_user) if per_user else torch.empty(0, dtype=torch.int64)
    offsets = torch.tensor([0] + [t.numel() for t in per_user], dtype=torch.int64).cumsum(0)
    return tokens, offsets


def split_tokens(tokens: torch.Tensor, offsets: torch.Tensor) -> list[torch.Tensor]:
    """User ``b``'s tokens, ``tokens[offsets[b]:offsets[b+1]]``, for each user (``join_tokens``'s inverse)."""
    bounds = offsets.tolist()
    return [tokens[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]


def _split_arrays(tokens: torch.Tensor, offsets: torch.Tensor) -> list[np.ndarray]:
    """``split_tokens`` as numpy views (what the manager keys and keeps; a numpy slice costs a
    fraction of a tensor slice)."""
    array, bounds = tokens.numpy(), offsets.tolist()
    return [array[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]


# The ops are defined on a torch.library.Library, their kernels registered for every backend
# (CompositeExplicitAutograd) and their fakes with register_fake. torch.library.custom_op would do
# the same behind an autograd wrapper, a dynamo guard and an alias check on every call: about 7 us
# a call against 2.4 for a trivial op on the CPU machine, and 4-6% of kv_lookup_alloc's main
# thread at c=32 (py-spy). The schemas declare no mutation, as custom_op's mutates_args=() did.
_LIBRARY = torch.library.Library("kvlifecycle", "DEF")  # lives as long as the process: the ops with it
for _schema in (
    "lookup(int handle, Tensor user_ids, Tensor tokens, Tensor offsets) -> Tensor",
    "allocate(int handle, Tensor user_ids, Tensor tokens, Tensor offsets, Tensor hits, float ttl_s) -> (Tensor, Tensor)",
    "onboard_launch(int handle, Tensor leases) -> Tensor",
    "offload_launch(int handle, Tensor lease_ids, Tensor tokens, Tensor offsets) -> Tensor",
):
    _LIBRARY.define(_schema)


def _op(kernel):
    """Register ``kernel`` as the op of its name, for every backend; the function stays callable."""
    _LIBRARY.impl(kernel.__name__, kernel, "CompositeExplicitAutograd")
    return kernel


@_op
def lookup(handle: int, user_ids: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    mgr = registered(handle).manager
    hits = mgr.lookup_many(list(zip(user_ids.tolist(), _split_arrays(tokens, offsets))))
    return torch.tensor([[hit.device_tokens, hit.host_tokens] for hit in hits], dtype=torch.int64).reshape(-1, 2)


@_op
def allocate(handle: int, user_ids: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor,
             hits: torch.Tensor, ttl_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    mgr = registered(handle).manager
    results = []
    for user_id, array, (device_tokens, host_tokens) in zip(user_ids.tolist(), _split_arrays(tokens, offsets),
                                                            hits.tolist()):
        results.append(LookupResult(
            user_id=user_id, namespace=mgr.namespace, tokens=array,
            keys=mgr.keys.keys(user_id, array, mgr.namespace),  # PrefixKeys: the lookup's keys, not hashed again
            device_tokens=device_tokens, host_tokens=host_tokens,
            device_pages=(), host_unconfirmed=host_tokens > 0))
    return _lease_tensors(mgr.allocate_many(results, ttl_s=ttl_s), copying_only=False)


@_op
def onboard_launch(handle: int, leases: torch.Tensor) -> torch.Tensor:
    mgr = registered(handle).manager
    lease_ids = leases[:, 0].tolist()
    started = mgr.onboard_start_many([mgr.leases.get_lease(i) if i >= 0 else None for i in lease_ids])
    return _lease_tensors(started, copying_only=True)[0]


@_op
def offload_launch(handle: int, lease_ids: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    entry = registered(handle)
    ids = lease_ids.tolist()
    if entry.offloader is not None:  # it commits (announced, or a round trip) and puts
        pages = entry.offloader.launch(ids, [user_tokens.clone() for user_tokens in split_tokens(tokens, offsets)])
        return torch.tensor([-1] * len(ids) if pages is None else pages, dtype=torch.int64)
    committed = entry.manager.commit_many(ids)
    for c in committed:  # nothing puts them: unpin now
        if c.items:
            entry.manager.offload_done([it.page_id for it in c.items], False)
    return torch.tensor([len(c.items) for c in committed], dtype=torch.int64)


# ---------------------------------------------------------------------------------------
# fake implementations (shapes only) for torch.export / FakeTensor tracing


@torch.library.register_fake("kvlifecycle::lookup")
def _lookup_fake(handle: int, user_ids: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return user_ids.new_empty((user_ids.shape[0], 2))


@torch.library.register_fake("kvlifecycle::allocate")
def _allocate_fake(handle: int, user_ids: torch.Tensor, tokens: torch.Tensor, offsets: torch.Tensor,
                   hits: torch.Tensor, ttl_s: float) -> tuple[torch.Tensor, torch.Tensor]:
    max_pages = torch.library.get_ctx().new_dynamic_size()  # the longest row: data-dependent
    return user_ids.new_empty((user_ids.shape[0], 3)), user_ids.new_empty((user_ids.shape[0], max_pages))


@torch.library.register_fake("kvlifecycle::onboard_launch")
def _onboard_launch_fake(handle: int, leases: torch.Tensor) -> torch.Tensor:
    return leases.new_empty(leases.shape)


@torch.library.register_fake("kvlifecycle::offload_launch")
def _offload_launch_fake(handle: int, lease_ids: torch.Tensor, tokens: torch.Tensor,
                         offsets: torch.Tensor) -> torch.Tensor:
    return lease_ids.new_empty(lease_ids.shape)


# ---------------------------------------------------------------------------------------
# helpers


def _lease_tensors(leases: list, copying_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, 3]`` (lease_id, cached_len, onboard pages: reserved, or with ``copying_only`` those
    still being copied) and ``[B, max_pages]`` page rows (-1 past each row) of a batch's leases;
    a request without a lease (``PoolExhausted``, ``LeaseGone``, None) is lease_id -1. Filled as
    numpy arrays: a torch op per row costs more than the whole row's copy."""
    meta = np.full((len(leases), 3), -1, dtype=np.int64)
    rows = [lease.page_row if isinstance(lease, Lease) else () for lease in leases]
    page_rows = np.full((len(leases), max(map(len, rows), default=0)), -1, dtype=np.int64)
    for b, (lease, row) in enumerate(zip(leases, rows)):
        if isinstance(lease, Lease):
            meta[b] = (lease.lease_id, lease.cached_len,
                       lease.num_onboard_pages if lease.onboarding or lease.onboard_by_reader or not copying_only
                       else 0)
            page_rows[b, :len(row)] = row
    return torch.from_numpy(meta), torch.from_numpy(page_rows)
