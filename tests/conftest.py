"""Shared fixtures: a real tritonserver (through the launcher) on free loopback ports."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from deploy.launcher import LaunchConfig, Server

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on loopback (bound then released; good enough for tests)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def launch_config(tmp_path: Path, **overrides) -> LaunchConfig:
    http, grpc, metrics = free_ports(3)
    kwargs = dict(http_port=http, grpc_port=grpc, metrics_port=metrics, run_dir=tmp_path / "run",
                  ready_timeout_s=600.0)
    kwargs.update(overrides)
    return LaunchConfig(**kwargs)


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """One tritonserver + host store for the whole session (explicit model control), always stopped."""
    srv = Server(launch_config(tmp_path_factory.mktemp("server"), model_control="explicit"))
    try:
        srv.start()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def reference():
    from compute import load_reference

    return load_reference(str(REPO_ROOT / "model_repository"))
