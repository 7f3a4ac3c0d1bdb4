"""The ``flexkv`` backend: a thin adapter to FlexKV's ``KVManager`` (github.com/taco-project/FlexKV).

FlexKV is not on PyPI; this backend works only where ``import flexkv`` works (built from
source). Its API is the one ours is shaped after, so the adapter maps names and statuses:
``get_match``/``put_async``/``get_async``/``launch``/``wait``/``try_wait``/``cancel`` pass
through; FlexKV's ``KVResponse.status`` maps to ``Status`` by name. FlexKV registers the
device pool through its own ``KVTPClient``; ``register_pool`` hands the attached pool's
tensor to it when the manager exposes ``register_kv_caches``.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np

from kvlifecycle.hashing import TokenIds, tokens_as_int64
from kvlifecycle.pool import PagePool
from kvlifecycle.store.api import DEFAULT_WAIT_TIMEOUT_S, HostStoreClient, Status

logger = logging.getLogger(__name__)

__all__ = ["FlexKVStoreClient", "flexkv_unavailable_reason"]


def flexkv_unavailable_reason() -> str | None:
    """None when ``import flexkv`` works, else why not."""
    try:
        import flexkv  # noqa: F401
    except ImportError as e:
        return f"FlexKV is not installed (not on PyPI; build it from source): {e}"
    return None


class FlexKVStoreClient(HostStoreClient):
    """``HostStoreClient`` over ``flexkv.kvmanager.KVManager``. Ordering guarantee: FlexKV's
    (tasks of one manager complete in launch order per transfer direction)."""

    def __init__(self, page_size: int, model_config: Any, cache_config: Any, **manager_kwargs: Any) -> None:
        reason = flexkv_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"open_store('flexkv'): {reason}")
        from flexkv.kvmanager import KVManager

        self.page_size = page_size
        self._manager = KVManager(model_config, cache_config, **manager_kwargs)
        self._manager.start()
        self._errors = 0

    def register_pool(self, handle: dict[str, Any]) -> bool:
        register = getattr(self._manager, "register_kv_caches", None)
        if register is None:
            logger.warning("flexkv: this KVManager has no register_kv_caches; register the pool "
                           "through FlexKV's KVTPClient instead")
            return False
        register(PagePool.attach(handle).tensor)
        return True

    def get_match(self, token_ids: TokenIds, namespace: str) -> tuple[int, np.ndarray]:
        tokens = tokens_as_int64(token_ids)
        try:
            task_id, mask = self._manager.get_match(tokens, namespace=namespace)
            return int(task_id), np.asarray(mask, dtype=bool)
        except Exception:
            self._errors += 1
            logger.warning("flexkv get_match failed; reporting a miss", exc_info=True)
            return -1, np.zeros(tokens.size, dtype=bool)

    def put_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds | None = None) -> int:
        return int(self._manager.put_async(tokens_as_int64(token_ids), tokens_as_int64(slot_mapping),
                                           token_mask=token_mask, namespace=namespace))

    def get_async(self, token_ids: TokenIds, slot_mapping: TokenIds, namespace: str,
                  token_mask: TokenIds) -> int:
        return int(self._manager.get_async(tokens_as_int64(token_ids), tokens_as_int64(slot_mapping),
                                           token_mask=token_mask, namespace=namespace))

    def launch(self, task_ids: Sequence[int], slot_mappings: Sequence[TokenIds]) -> None:
        self._manager.launch(list(task_ids), [tokens_as_int64(s) for s in slot_mappings])

    def wait(self, task_ids: Sequence[int], timeout_s: float = DEFAULT_WAIT_TIMEOUT_S) -> dict[int, Status]:
        return self._statuses(self._manager.wait(list(task_ids), timeout=timeout_s), task_ids, Status.TIMEOUT)

    def try_wait(self, task_ids: Sequence[int]) -> dict[int, Status]:
        return self._statuses(self._manager.try_wait(list(task_ids)), task_ids, Status.UNREADY)

    def cancel(self, task_ids: Sequence[int]) -> None:
        self._manager.cancel(list(task_ids))

    def stats(self) -> dict[str, Any]:
        return {"backend": "flexkv", "errors": self._errors}

    def close(self) -> None:
        shutdown = getattr(self._manager, "shutdown", None)
        if shutdown is not None:
            shutdown()

    @staticmethod
    def _statuses(responses: dict[int, Any], task_ids: Sequence[int], missing: Status) -> dict[int, Status]:
        out: dict[int, Status] = {}
        for task_id in task_ids:
            response = responses.get(task_id)
            if response is None:
                out[task_id] = missing
                continue
            name = getattr(getattr(response, "status", None), "name", "FAILED")
            out[task_id] = Status.__members__.get(name, Status.FAILED)
        return out
