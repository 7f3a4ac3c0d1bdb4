"""Test harness for host store backends (no tests here): a small pool, and one object per
backend that starts its server, makes clients, and stops/restarts the server.

A harness asked for a copy delay starts the store server through `tests/slow_store.py` (the real
server whose copy thread sleeps before each copy)."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvlifecycle.pool import PagePool, PoolSpec, slots_for_pages
from kvlifecycle.store import HostStoreClient, Status, open_store
from kvlifecycle.rpc import default_endpoint
from kvlifecycle.store.processes import STORE_PROGRAM, start_store_process

SPEC = PoolSpec(num_layers=2, num_pages=32, page_size=4, num_heads=2, head_dim=8)  # 1 KiB pages
NS = "model-fingerprint-a"
SLOW_STORE = Path(__file__).resolve().parents[1] / "slow_store.py"


def store_program(copy_delay_s: float) -> tuple[list[str], list[str]]:
    """(program, its extra options) of a store server whose copies take `copy_delay_s` longer."""
    if copy_delay_s > 0:
        return [str(SLOW_STORE)], ["--copy-delay-s", str(copy_delay_s)]
    return list(STORE_PROGRAM), []


def tokens(num_pages: int, start: int = 1, extra: int = 0) -> np.ndarray:
    """Token ids of ``num_pages`` full pages plus ``extra`` tokens of a partial page."""
    return np.arange(start, start + num_pages * SPEC.page_size + extra, dtype=np.int64)


def fill_random(pool: PagePool, pages: list[int], seed: int) -> torch.Tensor:
    """Write seeded random KV into ``pages``; returns a host copy [L, n, 2, S, H, D]."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn((SPEC.num_layers, len(pages), *SPEC.shape[2:]), generator=gen)
    pool.tensor[:, pages] = values.to(pool.tensor.device)  # an indexed write takes values on the pool's device
    return values


def slots(pages: list[int]) -> np.ndarray:
    return slots_for_pages(pages, SPEC.page_size).numpy()


def held_pages(store: HostStoreClient, seq: np.ndarray, ns: str) -> int:
    """Whole pages of ``seq``, from the first, that ``store`` holds, asked as the serving onboard
    asks (``get_prefix_async`` from page 0). The held pages are copied into the pool's last pages
    (scratch: no test keeps data there), and the copy must succeed."""
    num_full = seq.size // SPEC.page_size
    task, held = store.get_prefix_async(seq, slots(list(range(SPEC.num_pages - num_full, SPEC.num_pages))), ns,
                                        first_page=0)
    if task is not None:
        assert store.wait([task], timeout_s=10)[task] is Status.SUCCESS, f"copying the {held} held pages failed"
    return held


_SHARED_EMBEDDED: dict[str, Any] = {}  # one default server per test module (start-up is ~1.5 s)


class _Harness:
    """What both harnesses share: a store process at ``endpoint`` speaking our protocol, and
    clients of it (short timeouts, the module's pool) that ``close`` closes."""

    kind: str
    pool: PagePool
    endpoint: str
    clients: list[HostStoreClient]

    def client(self, **cfg: Any) -> HostStoreClient:
        cfg = {"rpc_timeout_s": 0.5, "retry_interval_s": 0.2, "pool_handle": self.pool.handle(), **cfg}
        client = open_store(self.kind, endpoint=self.endpoint, page_size=SPEC.page_size, **cfg)
        self.clients.append(client)
        return client


class EmbeddedHarness(_Harness):
    """Our store server. A default one (no options) is shared by a test module; any option
    gets a dedicated server. Each harness has its own namespace."""

    kind = "embedded"
    has_lru = True

    def __init__(self, pool: PagePool, capacity_pages: int | None = None, copy_delay_s: float = 0.0,
                 disk_dir: Path | None = None, dedicated: bool = False) -> None:
        self.pool = pool
        self.ns = f"{NS}-{uuid.uuid4().hex[:8]}"
        self.capacity_pages = capacity_pages or 64
        self.copy_delay_s = copy_delay_s
        self.disk_dir = disk_dir
        self.proc: Any = None
        self.clients: list[HostStoreClient] = []
        self.dedicated = dedicated or capacity_pages is not None or copy_delay_s > 0 or disk_dir is not None
        if not self.dedicated and "proc" in _SHARED_EMBEDDED:
            self.endpoint, self.proc = _SHARED_EMBEDDED["endpoint"], _SHARED_EMBEDDED["proc"]
            return
        self.endpoint = default_endpoint("store.sock")
        self.start()
        if not self.dedicated:
            _SHARED_EMBEDDED.update(endpoint=self.endpoint, proc=self.proc)

    def start(self) -> None:
        program, extra_args = store_program(self.copy_delay_s)
        self.proc = start_store_process(self.endpoint, dram_bytes=SPEC.page_bytes * self.capacity_pages,
                                        disk_dir=self.disk_dir, extra_args=extra_args, program=program)

    def stop(self) -> None:
        self.proc.stop()

    def kill(self) -> None:
        self.proc.kill()

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self.dedicated and self.proc is not None:
            self.proc.kill()
            shutil.rmtree(Path(self.endpoint.removeprefix("ipc://")).parent, ignore_errors=True)


