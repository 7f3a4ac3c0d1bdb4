"""Files one model publishes in the run directory for the others to follow.

- The page pool's handle (`ServingSettings.pool_handle_path`): kv_lookup_alloc creates the pool
  and publishes `PagePool.handle()`; hstu_compute attaches the pool from it and kv_offload gives
  it to its host-store client (the store copies from that pool).
- The serving compute version (`ServingSettings.compute_version_path`): each hstu_compute
  version publishes, when it loads, its version and the KV namespace of its weights (their
  fingerprint); kv_lookup_alloc makes new leases in that namespace, so a new version never
  reads KV that other weights computed (docs/ARCHITECTURE.md, "Rolling out a new version").

Triton loads the models in parallel and reloads them one by one, so readers wait for a file
and notice when it changes. A file is written atomically: a reader never sees half of it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from compute.files import replace_atomically

WAIT_S = 120.0


def publish(path: Path, data: dict[str, Any]) -> None:
    replace_atomically(Path(path), lambda tmp: tmp.write_text(json.dumps(data)))


def unpublish(path: Path) -> None:
    path.unlink(missing_ok=True)


class PublishedFile:
    """Follows one published file: `poll()` returns its content when it appeared or changed
    since the last poll, else None. With `wait_s` > 0 the first poll waits that long for the
    file to appear and then raises RuntimeError naming `publisher`; with 0 it never waits."""

    def __init__(self, path: Path, publisher: str, wait_s: float = WAIT_S):
        self.path = Path(path)
        self.publisher = publisher
        self.wait_s = wait_s
        self._stamp: tuple[int, int] | None = None

    def poll(self) -> dict[str, Any] | None:
        deadline = time.monotonic() + self.wait_s
        while not self.path.exists():
            if time.monotonic() >= deadline:
                if self.wait_s <= 0:
                    return None
                raise RuntimeError(f"nothing published at {self.path} after {self.wait_s:.0f}s; "
                                   f"is {self.publisher} loaded?")
            time.sleep(0.1)
        try:
            stat = self.path.stat()
            stamp = (stat.st_ino, stat.st_mtime_ns)  # each publish is a new file (os.replace)
            if stamp == self._stamp:
                return None
            data = json.loads(self.path.read_text())
        except FileNotFoundError:  # unpublished between the check and the read
            return None
        self._stamp = stamp
        return data


def pool_handle_file(settings) -> PublishedFile:
    """The owner's page pool handle (`settings`: a `ServingSettings`)."""
    return PublishedFile(settings.pool_handle_path, publisher="kv_lookup_alloc")


def compute_version_file(settings) -> PublishedFile:
    """The serving hstu_compute version; never waited for (the owner starts with its own namespace)."""
    return PublishedFile(settings.compute_version_path, publisher="hstu_compute", wait_s=0.0)
