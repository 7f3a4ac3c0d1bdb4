"""Fixtures for kvlifecycle tests, and helpers to run the owner/other-process scenario.

- ``kv_owner(spec, namespace, store=None)``: this process plays the owner (process A):
  creates the pool, a ``KVCacheManager`` and a ``ControlServer`` on a private ipc endpoint;
  yields an ``Owner`` and tears everything down.
- ``run_child(script, payload, timeout_s)``: runs ``python <script> <payload JSON>`` as another
  process (process B) with the repository on ``sys.path``; the script prints one JSON object
  as its last stdout line, which is returned. See ``child_writer.py`` for the shape.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvlifecycle.control import ControlServer
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PagePool, PoolSpec
from kvlifecycle.rpc import default_endpoint
from kvlifecycle.store.key_filter import key_filter_path

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parents[1]


@dataclass
class Owner:
    pool: PagePool
    manager: KVCacheManager
    server: ControlServer
    endpoint: str


@contextlib.contextmanager
def kv_owner(spec: PoolSpec, namespace: str = "test-ns", store: Any = None,
             **manager_kwargs: Any) -> Iterator[Owner]:
    pool = PagePool.create(spec)
    manager = KVCacheManager(spec, namespace, store, **manager_kwargs)
    endpoint = default_endpoint("control.sock")
    server = ControlServer(manager, endpoint, expire_interval_s=0.05)
    try:
        yield Owner(pool, manager, server, endpoint)
    finally:
        server.close()
        pool.close()


def run_child(script: str | Path, payload: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(HERE / script), json.dumps(payload)],
        capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(REPO_ROOT),
    )
    assert proc.returncode == 0, (
        f"child {script}: expected exit 0, got {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def tiny_spec() -> PoolSpec:
    return PoolSpec(num_layers=2, num_pages=8, page_size=4, num_heads=1, head_dim=2)


@pytest.fixture
def pool(tiny_spec: PoolSpec) -> Iterator[PagePool]:
    p = PagePool.create(tiny_spec)
    yield p
    p.close()


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A fresh ipc endpoint for a store server; its socket, key filter (a killed store leaves it)
    and 0700 directory are removed after."""
    ep = default_endpoint("store.sock")
    yield ep
    sock = Path(ep.removeprefix("ipc://"))
    sock.unlink(missing_ok=True)
    key_filter_path(ep).unlink(missing_ok=True)
    sock.parent.rmdir()
