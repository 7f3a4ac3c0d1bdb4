"""``python -m kvlifecycle.store``: run the embedded host store server until SIGTERM/SIGINT.

    python -m kvlifecycle.store --endpoint ipc:///run/dir/store.sock --dram-bytes 2147483648 \\
        [--pool-handle JSON|FILE] [--disk-dir DIR] [--disk-bytes N] [--task-start-timeout-s S]

SIGTERM finishes queued copies and flushes the disk write-behind queue before exiting 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path
from typing import Any

from kvlifecycle.store.server import ServerConfig, StoreServer

logger = logging.getLogger("kvlifecycle.store")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvlifecycle.store", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", required=True, help="ipc://PATH (directory made 0700) or tcp://HOST:PORT")
    p.add_argument("--dram-bytes", type=int, default=ServerConfig.dram_bytes,
                   help="DRAM tier capacity in bytes (default: %(default)s)")
    p.add_argument("--pool-handle", help="PagePool.handle() as JSON, or a file holding it (may appear "
                   "later); clients can also send it with register_pool")
    p.add_argument("--disk-dir", type=Path, help="enable the disk tier in this directory")
    p.add_argument("--disk-bytes", type=int, default=0, help="disk tier capacity in bytes (0: unbounded)")
    p.add_argument("--task-start-timeout-s", type=float, default=5.0,
                   help="a task not started this long after submission fails (clients rely on it)")
    p.add_argument("--debug-copy-delay-s", type=float, default=0.0,
                   help="fault injection for tests: sleep before each copy")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(endpoint=a.endpoint, dram_bytes=a.dram_bytes, disk_dir=a.disk_dir,
                          disk_bytes=a.disk_bytes, pool_handle=_pool_handle_arg(a.pool_handle),
                          task_start_timeout_s=a.task_start_timeout_s,
                          debug_copy_delay_s=a.debug_copy_delay_s)
    server = StoreServer(config)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve_forever()
    return 0


def _pool_handle_arg(value: str | None) -> dict[str, Any] | Path | None:
    if value is None:
        return None
    if value.lstrip().startswith("{"):
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--pool-handle: not valid JSON ({e}); pass PagePool.handle() or a file path")
    return Path(value)


if __name__ == "__main__":
    sys.exit(main())
