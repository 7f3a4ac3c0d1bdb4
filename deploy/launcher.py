"""`hstu-serve`: build the model if needed, start the host store and tritonserver, stop both cleanly.

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

import argparse
import ctypes
import json
import logging
import os
import secrets
import shlex
import shutil
import signal
import socket
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

from deploy.front import (MAX_BODY_SIZE, MAX_HEADER_SIZE, MAX_JSON_DEPTH, connect_host, human_size, is_loopback,
                          nginx_command, render_nginx_conf, write_nginx_conf)
from deploy.runtime.settings import DEFAULT_MODEL_REPOSITORY, REPO_ROOT, ServingSettings
from deploy.serving_options import add_serving_options, serving_settings
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
                _terminate(self.front, "nginx", 10)
                self.front = None
            if self.triton is not None:
                _terminate(self.triton, "tritonserver", self.config.exit_timeout_s + 10,
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
                                      start_new_session=True, preexec_fn=_die_with_parent)
        _wait_for(lambda: sock.exists() or self.store.poll() is not None, 30, "host store socket")
        if self.store.poll() is not None:
            raise RuntimeError(f"host store exited with {self.store.returncode}:\n{log_tail(self.store_log)}")
        logger.info("host store pid %d on %s", self.store.pid, self.settings.store_socket)

    def stop_store(self) -> None:
        if self.store is not None:
            _terminate(self.store, "host store", 30)
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
            cmd += ["--disk-dir", str(self.config.store_disk_dir)]
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
                                      start_new_session=True, preexec_fn=_die_with_parent)
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
                                       cwd=REPO_ROOT, start_new_session=True, preexec_fn=_die_with_parent)

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


def free_loopback_ports(n: int) -> list[int]:
    """n distinct TCP ports free on loopback now (bound, then released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind((TRITON_HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM this child when the launcher dies (Linux prctl PR_SET_PDEATHSIG).

    The signal fires when the *thread* that started the child exits: start a `Server` from a
    thread that lives as long as the server (the main thread, in hstu-serve)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def _terminate(proc: subprocess.Popen, name: str, timeout_s: float,
               finished: Callable[[], bool] | None = None) -> None:
    """SIGTERM the child's process group, wait (until `finished()` has held for a grace period, if
    given), then SIGKILL whatever is left of the group."""
    if proc.poll() is None:
        logger.info("stopping %s (pid %d)", name, proc.pid)
        _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        finished_since = None
        while proc.poll() is None and time.monotonic() < deadline:
            if finished is not None and finished():
                finished_since = finished_since or time.monotonic()
                if time.monotonic() - finished_since > _FINISHED_GRACE_S:
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


_FINISHED_GRACE_S = 2.0  # a server whose work is done gets this long to exit by itself


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


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def _wait_for(predicate, timeout_s: float, what: str) -> None:
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


# ---- command line ------------------------------------------------------------------------------

EPILOG = f"""\
beyond loopback (--host neither localhost nor a loopback address such as 127.0.0.1 or ::1):
  an nginx front (deploy/nginx.conf.template, the same as hstu-cluster's; deploy/setup.sh
  installs nginx-light) listens on HOST:--http-port and HOST:--grpc-port and forwards to
  tritonserver on 127.0.0.1 (--triton-http-port, --triton-grpc-port). tritonserver 2.51 has
  no request limits and crashes on some bodies; the front answers
  - 413 to an HTTP body over {human_size(MAX_BODY_SIZE)} (tritonserver segfaults on a form-encoded body
    over about 4 MB);
  - 400 to an /infer or /generate body that is not a JSON object nested at most {MAX_JSON_DEPTH}
    deep (tritonserver segfaults on an input's data nested ~100,000 lists deep), and 400
    naming the input to a ranking input of the wrong JSON type (tritonserver: 500, no name);
  - 400 to a header line over {human_size(MAX_HEADER_SIZE)}; it drops clients that stall (request header
    10 s, HTTP body 30 s; a gRPC stream may idle 1 h);
  - 403 to the administration and shared-memory APIs (HTTP and gRPC).
  gRPC messages are not size-capped (nginx can only cap a whole stream of requests). The
  metrics port stays on 127.0.0.1: scrape it on the host or forward it. nginx's config and
  logs are in RUN_DIR/nginx/. Ctrl-C stops nginx, then tritonserver, then the store.

--store flexkv: FlexKV (not on PyPI) as the host tier, on --device cuda only. Build it once with
deploy/build_flexkv.sh SRC (a FlexKV clone or tarball; it puts FlexKV on this Python's sys.path with
a .pth file), then `. .flexkv/env.sh` (its library path) in the shell that runs hstu-serve.
"""


SERVE_OPTIONS = ("device", "store", "pool_pages", "lease_ttl_s", "store_timeout_s",
                 "mooncake_segment_bytes", "mooncake_local_hostname")  # the ServingSettings fields hstu-serve takes as options


def parse_args(argv: list[str] | None = None) -> tuple[LaunchConfig, argparse.Namespace]:
    p = argparse.ArgumentParser(prog="hstu-serve", description=__doc__.split("\n")[0], epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY)
    p.add_argument("--host", default="127.0.0.1",
                   help="address HTTP and gRPC are served on (default 127.0.0.1). Beyond loopback they are "
                        "served by an nginx front (see below) and tritonserver stays on 127.0.0.1")
    p.add_argument("--http-port", type=int, default=8000)
    p.add_argument("--grpc-port", type=int, default=8001)
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="tritonserver's Prometheus metrics (on 127.0.0.1 when the front serves --host)")
    p.add_argument("--triton-http-port", type=int, default=0,
                   help="with the front: tritonserver's own HTTP port on 127.0.0.1 (default: a free port)")
    p.add_argument("--triton-grpc-port", type=int, default=0,
                   help="with the front: tritonserver's own gRPC port on 127.0.0.1 (default: a free port)")
    add_serving_options(p, SERVE_OPTIONS, store="embedded")
    p.add_argument("--mooncake-master", default="", metavar="HOST:PORT",
                   help="--store mooncake: the running mooncake_master every server shares")
    p.add_argument("--store-dram-bytes", type=int, default=2 << 30)
    p.add_argument("--store-disk-dir", type=Path, help="enable the store's disk tier in this directory")
    p.add_argument("--model-control", choices=["none", "explicit"], default="none")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--run-dir", type=Path, help="sockets and logs (default: a new dir under /tmp)")
    p.add_argument("--print-env", action="store_true",
                   help="print the environment and command for a tritonserver started by hand, and exit")
    a = p.parse_args(argv)
    if a.store == "mooncake" and not a.mooncake_master:
        p.error("--store mooncake needs --mooncake-master HOST:PORT (a running mooncake_master)")
    try:
        serving = serving_settings(a, SERVE_OPTIONS, run_dir=a.run_dir or new_run_dir(),
                                   store_endpoint=a.mooncake_master if a.store == "mooncake" else "")
    except ValueError as e:
        p.error(str(e))
    cfg = LaunchConfig(serving=serving, model_repository=a.model_repository.resolve(), host=a.host,
                       http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port,
                       triton_http_port=a.triton_http_port, triton_grpc_port=a.triton_grpc_port,
                       store_dram_bytes=a.store_dram_bytes, store_disk_dir=a.store_disk_dir,
                       model_control=a.model_control, ready_timeout_s=a.ready_timeout)
    return cfg, a


def print_env(server: Server) -> None:
    """Print a bash recipe that starts what `hstu-serve` starts, by hand, exactly as printed: the
    environment, the run directory, the nginx front beyond loopback, the store (with every argument
    it needs, then a wait until its socket is up, so kv_lookup_alloc finds it at load) and
    tritonserver."""
    env = server.environment()
    settings = server.settings
    print("# hstu-serve by hand (bash). PATH and LD_LIBRARY_PATH alone serve too: without the HSTU_*")
    print("# lines and the store, the models use a private run dir and the device cache alone.")
    for k in ["PATH", "LD_LIBRARY_PATH", *settings.to_env()]:
        print(f"export {k}={shlex.quote(env[k])}")
    print(f"mkdir -p -m 700 {shlex.quote(str(server.run_dir))}")
    if server.config.fronted:
        nginx = shutil.which(server.config.nginx) or server.config.nginx
        conf = server.nginx_dir / "nginx.conf"
        print(f"# the nginx front on {server.config.host} (tritonserver below stays on {TRITON_HOST})")
        print(f"mkdir -p -m 711 {shlex.quote(str(server.nginx_dir))}")
        print(f"cat > {shlex.quote(str(conf))} <<'HSTU_NGINX_CONF'")
        print(server.front_conf(), end="")
        print("HSTU_NGINX_CONF")
        print(f"{shlex.join(nginx_command(nginx, server.nginx_dir))} &")
        print("front=$!")
    if settings.store == "mooncake":
        print(f"# mooncake_master must be running at {settings.store_endpoint}")
    if settings.store in STORE_PROCESS_KINDS:
        sock = shlex.quote(settings.store_socket.removeprefix("ipc://"))
        print(f"rm -f {sock}  # a killed store's socket would end the wait below at once")
        print(f"{shlex.join(server.store_command())} &")
        print(f"while [ ! -S {sock} ] && kill -0 $! 2>/dev/null; do sleep 0.1; done  # until the store listens")
    print(shlex.join(server.triton_command()))
    if settings.store in STORE_PROCESS_KINDS:
        print("kill $!  # tritonserver has stopped (its offloads flushed): stop the store")
    if server.config.fronted:
        print("kill $front  # and the nginx front")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    cfg, args = parse_args(argv)
    server = Server(cfg)
    if args.print_env:
        print_env(server)
        return 0

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        endpoints = {"grpc": server.grpc_url, "http": f"http://{server.http_url}",
                     "metrics": server.metrics_url, "model": ENSEMBLE,
                     "baseline": "hstu_monolithic", "logs": str(server.run_dir)}
        if server.front is not None:
            http, grpc = server.triton_ports
            endpoints["front"] = {"nginx_pid": server.front.pid, "logs": str(server.nginx_dir),
                                  "tritonserver": {"http": f"{TRITON_HOST}:{http}", "grpc": f"{TRITON_HOST}:{grpc}"}}
        print(json.dumps(endpoints), flush=True)
        print(f"hstu-serve: serving {ENSEMBLE}; Ctrl-C to stop", flush=True)
        code = None
        while not stop.wait(1.0):
            code = server.watch()
            if code is not None:
                name, log = server.exited
                logger.error("%s exited with %s; log tail (%s):\n%s", name, code, log, log_tail(log))
                break
        return 0 if code is None else 1
    finally:
        server.stop()
        logger.info("stopped")


if __name__ == "__main__":
    sys.exit(main())
