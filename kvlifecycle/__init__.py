"""The KV-cache lifecycle of HSTU serving, independent of Triton (docs/ARCHITECTURE.md).

- ``kvlifecycle.pool``: the shared device page pool (``PoolSpec``, ``PagePool``).
- ``kvlifecycle.hashing``: the seeded page key chain (``page_keys``).
- ``kvlifecycle.page_table``: page states, refs, LRU, free list, offload pins.
- ``kvlifecycle.leases``: ``LeaseTable`` and ``Lease``, who holds which pages (invariant 3 lives
  here, over the page table).
- ``kvlifecycle.manager``: ``KVCacheManager`` (lookup / allocate / onboard / commit / abort /
  offload_done).
- ``kvlifecycle.offload_worker``: ``Offloader`` (put -> reap) and ``OffloadWorker``.
- ``kvlifecycle.control``: ``ControlServer`` / ``ControlClient`` (pyzmq, JSON).
- ``kvlifecycle.ops``: ``torch.ops.kvlifecycle.*`` custom ops (import to register them).
- ``kvlifecycle.store``: the host store API and its backends.
"""

from kvlifecycle.hashing import page_keys
from kvlifecycle.leases import Lease
from kvlifecycle.manager import KVCacheManager, LookupResult
from kvlifecycle.offload_worker import Offloader
from kvlifecycle.page_table import OffloadItem, PoolExhausted
from kvlifecycle.pool import PagePool, PoolSpec, slots_for_pages

__all__ = [
    "KVCacheManager",
    "Lease",
    "LookupResult",
    "OffloadItem",
    "Offloader",
    "PagePool",
    "PoolExhausted",
    "PoolSpec",
    "page_keys",
    "slots_for_pages",
]
