"""The ``flexkv`` backend's client: the store protocol client to a FlexKV store process
(``python -m kvlifecycle.store.flexkv``; see ``flexkv.py`` for the design and the call order).
The pool's owner also hands its pool's memory to FlexKV's transfer engine from here."""

from __future__ import annotations

import logging
import time
from typing import Any

from kvlifecycle.pool import PagePool
from kvlifecycle.store.embedded import StoreProcessClient
from kvlifecycle.store.flexkv import READY_TIMEOUT_S, gpu_register_endpoint, require_ipc_endpoint
from kvlifecycle.store.protocol import Op, pool_id

logger = logging.getLogger(__name__)

__all__ = ["FlexKVStoreClient"]


class FlexKVStoreClient(StoreProcessClient):
    """The protocol client to a FlexKV store process. ``owned_pool``: the pool this process
    allocated (the owner); ``register_pool`` also hands its memory to the store's FlexKV transfer
    engine, once per store process (a restarted store gets it again on its first ``NO_POOL``).
    Without it (kv_offload) the client only names the owner's pool."""

    def __init__(self, endpoint: str, page_size: int, owned_pool: PagePool | None = None, **kwargs: Any) -> None:
        require_ipc_endpoint(endpoint)
        super().__init__(endpoint, page_size, **kwargs)
        self._owned_pool = owned_pool
        self._registered_memory: set[tuple[str, str]] = set()  # (pool id, store process instance)
        self._tp_clients: list[Any] = []  # FlexKV's KVTPClients: they keep the exported handles alive

    def register_pool(self, handle: dict[str, Any]) -> bool:
        """As the embedded client's; the owner also registers the pool's memory. The first time
        it waits until FlexKV is ready (at model load); after a store restart it does not wait
        (this runs on a request's path): the store answers BUSY until ready, which fails open."""
        if not super().register_pool(handle):
            return False
        if self._owned_pool is None:
            return True
        pool = pool_id(handle)
        reply = self._rpc({"op": Op.PING.value, "pool": pool})
        if reply is None:
            return False
        key = (pool, str(reply.get("instance")))
        if key in self._registered_memory:
            return True
        first = not self._registered_memory
        try:
            self._register_memory(pool)
        except Exception as e:  # a misbuilt FlexKV: say so where the owner fails to load
            raise RuntimeError(f"flexkv: handing pool {pool}'s memory to FlexKV's transfer engine failed in this "
                               f"process ({type(e).__name__}: {e}); FlexKV must import here too: Triton's "
                               f"Python-backend stub ignores PYTHONPATH, so run deploy/build_flexkv.sh with "
                               f"this Python (it installs hstu-flexkv.pth into its site-packages) and "
                               f". .flexkv/env.sh before hstu-serve") from e
        self._registered_memory.add(key)
        return self._wait_ready(pool) if first else True

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "backend": "flexkv"}

    def close(self) -> None:
        for tp_client in self._tp_clients:
            tp_client.send_to_server.close(0)
            tp_client.gpu_control_socket.close(0)
        self._tp_clients.clear()
        super().close()

    def _register_memory(self, pool: str) -> None:
        from flexkv.common.storage import KVCacheLayout, KVCacheLayoutType
        from flexkv.server.client import KVTPClient

        spec = self._owned_pool.spec
        tensor = self._owned_pool.tensor  # [L, P, 2, S, H, D]
        layout = KVCacheLayout(type=KVCacheLayoutType.LAYERBLOCK, num_layer=spec.num_layers,
                               num_block=spec.num_pages, tokens_per_block=spec.page_size,
                               num_head=spec.num_heads, head_size=spec.head_dim, kv_dim=2,
                               num_kv_heads=spec.num_heads)
        client = KVTPClient(gpu_register_endpoint(self.endpoint, pool), dp_client_id=0,
                            device_id=tensor.device.index or 0)
        client.register_to_server([tensor[layer] for layer in range(spec.num_layers)], layout)  # [P, 2, S, H, D] each
        self._tp_clients.append(client)

    def _wait_ready(self, pool: str) -> bool:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            reply = self._rpc({"op": Op.PING.value, "pool": pool})
            if reply is not None and reply.get("ready"):
                return True
            if reply is not None and reply.get("failed"):
                logger.error("flexkv store: pool %s failed to start: %s", pool, reply["failed"])
                return False
            time.sleep(0.1)
        logger.error("flexkv store: pool %s not ready after %.0f s", pool, READY_TIMEOUT_S)
        return False
