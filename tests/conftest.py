"""Shared fixtures: a real tritonserver (through the launcher) on free loopback ports.

Ports: `free_ports` picks ports that are free now, at random below the kernel's ephemeral port
range, so that no outgoing connection of this machine (a test's client, a store client) is given
one of them before the server binds it. Another process may still bind one first: `LocalServer`
then starts again on new ports (tritonserver exits with "... already in use"), and checks that
the server it reached is its own tritonserver listening on its ports.
"""
from __future__ import annotations

import random
import socket
from dataclasses import fields
from pathlib import Path

import psutil
import pytest

from deploy.launcher import LaunchConfig, Server
from deploy.runtime.settings import ServingSettings

REPO_ROOT = Path(__file__).resolve().parent.parent

PORT_ATTEMPTS = 3  # starts of one server on fresh ports before a port clash fails the test


def _ephemeral_floor() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports free on loopback now, below the ephemeral range (see the module docstring)."""
    high = _ephemeral_floor() - 1
    low = 10_000 if high > 12_000 else 1_024
    ports: list[int] = []
    while len(ports) < n:
        port = random.randint(low, high)
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


class LocalServer(Server):
    """`Server` whose `start()` moves to fresh ports when tritonserver could not bind one, and
    checks that the ready server is its own tritonserver (not another process on a reused port)."""

    def start(self) -> None:
        for attempt in range(1, PORT_ATTEMPTS + 1):
            try:
                super().start()
            except RuntimeError as e:  # "tritonserver exited with 1 before ...", with the log tail
                if "already in use" not in str(e) or attempt == PORT_ATTEMPTS:
                    raise
                self._new_ports()
                continue
            foreign = self._ports_not_listened_by_triton()
            if not foreign:
                return
            self.stop()
            if attempt == PORT_ATTEMPTS:
                raise RuntimeError(f"tritonserver pid does not listen on port(s) {foreign} after {attempt} starts")
            self._new_ports()

    def _new_ports(self) -> None:
        self.config.http_port, self.config.grpc_port, self.config.metrics_port = free_ports(3)

    def _ports_not_listened_by_triton(self) -> list[int]:
        c = self.config
        listening = {conn.laddr.port for conn in psutil.Process(self.triton.pid).net_connections(kind="inet")
                     if conn.status == psutil.CONN_LISTEN}
        return [p for p in (c.http_port, c.grpc_port, c.metrics_port) if p not in listening]


def launch_config(tmp_path: Path, **overrides) -> LaunchConfig:
    """hstu-serve's defaults on free ports with its run dir in `tmp_path`; `overrides` name fields of
    `LaunchConfig` or of its `ServingSettings` (pool_pages=96, store="none", model_control=...)."""
    serving_names = {f.name for f in fields(ServingSettings)}
    serving = ServingSettings(**{"run_dir": tmp_path / "run", "store": "embedded",
                                 **{k: v for k, v in overrides.items() if k in serving_names}})
    http, grpc, metrics = free_ports(3)
    kwargs = dict(http_port=http, grpc_port=grpc, metrics_port=metrics, ready_timeout_s=600.0)
    kwargs.update({k: v for k, v in overrides.items() if k not in serving_names})
    return LaunchConfig(serving, **kwargs)


def rendered_repository(root: Path, **render: object) -> Path:
    """The real models' version folders (linked) under configs rendered with `render`
    (`deploy.make_configs.render` options: lifecycle_max_batch_size=64, offload_instances=2)."""
    from deploy import make_configs
    from deploy.runtime.settings import DEFAULT_MODEL_DIR, DEFAULT_MODEL_REPOSITORY

    repository = root / "rendered_repository"
    for name, text in make_configs.render(make_configs.num_tasks_of(DEFAULT_MODEL_DIR), **render).items():
        (repository / name).mkdir(parents=True)
        (repository / name / "config.pbtxt").write_text(text)
        version = DEFAULT_MODEL_REPOSITORY / name / "1"
        if version.is_dir():
            (repository / name / "1").symlink_to(version)
    return repository


def start_server(tmp_path: Path, **overrides) -> LocalServer:
    """A started server (host store + tritonserver) on free ports; the caller stops it."""
    srv = LocalServer(launch_config(tmp_path, **overrides))
    srv.start()  # stops what it started when it fails
    return srv


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    """One tritonserver + host store for the whole session (explicit model control), always stopped."""
    srv = start_server(tmp_path_factory.mktemp("server"), model_control="explicit")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def reference():
    from compute import load_reference

    return load_reference(str(REPO_ROOT / "model_repository"))
