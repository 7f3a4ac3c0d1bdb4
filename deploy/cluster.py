"""`hstu-cluster`: N hstu-serve instances sharing one Mooncake host tier, behind a routing proxy.

    client --x-user-id--> nginx (hash $http_x_user_id consistent; grpc_pass + proxy_pass)
                            |-> server 0: tritonserver (hstu_ranking) -> store process --+
                            |-> server 1: ...                                            +--> mooncake_master
                            '-> server N-1                                               +--> memory node(s)

Each server keeps the KV pages of the users routed to it in its own device pool and offloads
them to the shared tier; a user routed elsewhere (a server stopped, or the ring changed) finds
its pages there as host hits instead of recomputing. Each server's Mooncake client lives in its
store process (`--store mooncake`: the models speak the store protocol to it), so a dead master
costs the models a store timeout, never a stall. The store processes give no memory of their
own (`mooncake_segment_bytes=0`): a memory node (`deploy.mooncake_node`) holds every page, so
stopping a server loses none.

Order of operations:
  start: build the model once -> mooncake_master -> memory node -> N servers (in parallel;
         each a `deploy.launcher.Server` with store=mooncake) -> nginx, rendered from
         `deploy/nginx.conf.template` (`deploy.front`, the same front as `hstu-serve --host`)
         -> wait until `hstu_ranking` is ready through the proxy.
  stop:  nginx -> servers (each flushes its pending offloads into the tier, then stops its store
         process) -> memory node -> master. The master goes last, so every offload reaches it and
         no store process has to give up on a gone master while it stops.
The proxy and Mooncake bind to loopback unless `host` says otherwise; the tritonservers always
bind 127.0.0.1 (the proxy is their only way in: it caps what tritonserver cannot take). Every
child runs in its own process group and is stopped with it, so a clean stop leaves no process
behind.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deploy.front import connect_host, render_nginx_conf, write_nginx_conf
from deploy.launcher import ENSEMBLE, LaunchConfig, Server, build_model, wait_until_ready
from deploy.processes import die_with_parent, log_tail, stop_process_group, wait_for
from deploy.runtime.settings import REPO_ROOT
from deploy.serving_options import add_serving_options, serving_settings

logger = logging.getLogger("hstu-cluster")

ROUTE_HEADER = "x-user-id"
SERVER_HOST = "127.0.0.1"  # every tritonserver of the cluster: behind the proxy only


@dataclass
class ClusterConfig:
    num_servers: int = 2
    host: str = "127.0.0.1"  # the proxy's and Mooncake's address; loopback by default (servers: always loopback)
    http_port: int = 8000  # the proxy's HTTP port (/generate)
    grpc_port: int = 8001  # the proxy's gRPC port (streams)
    base_port: int = 8100  # server i listens on base_port + 3i (HTTP), +1 (gRPC), +2 (metrics)
    server_ports: list[tuple[int, int, int]] = field(default_factory=list)  # explicit (http, grpc, metrics)
    mooncake_port: int = 50051
    segment_bytes: int = 1 << 30  # host memory of the memory node: the shared tier's capacity
    run_dir: Path | None = None  # default: a fresh directory under /tmp
    # template for every server (device, pool, timeouts); the cluster sets each one's run dir, ports and store
    server: LaunchConfig = field(default_factory=LaunchConfig)
    nginx: str = "nginx"
    ready_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.num_servers < 1:
            raise ValueError(f"num_servers={self.num_servers}: expected >= 1")
        if self.server_ports and len(self.server_ports) != self.num_servers:
            raise ValueError(f"server_ports: {len(self.server_ports)} entries for {self.num_servers} servers")
        if self.segment_bytes <= 0:
            raise ValueError(f"segment_bytes={self.segment_bytes}: the memory node needs some memory")

    def ports(self, i: int) -> tuple[int, int, int]:
        if self.server_ports:
            return self.server_ports[i]
        base = self.base_port + 3 * i
        return base, base + 1, base + 2


class Cluster:
    """The Mooncake master, a memory node, N servers and nginx, as one unit with `start()` / `stop()`."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="hstu-cluster-"))
        self.master: Any = None  # kvlifecycle.store.processes.MasterProcess
        self.node: subprocess.Popen | None = None
        self.nginx: subprocess.Popen | None = None
        self.servers: list[Server] = []
        self._release = threading.Event()  # lets the threads that started the servers end
        for i in range(config.num_servers):
            http, grpc, metrics = config.ports(i)
            serving = replace(config.server.serving, run_dir=self.run_dir / f"server-{i}", store="mooncake",
                              store_endpoint=self.master_address, mooncake_segment_bytes=0,
                              mooncake_local_hostname=config.host)
            self.servers.append(Server(replace(config.server, serving=serving, host=SERVER_HOST, http_port=http,
                                               grpc_port=grpc, metrics_port=metrics)))

    # ---- public API -------------------------------------------------------------------------

    @property
    def master_address(self) -> str:
        return f"{self.config.host}:{self.config.mooncake_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"{self.config.host}:{self.config.http_port}"

    @property
    def nginx_dir(self) -> Path:
        return self.run_dir / "nginx"

    @property
    def access_log(self) -> Path:
        """One line per proxied request (per gRPC stream): `user=<x-user-id> upstream=<host:port>`."""
        return self.nginx_dir / "access.log"

    def start(self) -> None:
        # 0711: nginx's workers (user nobody when started as root) reach their temp dirs inside.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.run_dir, 0o711)
        try:
            nginx_cmd = self._write_nginx_conf()  # a bad config fails before anything starts
            settings = self.servers[0].settings
            build_model(settings.model_dir, settings.device)
            self._start_master()
            self._start_node()
            self._start_servers()
            self._start_nginx(nginx_cmd)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """nginx, then the servers (they flush into the tier), then the memory node, then the master."""
        if self.nginx is not None:
            stop_process_group(self.nginx, "nginx", 10)
            self.nginx = None
        threads = [threading.Thread(target=srv.stop) for srv in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._release.set()
        if self.node is not None:
            stop_process_group(self.node, "mooncake memory node", 30)
            self.node = None
        if self.master is not None:
            self.master.stop()
            self.master = None

    def stop_server(self, i: int) -> None:
        """Stop server i (it flushes its offloads); the proxy sends its users to the others."""
        self.servers[i].stop()

    def process_ids(self) -> list[int]:
        """Pids of every child still tracked (for checks that a stop left nothing behind)."""
        pids = [p.pid for p in (self.nginx, self.node) if p is not None]
        pids += [srv.triton.pid for srv in self.servers if srv.triton is not None]
        pids += [srv.store.pid for srv in self.servers if srv.store is not None]
        if self.master is not None:
            pids.append(self.master.proc.pid)
        return pids

    def render_nginx_conf(self) -> str:
        c = self.config
        return render_nginx_conf(
            self.nginx_dir, c.host, c.http_port, c.grpc_port,
            http_servers=[f"{SERVER_HOST}:{c.ports(i)[0]}" for i in range(c.num_servers)],
            grpc_servers=[f"{SERVER_HOST}:{c.ports(i)[1]}" for i in range(c.num_servers)])

    def watch(self) -> list[int]:
        """One supervision step: the indexes of servers whose tritonserver has exited."""
        return [i for i, srv in enumerate(self.servers) if srv.watch() is not None]

    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- helpers ----------------------------------------------------------------------------

    def _start_master(self) -> None:
        from kvlifecycle.store.processes import start_master

        self.master = start_master(self.config.mooncake_port, log_path=self.run_dir / "mooncake-master.log",
                                   ready_timeout_s=30.0)
        logger.info("mooncake_master pid %d on %s", self.master.proc.pid, self.master.address)

    def _start_node(self) -> None:
        log_path = self.run_dir / "mooncake-node.log"
        cmd = [sys.executable, "-m", "deploy.mooncake_node", "--master", self.master_address,
               "--segment-bytes", str(self.config.segment_bytes), "--local-hostname", self.config.host]
        log = open(log_path, "ab")
        self.node = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                     start_new_session=True, preexec_fn=die_with_parent)
        wait_for(lambda: self.node.poll() is not None or b"ready" in log_path.read_bytes(), 60,
                  "the mooncake memory node")
        if self.node.poll() is not None:
            raise RuntimeError(f"mooncake memory node exited with {self.node.returncode}:\n{log_tail(log_path)}")
        logger.info("mooncake memory node pid %d (%d bytes)", self.node.pid, self.config.segment_bytes)

    def _start_servers(self) -> None:
        """Start every server at once, each from its own thread. The launcher's children get
        SIGTERM when the *thread* that started them exits (PR_SET_PDEATHSIG), so each thread
        then parks until `stop()` (daemon: it dies with this process, and so do its children)."""
        errors: list[BaseException] = []
        started = [threading.Event() for _ in self.servers]

        def start(i: int, srv: Server) -> None:
            try:
                srv.start()
            except BaseException as e:  # reported below; start() already stopped that server
                errors.append(e)
            finally:
                started[i].set()
            self._release.wait()

        for i, srv in enumerate(self.servers):
            threading.Thread(target=start, args=(i, srv), name=f"server-{i}", daemon=True).start()
        for event in started:
            event.wait()
        if errors:
            raise errors[0]

    def _write_nginx_conf(self) -> list[str]:
        """Render and check nginx.conf; the command that runs nginx on it."""
        return write_nginx_conf(self.nginx_dir, self.render_nginx_conf(), self.config.nginx)

    def _start_nginx(self, cmd: list[str]) -> None:
        self.nginx = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True, preexec_fn=die_with_parent)
        logger.info("nginx pid %d: gRPC %s, HTTP %s", self.nginx.pid, self.grpc_url, self.http_url)

    def _wait_ready(self) -> None:
        url = f"http://{connect_host(self.config.host)}:{self.config.http_port}/v2/models/{ENSEMBLE}/ready"

        def check_alive() -> None:
            if self.nginx.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.nginx.returncode}:\n"
                                   f"{log_tail(self.nginx_dir / 'error.log')}")

        if not wait_until_ready(url, self.config.ready_timeout_s, check_alive, interval_s=0.2):
            raise TimeoutError(f"{ENSEMBLE} not ready through the proxy after {self.config.ready_timeout_s:.0f}s")


