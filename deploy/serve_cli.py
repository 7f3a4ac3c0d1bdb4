"""`hstu-serve`: build the model if needed, start the host store and tritonserver, stop both cleanly.

The command line over `deploy.launcher.Server` (what it starts, in which order, and how it stops:
the launcher's docstring). `--print-env` prints the same start as a bash recipe instead.
"""
from __future__ import annotations

import argparse
import json
import logging
import shlex
import shutil
import signal
import sys
import threading
from pathlib import Path

from deploy.front import MAX_BODY_SIZE, MAX_HEADER_SIZE, MAX_JSON_DEPTH, human_size, nginx_command
from deploy.launcher import ENSEMBLE, STORE_PROCESS_KINDS, TRITON_HOST, LaunchConfig, Server, new_run_dir
from deploy.processes import log_tail
from deploy.runtime.settings import DEFAULT_MODEL_REPOSITORY
from deploy.serving_options import add_serving_options, serving_settings

logger = logging.getLogger("hstu-serve")

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


SERVE_OPTIONS = ("device", "store", "pool_pages", "lease_ttl_s", "store_timeout_s", "min_host_pages", "host_hit_copy", "cuda_graphs",
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
    p.add_argument("--store-dram-bytes", type=int, default=LaunchConfig.store_dram_bytes)
    p.add_argument("--store-disk-dir", type=Path, help="enable the store's disk tier in this directory")
    p.add_argument("--store-disk-bytes", type=int, default=LaunchConfig.store_disk_bytes,
                   help="the disk tier's capacity; least recently used pages are dropped past it (default 16 GiB)")
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
    try:
        cfg = LaunchConfig(serving=serving, model_repository=a.model_repository.resolve(), host=a.host,
                           http_port=a.http_port, grpc_port=a.grpc_port, metrics_port=a.metrics_port,
                           triton_http_port=a.triton_http_port, triton_grpc_port=a.triton_grpc_port,
                           store_dram_bytes=a.store_dram_bytes, store_disk_dir=a.store_disk_dir,
                           store_disk_bytes=a.store_disk_bytes,
                           model_control=a.model_control, ready_timeout_s=a.ready_timeout)
    except ValueError as e:
        p.error(str(e))
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