"""The ``flexkv`` backend: FlexKV (github.com/taco-project/FlexKV) as the host tier. This
module is the store process (its client is ``flexkv_client.py``).

FlexKV is not on PyPI: build it with ``deploy/build_flexkv.sh`` (CUDA only). Its ``KVManager``
takes one GPU registration per data-parallel rank from the process that allocated the GPU
memory, and is driven by one caller. Our ensemble has two callers of the store (the pool's
owner looks up and onboards, kv_offload offloads), so FlexKV runs in a store process of its
own that speaks our store protocol (``protocol.py``), and both callers use the ordinary
protocol client:

    python -m kvlifecycle.store.flexkv --endpoint ipc://RUN/store.sock --dram-bytes N

Call order, per device page pool (one ``KVManager`` each, so pools never share FlexKV's
GPU registration):

1. The owner's ``FlexKVStoreClient.register_pool(handle)`` (``flexkv_client.py``) sends
   ``register_pool``; the server starts a ``KVManager`` for the pool's geometry (FlexKV's CPU
   tier of ``--dram-bytes`` per pool) whose transfer engine listens on ``gpu_register_endpoint``.
2. The owner hands its pool's memory to that engine through FlexKV's ``KVTPClient`` (pool
   ``[L, P, 2, S, H, D]`` is FlexKV's ``LAYERBLOCK`` GPU layout: one ``[P, 2, S, H, D]`` tensor
   per layer; FlexKV opens them with CUDA IPC in its transfer process), then polls ``ping``
   until the server reports the pool ready. A process that does not own the pool (kv_offload)
   only names it.
3. ``get_prefix`` -> ``KVManager.get_match`` for the held prefix (its prepared FlexKV task is
   cancelled), then ``get_async`` of the candidates inside it; ``put``/``get`` ->
   ``put_async``/``get_async`` with a token mask over the task's pages and a slot mapping
   ``pool_page * S + offset`` (the namespace is FlexKV's namespace); ``poll`` -> ``try_wait``;
   ``cancel`` cancels nothing (FlexKV has launched the task at submission; its real outcome is
   reported). A task moves one run of consecutive pages.

Statuses: FlexKV's ``KVResponseStatus`` maps by name onto ``Status``; a get that FlexKV
finished with fewer tokens than asked (a page was evicted meanwhile) is NOTFOUND (the owner
then recomputes those pages, which overwrites whatever landed in them). Ordering guarantee:
FlexKV launches a task when it is submitted and our server submits one client's tasks in
arrival order, but FlexKV does not promise that a get overtakes no earlier put; the owner
never gets pages it has not seen committed and offloaded (the offload's completion unpins
them first), which is what the protocol relies on.
"""

from __future__ import annotations

import argparse
import collections
import logging
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvlifecycle.pool import PoolSpec
from kvlifecycle.store.api import Status
from kvlifecycle.store.key_filter import remove_stale_key_filter
from kvlifecycle.rpc import RpcError, RpcStatus, answer, prepare_ipc_dir
from kvlifecycle.store.protocol import Op, check_task_pages, pool_id

logger = logging.getLogger(__name__)

__all__ = ["FlexKVStoreServer", "flexkv_unavailable_reason", "gpu_register_endpoint", "require_ipc_endpoint"]

READY_TIMEOUT_S = 120.0  # FlexKV spawns its transfer process and opens the pool: seconds, not ms
# Thread blocks of FlexKV's GPU<->CPU copy kernel, each way (FLEXKV_TRANSFER_NUM_CTA_H2D/_D2H win when
# set). FlexKV's own default is 4.
TRANSFER_CTAS = 4


def flexkv_unavailable_reason() -> str | None:
    """None when ``import flexkv`` works, else why not and how to fix it."""
    # FlexKV reads its settings from the environment once, at import. Unless told otherwise it
    # starts an MPS daemon, which changes how every process shares the GPU: never ours to start.
    os.environ.setdefault("FLEXKV_ENABLE_MPS", "0")
    for way in ("H2D", "D2H"):
        os.environ.setdefault(f"FLEXKV_TRANSFER_NUM_CTA_{way}", str(TRANSFER_CTAS))
    try:
        import flexkv.kvmanager  # noqa: F401
    except ImportError as e:
        return (f"FlexKV is not importable ({e}): it is not on PyPI; build it with "
                f"deploy/build_flexkv.sh SRC (it installs a .pth into this Python's site-packages) and "
                f"source the env.sh it writes")
    return None


