"""The page pool's handle, published by its owner and followed by the other models.

kv_lookup_alloc creates the pool and publishes `PagePool.handle()` as JSON in the run directory
(`ServingSettings.pool_handle_path`); hstu_compute attaches the pool from it and kv_offload gives
it to its host-store client (the store copies from that pool). Triton loads the models in
parallel, and a reloaded kv_lookup_alloc publishes a new pool, so readers wait for the file and
notice when it changes.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

WAIT_S = 120.0


def publish(path: Path, handle: dict[str, Any]) -> None:
    """Write the handle atomically, so a reader never sees half a file."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(handle))
    os.replace(tmp, path)


def unpublish(path: Path) -> None:
    path.unlink(missing_ok=True)


class PublishedHandle:
    """Follows the handle file: `poll()` returns a new handle when it appeared or changed, else None."""

    def __init__(self, path: Path, wait_s: float = WAIT_S):
        self.path = Path(path)
        self.wait_s = wait_s
        self._stamp: int | None = None

    def poll(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.wait_s
        while not self.path.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"no page pool handle at {self.path} after {self.wait_s:.0f}s; "
                                   "is kv_lookup_alloc loaded?")
            time.sleep(0.1)
        stamp = self.path.stat().st_mtime_ns
        if stamp == self._stamp:
            return None
        self._stamp = stamp
        return json.loads(self.path.read_text())
