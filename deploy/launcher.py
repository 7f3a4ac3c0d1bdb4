"""The hstu-serve supervisor: `Server` builds the model if needed, starts the host store and
tritonserver, and stops both cleanly (the command line is `deploy/serve_cli.py`).

Order of operations:
  start: build AOTI package (skipped when up to date) -> run dir (0700) -> host store process
         -> tritonserver on `model_repository/` -> [nginx front] -> wait until `hstu_ranking`
         is ready.
  run:   restart the host store if it dies (kv_offload and kv_lookup_alloc fail open meanwhile).
  stop:  [SIGTERM nginx] -> SIGTERM tritonserver (it unloads the models; kv_offload's finalize
         flushes pending offloads) and wait -> SIGTERM the store (it flushes its disk write-behind
         queue).
Beyond loopback (`--host` neither localhost nor a loopback address), HTTP and gRPC are served by
an nginx front on HOST (`deploy/front.py`, the same front as `hstu-cluster`'s): it caps HTTP bodies
(tritonserver 2.51 segfaults on a form-encoded body over about 4 MB) and headers, times out slow
clients, checks /infer and /generate bodies (deeply nested JSON also crashes tritonserver; a
mistyped ranking input gets a 400 naming it), and refuses the administration and shared-memory
APIs. tritonserver itself, and its metrics port, stay on 127.0.0.1.
Children run in their own process groups and get SIGTERM if the launcher dies, so a Ctrl-C or a
crash leaves no tritonserver, stub, store or nginx process behind.
"""
from __future__ import annotations

import logging
import secrets
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import psutil

from deploy.front import connect_host, is_loopback, render_nginx_conf, write_nginx_conf
from deploy.processes import die_with_parent, free_loopback_ports, log_tail, stop_process_group, wait_for
from deploy.runtime.settings import DEFAULT_MODEL_REPOSITORY, REPO_ROOT, ServingSettings
from deploy.triton_env import find_triton, install_stub, triton_env
from kvlifecycle.store.flexkv import flexkv_unavailable_reason

logger = logging.getLogger("hstu-serve")

ENSEMBLE = "hstu_ranking"
TRITON_HOST = "127.0.0.1"  # where tritonserver listens when the nginx front serves --host
STORE_PROCESS_KINDS = ("embedded", "mooncake", "flexkv")  # --store values served by a store process hstu-serve starts


@dataclass
class LaunchConfig:
    """How hstu-serve starts and exposes one server. `serving` is what every model process reads (the
    launcher hands it to them as HSTU_* variables); the other fields are the launcher's own."""

    serving: ServingSettings = field(default_factory=lambda: ServingSettings(run_dir=new_run_dir(), store="embedded"))
    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    host: str = "127.0.0.1"  # loopback by default; beyond loopback, the nginx front serves HTTP and gRPC
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002  # always tritonserver's own; on 127.0.0.1 when the front serves
    # tritonserver's own loopback ports behind the front (0: free ports picked at each start)
    triton_http_port: int = 0
    triton_grpc_port: int = 0
    nginx: str = "nginx"
    store_dram_bytes: int = 2 << 30  # the embedded store's DRAM tier
    store_disk_dir: Path | None = None  # the embedded store's disk tier (none by default)
    # The disk tier's capacity (least recently used pages go first): unbounded, a stress of an hour
    # wrote 20 GB of pages.
    store_disk_bytes: int = 16 << 30
    model_control: str = "none"  # "explicit" lets clients load/unload models
    ready_timeout_s: float = 300.0
    exit_timeout_s: int = 60
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.model_control not in ("none", "explicit"):
            raise ValueError(f"model_control={self.model_control!r}: expected 'none' or 'explicit'")
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise ValueError(f"{name}={port}: expected a TCP port in 1..65535")
        for name in ("triton_http_port", "triton_grpc_port"):
            port = getattr(self, name)
            if not 0 <= port < 65536:
                raise ValueError(f"{name}={port}: expected a TCP port in 1..65535, or 0 for a free one")
        if self.store_disk_bytes <= 0:
            raise ValueError(f"store_disk_bytes={self.store_disk_bytes}: expected the disk tier's capacity in bytes (> 0)")

    @property
    def fronted(self) -> bool:
        """True when HTTP and gRPC go through the nginx front (`host` beyond loopback)."""
        return not is_loopback(self.host)


