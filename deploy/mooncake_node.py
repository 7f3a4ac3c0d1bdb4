"""A Mooncake Store memory node: gives host memory to the shared tier and holds it until stopped.

    python -m deploy.mooncake_node --master 127.0.0.1:50051 --segment-bytes 1073741824

Mooncake places each object in a segment that some client contributed at `setup`. If the
Triton servers' own clients contributed the memory, stopping a server would drop the pages it
held; so `hstu-cluster` runs the servers' clients with no segment
(`HSTU_MOONCAKE_SEGMENT_BYTES=0`) and one of these nodes holds every page (the production
shape: a few memory nodes beside the master; see deploy/k8s/). It prints `ready` once set up
and exits on SIGTERM/SIGINT, unmounting its segment (the pages in it are lost).
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from kvlifecycle.store.mooncake_loader import load_mooncake

logger = logging.getLogger("mooncake-node")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m deploy.mooncake_node", description=__doc__.split("\n")[0])
    p.add_argument("--master", required=True, help="mooncake_master HOST:PORT")
    p.add_argument("--segment-bytes", type=int, default=1 << 30, help="host memory given to the tier")
    p.add_argument("--local-hostname", default="127.0.0.1", help="the address other nodes reach this one on")
    p.add_argument("--protocol", default="tcp")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    store = load_mooncake().MooncakeDistributedStore()
    rc = store.setup(a.local_hostname, "P2PHANDSHAKE", a.segment_bytes, 16 << 20, a.protocol, "", a.master)
    if rc != 0:
        logger.error("setup against master %s returned %d", a.master, rc)
        return 1
    logger.info("holding a %d-byte segment for master %s", a.segment_bytes, a.master)
    print("ready", flush=True)
    stop.wait()
    store.close()
    logger.info("segment unmounted; stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