_SHARED_MOONCAKE: dict[str, Any] = {}  # one master and store process per test module


class MooncakeHarness(_Harness):
    """A store server process with the Mooncake backing, in front of a `mooncake_master` on
    loopback; clients speak the store protocol to the process. Shared master and process unless
    the case needs its own (`dedicated`, a copy delay); `kill`/`start` kill and restart the
    master (the store process stays). Each harness has its own namespace, so tests never see
    each other's pages."""

    kind = "mooncake"
    has_lru = False  # eviction is the Mooncake master's (watermarks), not a byte-capacity LRU

    def __init__(self, pool: PagePool, capacity_pages: int | None = None, copy_delay_s: float = 0.0,
                 disk_dir: Path | None = None, dedicated: bool = False) -> None:
        from kvlifecycle.store.processes import start_master

        if disk_dir is not None:
            pytest.skip("mooncake: the disk tier is the local backing's")
        self.pool = pool
        self.ns = f"{NS}-{uuid.uuid4().hex[:8]}"
        self.clients: list[HostStoreClient] = []
        self.dedicated = dedicated or copy_delay_s > 0
        if not self.dedicated and "proc" in _SHARED_MOONCAKE:
            self.master, self.endpoint, self.proc = (_SHARED_MOONCAKE[k] for k in ("master", "endpoint", "proc"))
            return
        self.master = start_master()
        self.endpoint = default_endpoint("store.sock")
        program, extra_args = store_program(copy_delay_s)
        self.proc = start_store_process(
            self.endpoint, extra_args=["--backing", "mooncake", "--mooncake-master", self.master.address,
                                       "--mooncake-segment-bytes", str(16 << 20), *extra_args], program=program)
        if not self.dedicated:
            _SHARED_MOONCAKE.update(master=self.master, endpoint=self.endpoint, proc=self.proc)

    def start(self) -> None:
        from kvlifecycle.store.processes import start_master

        self.master = start_master(int(self.master.address.rpartition(":")[2]))

    def kill(self) -> None:
        self.master.proc.kill()
        self.master.proc.wait()

    def close(self) -> None:
        for client in self.clients:
            client.close()
        if self.dedicated:
            self.proc.kill()
            self.master.stop()
            shutil.rmtree(Path(self.endpoint.removeprefix("ipc://")).parent, ignore_errors=True)


def close_shared_stores() -> None:
    proc = _SHARED_EMBEDDED.pop("proc", None)
    if proc is not None:
        proc.kill()
        shutil.rmtree(Path(_SHARED_EMBEDDED.pop("endpoint").removeprefix("ipc://")).parent, ignore_errors=True)
    if "proc" in _SHARED_MOONCAKE:
        _SHARED_MOONCAKE.pop("proc").kill()
        _SHARED_MOONCAKE.pop("master").stop()
        shutil.rmtree(Path(_SHARED_MOONCAKE.pop("endpoint").removeprefix("ipc://")).parent, ignore_errors=True)


def mooncake_skip_reason() -> str | None:
    from kvlifecycle.store.mooncake_loader import MooncakeUnavailable, load_mooncake

    try:
        load_mooncake()
    except MooncakeUnavailable as e:
        return str(e)
    return None


def backend_params() -> list[Any]:
    params = [pytest.param(EmbeddedHarness, id="embedded")]
    reason = mooncake_skip_reason()
    params.append(pytest.param(MooncakeHarness, id="mooncake",
                               marks=[pytest.mark.skipif(reason is not None, reason=str(reason))]))
    return params


def private_tmp() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvstore-test-"))
