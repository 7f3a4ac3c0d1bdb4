"""The GIL switch interval of a process whose background thread is on the request path.

CPython hands the GIL to a waiting thread only once per switch interval (5 ms by default) while
another thread runs Python code. kv_lookup_alloc answers the control plane (kv_offload's commit,
on every request's path) from a background thread while its `execute` runs; kv_offload's
`execute` shares its process with the offload worker; the host store's socket thread answers
`get_prefix` (on a host hit's path) while its copy thread hashes and copies pages. With the
default, such a call could wait up to 5 ms for the GIL. `deploy/bench/control.py` measures it: a
control round trip against an owner 70% busy in Python went from a mean of 1.17 to 0.31 ms and a
p90 of 2.80 to 0.60 ms on the 2-core CPU machine (deploy/reports/control-2026-12-03-cpu.json).
"""
from __future__ import annotations

import sys

SWITCH_INTERVAL_S = 0.0002  # forced switches this often cost ~1% of a busy thread's time


def hand_over_gil_promptly(interval_s: float = SWITCH_INTERVAL_S) -> None:
    """Let a waiting thread take the GIL within `interval_s` (process-wide: call it in `initialize`)."""
    sys.setswitchinterval(interval_s)