def gpu_register_endpoint(store_endpoint: str, pool: str) -> str:
    """Where the FlexKV transfer engine of pool ``pool`` takes its GPU registration: beside
    the store's own socket (both ends compute it, so nothing more travels)."""
    require_ipc_endpoint(store_endpoint)
    return f"ipc://{Path(store_endpoint.removeprefix('ipc://')).parent}/flexkv-{pool[:16]}-gpu"


@dataclass
class _Task:
    kind: Op
    flexkv_id: int
    tokens_asked: int  # tokens selected by the task's mask: a get that moved fewer is NOTFOUND


@dataclass
class _FlexKVPool:
    """One device pool's ``KVManager``: built and started on a thread (seconds), used by the
    socket thread once ``ready`` is set."""

    spec: PoolSpec
    manager: Any = None
    ready: threading.Event = field(default_factory=threading.Event)
    failed: str | None = None


class FlexKVStoreServer:
    """Our store protocol over FlexKV. ``serve_forever`` in the main thread, ``stop`` from
    anywhere. Every FlexKV call happens on the socket thread (FlexKV's manager wants one
    caller), except each pool's start, which happens before the pool is marked ready."""

    def __init__(self, endpoint: str, dram_bytes: int) -> None:
        reason = flexkv_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        if dram_bytes <= 0:
            raise ValueError(f"dram_bytes: expected > 0 (FlexKV's CPU tier per pool), got {dram_bytes}")
        self.endpoint = endpoint
        self.dram_bytes = dram_bytes
        self._pools: dict[str, _FlexKVPool] = {}
        self._tasks: dict[tuple[str, int], tuple[str, _Task]] = {}
        self._counters = collections.Counter[str]()
        self._stop = threading.Event()
        self._instance = uuid.uuid4().hex  # lets an owner tell a restarted store process from this one

    def serve_forever(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        prepare_ipc_dir(self.endpoint)
        remove_stale_key_filter(self.endpoint)  # FlexKV publishes no filter of held keys: clients ask
        sock.bind(self.endpoint)
        logger.info("flexkv store listening on %s (CPU tier %d bytes per pool)", self.endpoint, self.dram_bytes)
        try:
            while not self._stop.is_set():
                if sock.poll(100, zmq.POLLIN):
                    reply, _status = answer(sock.recv_multipart(), self._dispatch)
                    sock.send_multipart(reply)
        finally:
            sock.close(0)
            ctx.term()
            for pool in self._pools.values():
                _shutdown(pool)
            logger.info("flexkv store stopped")

    def stop(self) -> None:
        self._stop.set()

    # ---- RPC handling (socket thread) ------------------------------------------------------

    def _dispatch(self, header: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, Any]:
        op = Op(header.get("op"))
        self._counters[f"rpc_{op.value}"] += 1
        client = str(header.get("client", ""))
        if op is Op.PING:
            pool = self._pools.get(header.get("pool", ""))
            return {"instance": self._instance, "ready": bool(pool and pool.ready.is_set()),
                    "failed": pool.failed if pool else None}
        if op is Op.STATS:
            return {"stats": {"backend": "flexkv", "pools": len(self._pools), **self._counters}}
        if op is Op.REGISTER_POOL:
            return {"pool": self._register(header["handle"])}
        if op is Op.POLL:
            return {"tasks": {str(t): self._poll(client, int(t)).value for t in header["tasks"]}}
        if op is Op.CANCEL:
            self._cancel(client, [int(t) for t in header["tasks"]])
            return {}
        pool_name = header.get("pool")
        pool = self._pools.get(pool_name) if isinstance(pool_name, str) else None
        if pool is None:
            raise RpcError(RpcStatus.NO_POOL, f"pool {pool_name} is not registered; call register_pool")
        page_size = int(header["page_size"])
        if page_size != pool.spec.page_size:
            raise ValueError(f"page_size: pool {pool_name} has {pool.spec.page_size}, got {page_size}")
        namespace = [str(header["ns"])]
        assert op in (Op.PUT, Op.GET, Op.GET_PREFIX), f"_dispatch: unhandled op {op}"
        if op is Op.GET_PREFIX and not pool.ready.is_set():
            return {"pages": 0, "copying": False}  # while FlexKV starts: a miss
        if not pool.ready.is_set():
            raise RpcError(RpcStatus.BUSY, f"pool {pool_name}: FlexKV is still starting")
        if time.monotonic() > float(header["accept_by"]):
            raise RpcError(RpcStatus.BUSY, "request arrived after the client's accept deadline")
        tokens, seq_pages, pool_pages = arrays["tokens"], arrays["seq_pages"], arrays["pool_pages"]
        key = (client, int(header["task"]))
        if key in self._tasks:
            raise ValueError(f"task {key[1]}: already submitted by this client")
        mask, slots = _token_mask_and_slots(tokens.size, seq_pages, pool_pages, page_size, pool.spec.num_pages)
        reply: dict[str, Any] = {}
        if op is Op.GET_PREFIX:  # copy the candidates inside the held prefix, in the same round trip
            held = self._held_prefix(pool, tokens, namespace)
            keep = seq_pages < held
            if not keep.any():
                return {"pages": held, "copying": False}
            seq_pages, pool_pages = seq_pages[keep], pool_pages[keep]
            mask, slots = _token_mask_and_slots(tokens.size, seq_pages, pool_pages, page_size, pool.spec.num_pages)
            reply = {"pages": held, "copying": True}
        if op is Op.PUT:
            task = self._put(pool, tokens, seq_pages, pool_pages, namespace)
        else:
            task = _Task(Op.GET, int(pool.manager.get_async(tokens, slots, mask, namespace=namespace)), int(mask.sum()))
        self._tasks[key] = (pool_name, task)
        self._counters[f"{task.kind.value}_pages"] += int(seq_pages.size)
        return reply

    @staticmethod
    def _held_prefix(pool: "_FlexKVPool", tokens: np.ndarray, namespace: list[str]) -> int:
        """Whole pages of ``tokens``, from the first, that FlexKV holds."""
        task_id, mask = pool.manager.get_match(tokens, namespace=namespace)
        pool.manager.cancel([task_id])  # the match's prepared get is never launched: gets are tasks of their own
        return int(np.asarray(mask, dtype=bool).sum()) // pool.spec.page_size

    def _put(self, pool: _FlexKVPool, tokens: np.ndarray, seq_pages: np.ndarray, pool_pages: np.ndarray,
             namespace: list[str]) -> _Task:
        """FlexKV puts a prefix of a sequence: it is handed the slots of every page from the first,
        and skips the pages it already holds. kv_offload puts a request's new pages only (its
        cached prefix was put before), so the prefix pages get a stand-in slot, which FlexKV never
        reads as long as it holds that prefix. It is checked first (nothing else touches FlexKV's
        tree between the check and the put: both run on this thread); a put whose prefix FlexKV
        no longer holds could never be matched anyway, and fails without copying."""
        page_size = pool.spec.page_size
        first, last = int(seq_pages.min()), int(seq_pages.max())
        if first > 0 and self._held_prefix(pool, tokens[: first * page_size], namespace) < first:
            self._counters["put_prefix_missing"] += 1
            return _Task(Op.PUT, -1, 0)  # polls as FAILED: the pages stay on the device only
        order = np.argsort(seq_pages, kind="stable")
        pages = np.full(last + 1, pool_pages[order][0], dtype=np.int64)  # stand-ins for the held prefix
        pages[first:] = pool_pages[order]
        mask = np.zeros(tokens.size, dtype=bool)
        mask[: (last + 1) * page_size] = True
        slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)  # [pages * S]
        return _Task(Op.PUT, int(pool.manager.put_async(tokens, slots, mask, namespace=namespace)), 0)

    def _register(self, handle: Any) -> str:
        if not isinstance(handle, dict) or "spec" not in handle:
            raise ValueError("register_pool 'handle': expected a PagePool.handle() dict")
        name = pool_id(handle)
        if name not in self._pools:
            spec = PoolSpec.from_dict(handle["spec"])
            if not spec.device.startswith("cuda"):
                raise ValueError(f"register_pool: FlexKV copies between GPU and host; pool {name} is on "
                                 f"{spec.device}. Use --store embedded for a CPU pool")
            pool = self._pools[name] = _FlexKVPool(spec)
            threading.Thread(target=self._start_pool, args=(name, pool), name=f"flexkv-start-{name[:8]}",
                             daemon=True).start()
        return name

    def _start_pool(self, name: str, pool: _FlexKVPool) -> None:
        try:
            from flexkv.common.config import CacheConfig, ModelConfig
            from flexkv.kvmanager import KVManager
            import torch

            spec = pool.spec
            model = ModelConfig(num_layers=spec.num_layers, num_kv_heads=spec.num_heads, head_size=spec.head_dim,
                                kv_dim=2, dtype=getattr(torch, spec.dtype))
            cache = CacheConfig(tokens_per_block=spec.page_size, enable_cpu=True, enable_ssd=False,
                                num_cpu_blocks=max(1, self.dram_bytes // spec.page_bytes))
            port = gpu_register_endpoint(self.endpoint, name)
            pool.manager = KVManager(model, cache, server_recv_port=port.removesuffix("-gpu") + "-srv",
                                     gpu_register_port=port)  # held at once: stop() shuts down what started
            pool.manager.start()
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not pool.manager.is_ready():  # until the owner's KVTPClient registered the pool
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no GPU registration on {port} within {READY_TIMEOUT_S:.0f} s")
                if self._stop.is_set():
                    return
                time.sleep(0.05)
            pool.ready.set()
            logger.info("flexkv store: pool %s ready (%s, %d CPU blocks)", name, spec, cache.num_cpu_blocks)
        except Exception as e:
            pool.failed = f"{type(e).__name__}: {e}"
            logger.error("flexkv store: pool %s failed to start", name, exc_info=True)
            _shutdown(pool)

    def _poll(self, client: str, task_id: int) -> Status:
        entry = self._tasks.get((client, task_id))
        if entry is None:
            return Status.FAILED  # unknown: lost (e.g. the store restarted)
        pool_name, task = entry
        if task.flexkv_id < 0:
            status = Status.FAILED  # refused at submission
        else:
            response = self._pools[pool_name].manager.try_wait([task.flexkv_id]).get(task.flexkv_id)
            status = _status_of(response, task)
        if status.done:
            del self._tasks[(client, task_id)]
            self._counters[f"task_{status.value.lower()}"] += 1
        return status

    def _cancel(self, client: str, task_ids: list[int]) -> None:
        """FlexKV launches a task when it is submitted, and cannot promise to stop a running copy:
        nothing is cancelled, and ``poll`` reports each task's real outcome (a CANCELLED task may
        have its pages reused at once, which a copy still running would break)."""
        self._counters["cancel_ignored"] += len(task_ids)


# ---- helpers ----------------------------------------------------------------------------------

def _token_mask_and_slots(num_tokens: int, seq_pages: np.ndarray, pool_pages: np.ndarray, page_size: int,
                          num_pool_pages: int) -> tuple[np.ndarray, np.ndarray]:
    """FlexKV's (token_mask, slot_mapping) for whole pages: slots in token order."""
    check_task_pages(num_tokens, seq_pages, pool_pages, page_size, num_pool_pages)
    first = int(seq_pages.min()) if seq_pages.size else 0
    if seq_pages.size and not np.array_equal(np.sort(seq_pages), np.arange(first, first + seq_pages.size)):
        # FlexKV takes a task's pages as the range from its first to its last selected token
        raise ValueError("seq_pages: FlexKV moves one run of consecutive pages per task; expected distinct, "
                         f"consecutive page indices, got {seq_pages.tolist()}")
    order = np.argsort(seq_pages, kind="stable")
    mask = np.zeros(num_tokens, dtype=bool)
    mask[first * page_size:(first + seq_pages.size) * page_size] = True
    slots = (pool_pages[order][:, None] * page_size + np.arange(page_size)).reshape(-1)  # [pages * S]
    return mask, slots.astype(np.int64)


def require_ipc_endpoint(endpoint: str) -> None:
    if not endpoint.startswith("ipc://"):
        raise ValueError(f"flexkv store endpoint: expected ipc://PATH (FlexKV's engine is local), got {endpoint!r}")


def _shutdown(pool: _FlexKVPool) -> None:
    if pool.manager is None:
        return
    try:
        pool.manager.shutdown()
    except Exception:
        logger.warning("flexkv store: shutting down a pool's KVManager failed", exc_info=True)
    pool.manager = None


def _status_of(response: Any, task: _Task) -> Status:
    if response is None:
        return Status.UNREADY
    status = Status.__members__.get(getattr(response.status, "name", ""), Status.FAILED)
    if status is Status.TIMEOUT:
        return Status.UNREADY
    if status is Status.NOTFOUND and task.kind is Op.PUT:
        return Status.FAILED
    if status is Status.SUCCESS and task.kind is Op.GET:
        moved = 0 if response.return_mask is None else int(np.asarray(response.return_mask, dtype=bool).sum())
        if moved < task.tokens_asked:
            return Status.NOTFOUND
    return status


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlifecycle.store.flexkv",
                                description="Run the FlexKV host store until SIGTERM/SIGINT.")
    p.add_argument("--endpoint", required=True, help="ipc://PATH (its directory is made 0700)")
    p.add_argument("--dram-bytes", type=int, default=2 << 30, help="FlexKV's CPU tier per pool, bytes")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        server = FlexKVStoreServer(a.endpoint, a.dram_bytes)
    except (RuntimeError, ValueError) as e:
        print(f"python -m kvlifecycle.store.flexkv: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
