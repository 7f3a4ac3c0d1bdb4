"""Child processes of the operator tools (hstu-serve, hstu-cluster): start them so that they die
with their parent, stop a child's whole process group, wait for one to come up, show its log.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

logger = logging.getLogger("hstu-serve")

FINISHED_GRACE_S = 2.0  # a server whose work is done gets this long to exit by itself


def free_loopback_ports(n: int) -> list[int]:
    """n distinct TCP ports free on loopback now (bound, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this child when the launcher dies (Linux prctl PR_SET_PDEATHSIG);
    a `preexec_fn` for `subprocess.Popen`.

    The signal fires when the *thread* that started the child exits: start a `Server` from a
    thread that lives as long as the server (the main thread, in hstu-serve)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def stop_process_group(proc: subprocess.Popen, name: str, timeout_s: float,
                       finished: Callable[[], bool] | None = None) -> None:
    """SIGTERM the child's process group, wait (until `finished()` has held for a grace period, if
    given), then SIGKILL whatever is left of the group.

    Not `kvlifecycle.store.processes.stop_process`: that one signals the child alone, and these
    children (tritonserver, nginx, a store) lead groups of stubs and workers."""
    if proc.poll() is None:
        logger.info("stopping %s (pid %d)", name, proc.pid)
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        finished_since = None
        while proc.poll() is None and time.monotonic() < deadline:
            if finished is not None and finished():
                finished_since = finished_since or time.monotonic()
                if time.monotonic() - finished_since > FINISHED_GRACE_S:
                    logger.info("%s: its work is done; ending its exit wait", name)
                    break
            else:
                finished_since = None
            time.sleep(0.1)
        if proc.poll() is None and finished_since is None:
            logger.warning("%s did not stop within %.0fs; killing it", name, timeout_s)
    # Stubs and helpers share the child's process group; none may outlive it.
    _signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `predicate` until it holds; TimeoutError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