# ---- command line ------------------------------------------------------------------------------

CLUSTER_OPTIONS = ("device", "pool_pages", "lease_ttl_s", "store_timeout_s", "min_host_pages",
                   "cuda_graphs")  # ServingSettings options of every server


def parse_args(argv: list[str] | None = None) -> ClusterConfig:
    p = argparse.ArgumentParser(prog="hstu-cluster", description=__doc__.split("\n")[0])
    p.add_argument("--servers", type=int, default=2, help="number of tritonservers")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the proxy and Mooncake bind to (default loopback); tritonservers: 127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000, help="the proxy's HTTP port")
    p.add_argument("--grpc-port", type=int, default=8001, help="the proxy's gRPC port")
    p.add_argument("--base-port", type=int, default=8100,
                   help="server i uses base+3i (HTTP), base+3i+1 (gRPC), base+3i+2 (metrics)")
    p.add_argument("--mooncake-port", type=int, default=50051)
    p.add_argument("--segment-bytes", type=int, default=1 << 30, help="host memory of the shared tier")
    add_serving_options(p, CLUSTER_OPTIONS)
    p.add_argument("--run-dir", type=Path, help="logs, sockets and nginx.conf (default: a new dir under /tmp)")
    a = p.parse_args(argv)
    try:
        server = LaunchConfig(serving=serving_settings(a, CLUSTER_OPTIONS))  # run dir and store: per server
    except ValueError as e:
        p.error(str(e))
    return ClusterConfig(num_servers=a.servers, host=a.host, http_port=a.http_port, grpc_port=a.grpc_port,
                         base_port=a.base_port, mooncake_port=a.mooncake_port, segment_bytes=a.segment_bytes,
                         run_dir=a.run_dir, server=server)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cluster = Cluster(parse_args(argv))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        cluster.start()
        print(json.dumps({"grpc": cluster.grpc_url, "http": f"http://{cluster.http_url}",
                          "route_header": ROUTE_HEADER, "mooncake_master": cluster.master_address,
                          "servers": [{"grpc": s.grpc_url, "metrics": s.metrics_url} for s in cluster.servers],
                          "model": ENSEMBLE, "logs": str(cluster.run_dir)}), flush=True)
        print(f"hstu-cluster: {len(cluster.servers)} servers behind {cluster.grpc_url}; Ctrl-C to stop", flush=True)
        dead: set[int] = set()
        while not stop.wait(1.0):
            for i in set(cluster.watch()) - dead:
                logger.error("server %d exited; its users go to the others:\n%s", i,
                             log_tail(cluster.servers[i].triton_log))
                dead.add(i)
            if cluster.nginx is not None and cluster.nginx.poll() is not None:
                logger.error("nginx exited with %s:\n%s", cluster.nginx.returncode,
                             log_tail(cluster.nginx_dir / "error.log"))
                return 1
            if len(dead) == len(cluster.servers):
                return 1
        return 0
    finally:
        cluster.stop()
        logger.info("stopped")


if __name__ == "__main__":
    sys.exit(main())
