"""Nothing leaked per request in the owner process: KV lookups against the embedded host store
must not retain memory (found by the soak: kv_lookup_alloc's RSS grows with the request count).
The one thing lookups keep on purpose is each user's last history and keys (`PrefixKeys`, at
most `max_tokens` token ids): the test fills it to its bound first, then measures."""
from __future__ import annotations

import tracemalloc

import numpy as np

from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PagePool, PoolSpec
from kvlifecycle.rpc import default_endpoint
from kvlifecycle.store.embedded import StoreProcessClient
from kvlifecycle.store.processes import start_store_process

LOOKUPS = 2000
TOKENS = 4096  # 32 KiB of int64 per request


def test_store_lookups_retain_no_memory() -> None:
    spec = PoolSpec(num_layers=1, num_pages=16, page_size=32, num_heads=1, head_dim=8)
    pool = PagePool.create(spec)
    store_proc = start_store_process(default_endpoint("store.sock"), dram_bytes=1 << 20)
    store = StoreProcessClient(store_proc.endpoint, page_size=spec.page_size, rpc_timeout_s=10.0)
    try:
        assert store.register_pool(pool.handle())
        manager = KVCacheManager(spec, "leak-test", store=store)
        base = np.arange(1, TOKENS + 1, dtype=np.int64)
        warm_up = manager.keys.max_tokens // TOKENS + 50  # sockets, caches, and PrefixKeys at its bound
        tracemalloc.start()  # before the warm-up: what PrefixKeys drops later is traced too
        for user in range(warm_up):
            manager.lookup(user, base + user)
        before = tracemalloc.get_traced_memory()[0]
        for user in range(warm_up, warm_up + LOOKUPS):
            manager.lookup(user, base + user)  # a fresh token array per request, as a server sees
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert grown < 4 << 20, (f"{LOOKUPS} lookups retained {grown >> 20} MiB "
                                 f"(~{grown // LOOKUPS} bytes per lookup; a request's tokens are {TOKENS * 8})")
    finally:
        store.close()
        store_proc.stop()
        pool.close()