class Server:
    """The host store plus tritonserver, as one unit with `start()` / `stop()`."""

    def __init__(self, config: LaunchConfig):
        self.config = config
        self.triton: subprocess.Popen | None = None
        self.store: subprocess.Popen | None = None
        self.front: subprocess.Popen | None = None  # nginx, when config.fronted
        self.exited: tuple[str, Path] | None = None  # (name, log) of the child whose death watch() reported
        self.triton_ports: tuple[int, int] | None = None  # tritonserver's (HTTP, gRPC) behind the front
        self._store_restarts = 0
        self._lock = threading.Lock()

    # ---- public API -------------------------------------------------------------------------

    @property
    def settings(self) -> ServingSettings:
        return self.config.serving

    @property
    def run_dir(self) -> Path:
        """Sockets, the pool handle and logs: private to this user (0700)."""
        return self.settings.run_dir

    @property
    def http_url(self) -> str:
        return f"{self.config.host}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.config.host}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str:
        host = TRITON_HOST if self.config.fronted else self.config.host
        return f"http://{host}:{self.config.metrics_port}/metrics"

    @property
    def nginx_dir(self) -> Path:
        """The front's nginx.conf, error.log and access.log (one line per request or gRPC stream)."""
        return self.run_dir / "nginx"

    @property
    def triton_log(self) -> Path:
        return self.run_dir / "tritonserver.log"

    @property
    def store_log(self) -> Path:
        return self.run_dir / "store.log"

    def start(self) -> None:
        if self.settings.store == "flexkv" and (reason := flexkv_unavailable_reason()) is not None:
            raise RuntimeError(f"--store flexkv: {reason}")  # before anything starts
        self.settings.prepare_run_dir()
        nginx_cmd = self._write_front_conf() if self.config.fronted else None  # fails before anything starts
        build_model(self.settings.model_dir, self.settings.device)
        try:
            if self.settings.store in STORE_PROCESS_KINDS:
                self.start_store()
            self._start_triton()
            if nginx_cmd is not None:
                self._start_front(nginx_cmd)
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the front (no new requests), then tritonserver (models flush their offloads), then the store."""
        with self._lock:
            if self.front is not None:
                stop_process_group(self.front, "nginx", 10)
                self.front = None
            if self.triton is not None:
                stop_process_group(self.triton, "tritonserver", self.config.exit_timeout_s + 10,
                           finished=lambda: _models_unloaded(self.triton))
                self.triton = None
            self.stop_store()

    def start_store(self) -> None:
        """Start the host store process (`watch()` restarts it after it died)."""
        if self.store is not None and self.store.poll() is None:
            raise RuntimeError(f"host store pid {self.store.pid} is still running; stop or kill it first")
        cmd = self.store_command()
        sock = Path(self.settings.store_socket.removeprefix("ipc://"))
        # A killed store leaves its socket file behind; without this the wait below would pass at once.
        sock.unlink(missing_ok=True)
        log = open(self.store_log, "ab")
        self.store = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                      start_new_session=True, preexec_fn=die_with_parent)
        wait_for(lambda: sock.exists() or self.store.poll() is not None, 30, "host store socket")
        if self.store.poll() is not None:
            raise RuntimeError(f"host store exited with {self.store.returncode}:\n{log_tail(self.store_log)}")
        logger.info("host store pid %d on %s", self.store.pid, self.settings.store_socket)

    def stop_store(self) -> None:
        if self.store is not None:
            stop_process_group(self.store, "host store", 30)
            self.store = None

    def watch(self) -> int | None:
        """One supervision step: restart a dead store; return tritonserver's (or the front's) exit
        code if it died (`self.exited` then names it and its log)."""
        with self._lock:
            if self.store is not None and self.store.poll() is not None:
                self._store_restarts += 1
                logger.warning("host store exited with %s; restarting (restart #%d)",
                               self.store.returncode, self._store_restarts)
                self.start_store()
            for proc, name, log in ((self.triton, "tritonserver", self.triton_log),
                                    (self.front, "nginx", self.nginx_dir / "error.log")):
                if proc is not None and proc.poll() is not None:
                    self.exited = (name, log)
                    return proc.returncode
        return None

    def __enter__(self) -> "Server":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- helpers ----------------------------------------------------------------------------

    def store_command(self) -> list[str]:
        """The host store process's full command line (also what `--print-env` prints). mooncake:
        the store process holds the Mooncake client (the models only ever see a store timeout when
        the master is gone) and keeps pages in the tier behind the master at `store_endpoint`."""
        s = self.settings
        if s.store == "flexkv":  # FlexKV's own store process (kvlifecycle/store/flexkv.py)
            return [sys.executable, "-m", "kvlifecycle.store.flexkv", "--endpoint", s.store_socket,
                    "--dram-bytes", str(self.config.store_dram_bytes)]
        cmd = [sys.executable, "-m", "kvlifecycle.store", "--endpoint", s.store_socket]
        if s.store == "mooncake":
            return cmd + ["--backing", "mooncake", "--mooncake-master", s.store_endpoint,
                          "--mooncake-segment-bytes", str(s.mooncake_segment_bytes),
                          "--mooncake-local-hostname", s.mooncake_local_hostname]
        cmd += ["--dram-bytes", str(self.config.store_dram_bytes)]
        if self.config.store_disk_dir:
            cmd += ["--disk-dir", str(self.config.store_disk_dir), "--disk-bytes", str(self.config.store_disk_bytes)]
        return cmd

    def triton_command(self) -> list[str]:
        install = find_triton()
        c = self.config
        if c.fronted:
            host, (http, grpc) = TRITON_HOST, self._triton_ports()
        else:
            host, http, grpc = c.host, c.http_port, c.grpc_port
        cmd = [
            str(install.binary),
            f"--model-repository={c.model_repository}",
            f"--backend-directory={install.backend_dir}",
            f"--http-address={host}", f"--http-port={http}",
            f"--grpc-address={host}", f"--grpc-port={grpc}",
            f"--metrics-address={host}", f"--metrics-port={c.metrics_port}",
            f"--exit-timeout-secs={c.exit_timeout_s}",
            "--log-verbose=0",
        ]
        if c.model_control == "explicit":
            cmd += ["--model-control-mode=explicit", "--load-model=*"]
        return cmd

    def front_conf(self) -> str:
        """The front's nginx.conf: HOST:http_port and :grpc_port -> tritonserver on 127.0.0.1."""
        c = self.config
        http, grpc = self._triton_ports()
        return render_nginx_conf(self.nginx_dir, c.host, c.http_port, c.grpc_port,
                                 http_servers=[f"{TRITON_HOST}:{http}"], grpc_servers=[f"{TRITON_HOST}:{grpc}"])

    def _triton_ports(self) -> tuple[int, int]:
        """tritonserver's HTTP and gRPC ports behind the front (configured, or free ones picked once)."""
        if self.triton_ports is None:
            c = self.config
            free = iter(free_loopback_ports(2))
            self.triton_ports = (c.triton_http_port or next(free), c.triton_grpc_port or next(free))
        return self.triton_ports

    def _write_front_conf(self) -> list[str]:
        if not (self.config.triton_http_port and self.config.triton_grpc_port):
            self.triton_ports = None  # free ports picked again: the last ones may be taken now
        return write_nginx_conf(self.nginx_dir, self.front_conf(), self.config.nginx)

    def _start_front(self, cmd: list[str]) -> None:
        self.front = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO_ROOT,
                                      start_new_session=True, preexec_fn=die_with_parent)
        c = self.config
        logger.info("nginx front pid %d on %s (HTTP %d, gRPC %d) -> tritonserver on %s:%d/%d",
                    self.front.pid, c.host, c.http_port, c.grpc_port, TRITON_HOST, *self._triton_ports())

    def environment(self) -> dict[str, str]:
        install = find_triton()
        install_stub(install)
        env = triton_env(install)
        env.update(self.settings.to_env())
        env.update(self.config.extra_env)
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _start_triton(self) -> None:
        cmd = self.triton_command()
        log = open(self.triton_log, "ab")
        logger.info("starting %s", shlex.join(cmd))
        self.triton = subprocess.Popen(cmd, env=self.environment(), stdout=log, stderr=subprocess.STDOUT,
                                       cwd=REPO_ROOT, start_new_session=True, preexec_fn=die_with_parent)

    def _wait_ready(self) -> None:
        """Until `hstu_ranking` is ready, asked through the front when there is one."""
        url = f"http://{connect_host(self.config.host)}:{self.config.http_port}/v2/models/{ENSEMBLE}/ready"

        def check_alive() -> None:
            if self.triton.poll() is not None:
                raise RuntimeError(f"tritonserver exited with {self.triton.returncode} before "
                                   f"{ENSEMBLE} was ready; log tail ({self.triton_log}):\n{log_tail(self.triton_log)}")
            if self.front is not None and self.front.poll() is not None:
                log = self.nginx_dir / "error.log"
                raise RuntimeError(f"nginx exited with {self.front.returncode} before {ENSEMBLE} was ready; "
                                   f"log tail ({log}):\n{log_tail(log)}")

        if wait_until_ready(url, self.config.ready_timeout_s, check_alive):
            logger.info("%s ready", ENSEMBLE)
            return
        raise TimeoutError(f"{ENSEMBLE} not ready after {self.config.ready_timeout_s:.0f}s; "
                           f"log tail ({self.triton_log}):\n{log_tail(self.triton_log)}")


