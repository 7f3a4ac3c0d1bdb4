"""The host tier's child processes: the store server (``python -m kvlifecycle.store``, or another
entry point speaking its protocol) and ``mooncake_master``. The cluster (its master), the store
benchmark and the tests start them here and stop them with ``stop()``; ``hstu-serve`` starts its
store with its own command line (``deploy/launcher.py``).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from kvlifecycle.store.embedded import StoreProcessClient

logger = logging.getLogger(__name__)

__all__ = ["STORE_PROGRAM", "MasterProcess", "StoreProcess", "start_master", "start_store_process", "stop_process"]


def stop_process(proc: subprocess.Popen, name: str, timeout_s: float) -> int:
    """SIGTERM, then SIGKILL after ``timeout_s``; the exit code."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            logger.error("%s pid %d ignored SIGTERM for %.0f s; killing it", name, proc.pid, timeout_s)
            proc.kill()
            proc.wait()
    return proc.returncode


@dataclass
class StoreProcess:
    """A store server child process started by ``start_store_process``."""

    proc: subprocess.Popen
    endpoint: str
    log_path: Path

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (flushes the disk queue), then SIGKILL after ``timeout_s``. Returns the exit code."""
        return stop_process(self.proc, "store", timeout_s)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


STORE_PROGRAM = ("-m", "kvlifecycle.store")  # the store server's command, after the interpreter


def start_store_process(endpoint: str, dram_bytes: int = 2 << 30, disk_dir: Path | None = None,
                        extra_args: Sequence[str] = (), log_path: Path | None = None,
                        ready_timeout_s: float = 30.0, program: Sequence[str] = STORE_PROGRAM) -> StoreProcess:
    """Start a store server (``python -m kvlifecycle.store``, or ``program``: any entry point
    taking its options) with the local backing and ``extra_args``; wait until it answers ``ping``."""
    cmd = [sys.executable, *program, "--endpoint", endpoint, "--dram-bytes", str(dram_bytes)]
    if disk_dir is not None:
        cmd += ["--disk-dir", str(disk_dir)]
    cmd += list(extra_args)
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="kvstore-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    handle = StoreProcess(proc, endpoint, log_path)
    deadline = time.monotonic() + ready_timeout_s
    sock_path = Path(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else None
    while sock_path is not None and not sock_path.exists() and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    probe = StoreProcessClient(endpoint, page_size=2, rpc_timeout_s=0.5, retry_interval_s=0.0)
    try:
        while not probe.ping():
            if proc.poll() is not None or time.monotonic() > deadline:
                handle.kill()
                raise RuntimeError(f"store server did not start ({' '.join(cmd[:6])} ...); log "
                                   f"{log_path}:\n{log_path.read_text()[-2000:]}")
    finally:
        probe.close()
    return handle


@dataclass
class MasterProcess:
    """A ``mooncake_master`` child process (loopback)."""

    proc: subprocess.Popen
    address: str
    log_path: Path

    def stop(self, timeout_s: float = 10.0) -> int:
        return stop_process(self.proc, "mooncake_master", timeout_s)


def start_master(port: int | None = None, log_path: Path | None = None, ready_timeout_s: float = 10.0,
                 extra_args: Sequence[str] = ()) -> MasterProcess:
    """Start ``mooncake_master`` on 127.0.0.1 (a free port unless given) and wait for its port."""
    binary = shutil.which("mooncake_master") or str(Path(os.__file__).parent / "mooncake_master")
    venv_bin = Path(sys.executable).parent / "mooncake_master"
    if venv_bin.exists():
        binary = str(venv_bin)
    port = port or _free_port()
    metrics_port = _free_port()
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    cmd = [binary, f"--rpc_port={port}", f"--metrics_port={metrics_port}", "--rpc_address=127.0.0.1",
           "--enable_metric_reporting=false", *extra_args]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    master = MasterProcess(proc, f"127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + ready_timeout_s
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return master
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                master.stop()
                raise RuntimeError(f"mooncake_master did not start: {log_path.read_text()[-2000:]}")
            time.sleep(0.05)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
