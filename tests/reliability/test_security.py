"""Security: loopback only, private ipc sockets, and no pickle over any socket.

- every listening TCP socket of tritonserver, its stubs and the host store is on 127.0.0.1;
- the run directory holding the store's and the control plane's ipc sockets is 0700, and the
  store refuses to bind in a directory others can enter;
- no code of kvlifecycle/ or deploy/ unpickles (or pickles) anything; a pickled payload sent to
  the store's and the control plane's sockets is answered BAD_REQUEST, is never unpickled (its
  side effect never happens), and the server keeps serving.
"""
from __future__ import annotations

import ipaddress
import json
import os
import pickle
import re
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import zmq

from deploy.launcher import Server
from kvlifecycle.control import ControlClient
from kvlifecycle.rpc import RpcStatus
from kvlifecycle.store import open_store
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.integration


def server_processes(server: Server) -> list[psutil.Process]:
    triton = psutil.Process(server.triton.pid)
    return [triton, *triton.children(recursive=True), psutil.Process(server.store.pid)]


def test_every_listening_socket_is_on_loopback(server: Server) -> None:
    listening = []
    for proc in server_processes(server):
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.append((proc.name(), conn.laddr.ip, conn.laddr.port))
    ports = {port for _, _, port in listening}
    expected = {server.config.http_port, server.config.grpc_port, server.config.metrics_port}
    assert expected <= ports, f"expected the HTTP, gRPC and metrics ports {expected} listening, got {listening}"
    exposed = [entry for entry in listening if _ipv4(entry[1]) != "127.0.0.1"]
    assert not exposed, f"listening beyond loopback: {exposed}"


def _ipv4(address: str) -> str:
    """'::ffff:127.0.0.1' (IPv4 on a dual-stack socket) is 127.0.0.1; any other IPv6 address stays as is."""
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return str(mapped or ip)


def test_ipc_sockets_live_in_a_private_directory(server: Server) -> None:
    for endpoint in (server.settings.store_endpoint, server.settings.control_endpoint):
        path = Path(endpoint.removeprefix("ipc://"))
        assert path.exists() and stat.S_ISSOCK(path.stat().st_mode), f"{endpoint}: no socket"
        mode = stat.S_IMODE(path.parent.stat().st_mode)
        assert mode == 0o700, f"{path.parent}: mode {mode:o}, expected 700"
        assert path.parent.stat().st_uid == os.getuid()


def test_store_refuses_a_socket_directory_others_can_enter(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    out = subprocess.run([sys.executable, "-m", "kvlifecycle.store", "--endpoint", f"ipc://{shared}/store.sock",
                          "--dram-bytes", str(1 << 20)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "chmod 700" in out.stderr, out.stderr[-2000:]
    assert not (shared / "store.sock").exists()


# Serializers that run code or build arbitrary objects when reading; none may touch a socket's bytes.
UNSAFE = re.compile(r"\b(import pickle|from pickle|cPickle|cloudpickle|dill|marshal\.loads|recv_pyobj|send_pyobj|"
                    r"pickle\.loads?|torch\.load|allow_pickle\s*=\s*True|shelve|jsonpickle|"
                    r"yaml\.load\b|yaml\.unsafe_load)")


@pytest.mark.parametrize("package", ["kvlifecycle", "deploy"])
def test_no_pickle_in_socket_code(package: str) -> None:
    hits = []
    for path in sorted((REPO_ROOT / package).rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if UNSAFE.search(code) and not code.lstrip().startswith(('"', "'")):
                hits.append(f"{path.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    assert not hits, "unsafe deserialization in " + package + ":\n" + "\n".join(hits)


class _Exploit:
    """Unpickling this makes a directory: proof that the receiver ran pickle.loads."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _send_raw(endpoint: str, frames: list[bytes], timeout_s: float = 30.0) -> list[bytes]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart(frames)
        assert sock.poll(int(timeout_s * 1000), zmq.POLLIN), f"{endpoint}: no reply to a pickled payload"
        return sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


def test_store_answers_a_pickled_payload_bad_request_and_keeps_serving(server: Server, tmp_path: Path) -> None:
    marker = tmp_path / "store-unpickled"
    for payload in (pickle.dumps(_Exploit(marker)), pickle.dumps({"v": 1, "op": "ping", "seq": 1, "arrays": []})):
        reply = _send_raw(server.settings.store_endpoint, [b"", payload])
        header = json.loads(reply[-1] if len(reply) == 1 else reply[1])
        assert RpcStatus(header["rpc"]) is RpcStatus.BAD_REQUEST, header
    assert not marker.exists(), "the store unpickled a payload"
    store = open_store("embedded", endpoint=server.settings.store_endpoint, page_size=32, rpc_timeout_s=10.0)
    try:
        assert store.ping(), "the store stopped answering after a pickled payload"
    finally:
        store.close()
    assert server.store.poll() is None


def test_control_plane_answers_a_pickled_payload_bad_request_and_keeps_serving(server: Server,
                                                                               tmp_path: Path) -> None:
    marker = tmp_path / "control-unpickled"
    for payload in (pickle.dumps(_Exploit(marker)), pickle.dumps({"seq": 1, "op": "abort", "args": {"lease_id": 1}})):
        reply = json.loads(_send_raw(server.settings.control_endpoint, [b"", payload])[-1])
        assert RpcStatus(reply["rpc"]) is RpcStatus.BAD_REQUEST, reply
    assert not marker.exists(), "the control plane unpickled a payload"
    with ControlClient(server.settings.control_endpoint, timeout_s=10.0) as control:
        assert control.ping(), "the control plane stopped answering after a pickled payload"
