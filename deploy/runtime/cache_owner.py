"""Build a process's KV cache from the model config and the serving settings.

The owner of a page pool (kv_lookup_alloc for the ensemble, hstu_monolithic for itself) calls
`open_kv_cache`: it creates the pool with the model's KV geometry, connects the host store
client and registers the pool with it (the store copies pages itself), and builds the
`KVCacheManager`. Processes that only offload (kv_offload) call `open_store_client`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PagePool, PoolSpec
from kvlifecycle.store import HostStoreClient, open_store

from deploy.runtime.settings import ServingSettings

logger = logging.getLogger(__name__)


@dataclass
class OwnedKVCache:
    pool: PagePool
    handle: dict  # the pool's handle, exported once: registered with the store and published as is
    manager: KVCacheManager
    store: HostStoreClient | None

    def stats(self) -> dict[str, float]:
        stats = dict(self.manager.stats())
        if self.store is not None:
            stats["store_errors"] = stats.get("store_errors", 0) + self.store.stats().get("errors", 0)
        return stats

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        self.pool.close()


def pool_spec(config, settings: ServingSettings) -> PoolSpec:
    """The pool geometry the model's KV needs (`config` is a `compute.HSTUConfig`)."""
    return PoolSpec(num_layers=config.num_layers, num_pages=settings.pool_pages, page_size=config.page_size,
                    num_heads=config.num_heads, head_dim=config.head_dim, dtype=config.dtype,
                    device=settings.device)


def open_store_client(settings: ServingSettings, page_size: int,
                      owned_pool: PagePool | None = None) -> HostStoreClient | None:
    """The host store client for `settings.store`, or None for `--store none`.

    Every client names the pool its slots refer to with `register_pool(handle)`: the owner
    registers its own pool, and kv_offload registers the owner's published pool (the store
    process copies from the pool its client named). Every kind but none: the client talks to
    the store process at `settings.store_socket`, whatever backs it."""
    if settings.store == "none":
        return None
    if settings.store == "flexkv":  # the owner also registers its pool's memory with FlexKV's engine
        return open_store("flexkv", endpoint=settings.store_socket, page_size=page_size,
                          rpc_timeout_s=settings.store_timeout_s, owned_pool=owned_pool)
    return open_store(settings.store, endpoint=settings.store_socket, page_size=page_size,
                      rpc_timeout_s=settings.store_timeout_s)


def open_kv_cache(config, settings: ServingSettings, namespace: str, onboard_by_reader: bool = False) -> OwnedKVCache:
    """The owner's pool, store client and manager. A request the pool cannot hold waits up to
    ``pool_wait_s`` for pages still pinned by the previous requests' offloads: a put to a dead
    store holds its pages for one store RPC timeout before it fails and is reaped, so twice that
    (at least 1 s) lets a long request follow another one on a pool the first one filled,
    instead of failing it. ``onboard_by_reader``: the process that computes (hstu_compute) copies
    host hits from the store's shared DRAM tier (`KVCacheManager`'s option of that name)."""
    pool = PagePool.create(pool_spec(config, settings))
    handle = pool.handle()
    store = open_store_client(settings, pool.spec.page_size, owned_pool=pool)
    if store is not None and not store.register_pool(handle):
        logger.warning("host store at %s not reachable; serving from the device cache, registering on reconnect",
                       settings.store_socket)
    manager = KVCacheManager(pool.spec, namespace, store=store, lease_ttl_s=settings.lease_ttl_s,
                             onboard_wait_s=settings.timeouts.onboard_wait_s, min_host_pages=settings.min_host_pages,
                             pool_wait_s=max(1.0, 2 * settings.store_timeout_s), onboard_by_reader=onboard_by_reader)
    return OwnedKVCache(pool, handle, manager, store)