def wait_until_ready(url: str, timeout_s: float, check_alive: Callable[[], None], interval_s: float = 0.5) -> bool:
    """Poll a readiness `url` until it answers 200 (True) or `timeout_s` passes (False).
    `check_alive()` runs before each poll and raises when a process the caller waits on died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        check_alive()
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(interval_s)
    return False


def new_run_dir() -> Path:
    """A fresh run dir path under the temp dir (created 0700 at start, by `prepare_run_dir`)."""
    return Path(tempfile.gettempdir()) / f"hstu-serve-{secrets.token_hex(6)}"


def build_model(model_dir: Path, device: str) -> None:
    """Run `hstu-build` on `model_dir` (a no-op when the AOTI package is up to date)."""
    # `hstu-build`, spelled so that it also runs where the project is not pip-installed (GPU host).
    cmd = [sys.executable, "-c", "import sys; from compute.build import main; sys.exit(main(sys.argv[1:]))",
           "--model-dir", str(model_dir), "--device", device]
    logger.info("building model: %s", shlex.join(cmd))
    subprocess.run(cmd, check=True, cwd=REPO_ROOT)


def _models_unloaded(triton: subprocess.Popen) -> bool:
    """True once tritonserver has no model stub left: every Python model has finalized (kv_offload
    has flushed its offloads). tritonserver may still wait out --exit-timeout-secs for a client's
    idle gRPC stream, which keeps the ensemble (it holds nothing) live; that wait protects nothing."""
    try:
        children = psutil.Process(triton.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return True
    return not any(_is_stub(child) for child in children)


def _is_stub(process: psutil.Process) -> bool:
    try:
        return process.name().startswith("triton_python_b")  # the stub's name, cut to 15 characters
    except psutil.NoSuchProcess:
        return False
