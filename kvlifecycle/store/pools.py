"""The device page pools a store server has attached, and the one backing they share.

Several processes may own page pools (the ensemble's ``kv_lookup_alloc`` and the baseline
``hstu_monolithic``, each its own pool). ``attach(handle)`` maps the pool a
``PagePool.handle()`` describes (or finds it attached) under ``protocol.pool_id(handle)``;
every put/get names the pool it copies to/from, and ``get(pool_id)`` finds it.

Pages are keyed by content, so all pools share one backing, which holds pages of one geometry
(layers, page size, heads, head dim, dtype; the number of pages may differ). Attaching a pool
of another geometry is refused (ValueError naming both) while a pool of the current geometry is
attached; once none is, the next attach closes the old backing and makes a fresh one.

Detaching: ``detach_closed()`` forgets shared-memory pools whose creator unlinked the file
(``PagePool.close``). CUDA pools stay attached until the server exits (their owner's exit
cannot be observed from here).

Threads: ``attach`` and ``detach_closed`` run on the server's socket thread only; ``get`` and
``stats`` from any thread.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any

from kvlifecycle.pool import PagePool
from kvlifecycle.store.backing import Backing, BackingFactory
from kvlifecycle.store.protocol import pool_id
from kvlifecycle.store.transfer import PageCopier, host_page_shape

logger = logging.getLogger(__name__)

__all__ = ["AttachedPool", "PoolRegistry"]

Geometry = tuple[tuple[int, ...], str]  # (host page shape [L, 2, S, H, D], dtype name)


@dataclass
class AttachedPool:
    """One attached device page pool; its copier is used by the copy thread only."""

    pool_id: str
    pool: PagePool
    copier: PageCopier
    backing: Backing
    shm_path: str | None  # creator's file, for shm pools: gone means the pool is closed
    counters: collections.Counter[str] = field(default_factory=collections.Counter)  # task outcomes


class PoolRegistry:
    """See the module docstring."""

    def __init__(self, make_backing: BackingFactory) -> None:
        self._make_backing = make_backing
        self._lock = threading.Lock()  # guards _pools for readers on other threads
        self._pools: dict[str, AttachedPool] = {}
        self._backing: Backing | None = None
        self._geometry: Geometry | None = None

    # -- public API ---------------------------------------------------------------------

    @property
    def backing(self) -> Backing | None:
        """The backing of the attached pools' geometry; None before the first attach."""
        return self._backing

    @property
    def page_size(self) -> int | None:
        return None if self._geometry is None else self._geometry[0][2]

    def attach(self, handle: dict[str, Any]) -> str:
        """Attach the pool ``handle`` describes, or find it attached; returns its pool id.
        Raises ValueError for a page geometry other than the attached pools'."""
        key = pool_id(handle)
        if key in self._pools:
            return key
        pool = PagePool.attach(handle)
        geometry = (host_page_shape(pool.spec.shape), pool.spec.dtype)
        if self._geometry is not None and self._geometry != geometry and self._pools:
            pool.close()
            raise ValueError(
                f"register_pool: the store holds pages of geometry {_describe(self._geometry)} for "
                f"{len(self._pools)} attached pool(s); got a pool of {_describe(geometry)}. Pools of "
                "another geometry need their own store server (or this one restarted)")
        if self._geometry != geometry:
            old = self._backing
            self._backing = self._make_backing(geometry[0], pool.spec.torch_dtype, pool.tensor.is_cuda)
            self._geometry = geometry
            if old is not None:
                old.close()
        attached = AttachedPool(pool_id=key, pool=pool, copier=PageCopier(pool.tensor), backing=self._backing,
                                shm_path=handle.get("path") if handle.get("kind") == "shm" else None)
        with self._lock:
            self._pools[key] = attached
        logger.info("attached page pool %s as %s (%d pools attached)", pool.spec, key, len(self._pools))
        return key

    def get(self, key: str) -> AttachedPool | None:
        with self._lock:
            return self._pools.get(key)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pools)

    def detach_closed(self) -> None:
        """Forget shm pools whose creator unlinked the file. Queued tasks keep their
        ``AttachedPool`` (its copier holds the mapping), so the memory is unmapped when the
        last one is done."""
        with self._lock:
            gone = [p for p in self._pools.values() if p.shm_path is not None and not os.path.exists(p.shm_path)]
            for attached in gone:
                del self._pools[attached.pool_id]
        for attached in gone:
            logger.info("detached page pool %s (its file %s is gone; %d pools attached)",
                        attached.pool_id, attached.shm_path, len(self))

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {key: {"num_pages": p.pool.spec.num_pages, **p.counters} for key, p in self._pools.items()}

    def close(self) -> None:
        """Close the backing (flushes what it writes behind); after the copy thread stopped."""
        if self._backing is not None:
            self._backing.close()
            self._backing = None


def _describe(geometry: Geometry) -> str:
    (num_layers, _two, page_size, num_heads, head_dim), dtype = geometry
    return (f"(num_layers={num_layers}, page_size={page_size}, num_heads={num_heads}, "
            f"head_dim={head_dim}, dtype={dtype})")
