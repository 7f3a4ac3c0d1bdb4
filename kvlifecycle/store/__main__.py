"""``python -m kvlifecycle.store``: run the host store server until SIGTERM/SIGINT.

    python -m kvlifecycle.store --endpoint ipc:///run/dir/store.sock \\
        [--backing local] [--dram-bytes N] [--disk-dir DIR] [--disk-bytes N]
    python -m kvlifecycle.store --endpoint ipc:///run/dir/store.sock \\
        --backing mooncake --mooncake-master HOST:PORT [--mooncake-segment-bytes N] [--mooncake-local-hostname H]

Clients speak the same protocol whatever the backing. SIGTERM finishes queued copies and
flushes the disk write-behind queue before exiting 0. The local backing publishes the keys it
holds beside an ipc:// socket (``key_filter.py``), so its clients skip asking about pages it
cannot hold; a Mooncake store publishes none (other nodes' puts land in it too).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from kvlifecycle.gil import hand_over_gil_promptly
from kvlifecycle.store.backing import BackingFactory, LocalConfig
from kvlifecycle.store.copy_worker import CopyWorker
from kvlifecycle.store.key_filter import key_filter_path, remove_stale_key_filter
from kvlifecycle.store.pools import PoolRegistry
from kvlifecycle.store.server import ServerConfig, StoreServer

logger = logging.getLogger("kvlifecycle.store")

BACKINGS = ("local", "mooncake")


def parser() -> argparse.ArgumentParser:
    """The command line (a wrapper such as a test entry point may add options)."""
    p = argparse.ArgumentParser(prog="python -m kvlifecycle.store", description=__doc__.splitlines()[0])
    p.add_argument("--endpoint", required=True, help="ipc://PATH (directory made 0700) or tcp://HOST:PORT")
    p.add_argument("--backing", choices=BACKINGS, default="local",
                   help="where pages are kept: local (this host's DRAM, optional disk tier) or mooncake "
                        "(Mooncake Store behind --mooncake-master)")
    p.add_argument("--dram-bytes", type=int, default=LocalConfig.dram_bytes,
                   help="local: DRAM tier capacity in bytes (default: %(default)s)")
    p.add_argument("--disk-dir", type=Path, help="local: enable the disk tier in this directory")
    p.add_argument("--disk-bytes", type=int, default=0, help="local: disk tier capacity in bytes (0: unbounded)")
    p.add_argument("--mooncake-master", default="", metavar="HOST:PORT", help="mooncake: the running mooncake_master")
    p.add_argument("--mooncake-segment-bytes", type=int, default=256 << 20,
                   help="mooncake: host memory this process gives the tier (0: memory nodes hold it)")
    p.add_argument("--mooncake-local-hostname", default="127.0.0.1",
                   help="mooncake: the address Mooncake peers reach this host on")
    p.add_argument("--log-level", default="INFO")
    return p


def backing_factory(args: argparse.Namespace) -> BackingFactory:
    """The factory of the backing ``args`` ask for; ValueError naming a bad option, RuntimeError
    when Mooncake cannot be loaded here."""
    if args.backing == "mooncake":
        from kvlifecycle.store.mooncake import MooncakeConfig
        from kvlifecycle.store.mooncake_loader import load_mooncake

        load_mooncake()  # fail at start (MooncakeUnavailable names why), not at the first register_pool
        return MooncakeConfig(master_address=args.mooncake_master, segment_bytes=args.mooncake_segment_bytes,
                              local_hostname=args.mooncake_local_hostname).factory()
    return LocalConfig(dram_bytes=args.dram_bytes, disk_dir=args.disk_dir, disk_bytes=args.disk_bytes,
                       key_filter=key_filter_path(args.endpoint)).factory()


def serve(args: argparse.Namespace, worker: CopyWorker, server_class: type[StoreServer] = StoreServer) -> int:
    """Serve with ``worker`` as the copy thread until SIGTERM/SIGINT; the exit code. (Tests pass a
    slowed worker or server class: tests/slow_store.py.)"""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = ServerConfig(endpoint=args.endpoint)
        make_backing = backing_factory(args)
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"python -m kvlifecycle.store: {e}") from None
    hand_over_gil_promptly()  # the socket thread answers get_prefix while the copy thread runs Python
    remove_stale_key_filter(args.endpoint)
    server = server_class(config, PoolRegistry(make_backing), worker)
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.serve_forever()
    return 0


def main(argv: list[str] | None = None) -> int:
    return serve(parser().parse_args(argv), CopyWorker())


if __name__ == "__main__":
    sys.exit(main())
