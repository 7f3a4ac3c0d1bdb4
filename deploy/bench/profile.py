"""Where each Python-backend model of a tritonserver spends its time: py-spy samples every
model's stub process at once for a while, and this prints each model's hottest functions.

    python -m deploy.bench.profile --seconds 10 --out-dir DIR [--native]      # a running server
    python -m deploy.bench.profile --serve --concurrency 1 32 [--device cuda --model-config C --pool-pages N]

Without `--serve`, run it while a load is going (the demo, hstu-bench, perf_analyzer). With
`--serve`, it starts a server itself and, for each model (hstu_ranking, hstu_monolithic) and
concurrency, drives perf_analyzer (unary gRPC) over a synthetic trace, samples the stubs in the
middle of the run, and prints the throughput and each step's mean batch and ms per execute
(Triton's statistics over the run). Scores are not checked here: the demo and hstu-bench do.

Idle threads are not sampled, so a model's samples over `seconds * rate` is the CPU it used
(1.0 = one core busy). The raw stacks (`DIR/<model>.txt`, py-spy's collapsed format: flame-graph
tools read it) stay for a closer look. py-spy attaches with ptrace: run as root, or where ptrace
is allowed.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from deploy import trace as trace_module
from deploy.bench.perf_analyzer import run_perf_analyzer
from deploy.launcher import LaunchConfig, Server, new_run_dir
from deploy.processes import free_loopback_ports
from deploy.runtime.schema import ENSEMBLE, MONOLITHIC
from deploy.server_stats import hop_stats, read_model_stats
from deploy.serving_options import add_serving_options, serving_settings

SERVE_OPTIONS = ("device", "store", "pool_pages", "cuda_graphs")

STUB = "triton_python_backend_stub"


def stub_processes(server_pid: int | None = None) -> dict[str, list[int]]:
    """Model name -> pids of its stub processes (one per instance), from /proc; only the
    children of `server_pid` when given."""
    found: dict[str, list[int]] = collections.defaultdict(list)
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if len(argv) < 2 or not argv[0].endswith(STUB.encode()) or (server_pid and ppid != server_pid):
            continue
        model_py = Path(argv[1].decode())  # .../<model>/<version>/model.py
        found[model_py.parent.parent.name].append(int(proc.name))
    return dict(found)


def record(stubs: dict[str, list[int]], seconds: float, rate: int, out_dir: Path, native: bool,
           idle: bool = False) -> dict[str, Path]:
    """Sample every stub at once; the raw stacks file of each model (its instances together). With
    `idle`, waiting threads are sampled too: where a thread's wall time goes, not only its CPU."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out_dir.mkdir(parents=True, exist_ok=True)
    running = []
    for model, pids in stubs.items():
        (out_dir / f"{model}.txt").unlink(missing_ok=True)  # the instances' stacks are appended below
        for pid in pids:
            out = out_dir / f"{model}.{pid}.txt"
            cmd = [py_spy, "record", "--format", "raw", "--threads", "--rate", str(rate),
                   "--duration", str(int(seconds)), "--pid", str(pid), "--output", str(out)]
            # native stacks need the process paused per sample; Python stacks alone do not
            cmd += ["--native"] if native else ["--nonblocking"]
            cmd += ["--idle"] if idle else []
            running.append((model, out, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    files: dict[str, Path] = {}
    for model, out, proc in running:
        _, err = proc.communicate()
        if proc.returncode != 0 or not out.exists():
            print(f"py-spy on {model} failed ({proc.returncode}): {err.decode(errors='replace').strip()[-400:]}")
            continue
        merged = out_dir / f"{model}.txt"
        with merged.open("a") as f:
            f.write(out.read_text())
        out.unlink()  # one file per model: a GPU host returns a limited number of files per call
        files[model] = merged
    return files


def summarize(raw: Path, seconds: float, rate: int, top: int = 14, idle: bool = False) -> str:
    """The model's CPU (cores busy; with `idle`, threads sampled), its threads' shares, and its
    hottest functions: self (the sampled frame) and inclusive (anywhere on the stack)."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames[1:]):
            inclusive[frame] += n
    if not total:
        return f"{raw.stem}: no samples (idle)"
    unit = "threads sampled (idle included)" if idle else "cores busy"
    lines = [f"{raw.stem}: {total} samples = {total / (seconds * rate):.2f} {unit}"]
    lines += [f"  thread {name}: {100 * n / total:.0f}%" for name, n in threads.most_common(6)]
    for title, counter in (("self", own), ("inclusive", inclusive)):
        lines.append(f"  {title}:")
        lines += [f"    {100 * n / total:5.1f}%  {frame[:150]}" for frame, n in counter.most_common(top)]
    return "\n".join(lines)


def profile_stubs(out_dir: Path, seconds: float, rate: int, native: bool, server_pid: int | None = None,
                  idle: bool = False) -> bool:
    """Sample every stub (of `server_pid`'s server) and print each model's summary."""
    stubs = stub_processes(server_pid)
    if not stubs:
        print(f"no {STUB} process found: start tritonserver (hstu-serve, the demo) first", file=sys.stderr)
        return False
    files = record(stubs, seconds, rate, out_dir, native, idle)
    for model in sorted(files):
        print(summarize(files[model], seconds * len(stubs[model]), rate, idle=idle), flush=True)
    return bool(files)


def serve_and_profile(args: argparse.Namespace) -> bool:
    """Start a server; for each model and concurrency, perf_analyzer over a synthetic trace, the
    stubs sampled in the middle of its run; print throughput, latency and each step's batching."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    config = trace_module.TraceConfig(num_users=args.users, num_requests=args.requests,
                                      initial_events_median=args.median_events)
    data = args.out_dir / "perf-analyzer-data.json"
    data.write_text(json.dumps(trace_module.perf_analyzer_data(trace_module.generate(config))))
    http, grpc, metrics = free_loopback_ports(3)
    server = Server(LaunchConfig(serving_settings(args, SERVE_OPTIONS, run_dir=new_run_dir()),
                                 http_port=http, grpc_port=grpc, metrics_port=metrics))
    ok = True
    with server:
        # warm every model once (first calls, the AOTI package's first shapes)
        for model in args.models:
            run_perf_analyzer(server.grpc_url, model, 1, data, args.out_dir / f"warm-{model}.csv", 2000)
        for model in args.models:
            for c in args.concurrency:
                point = args.out_dir / f"{model}-c{c}"
                before = read_model_stats(server.http_url)
                sampler = threading.Timer(args.interval_ms / 1000, profile_stubs,
                                          (point, args.seconds, args.rate, args.native, server.triton.pid, args.idle))
                sampler.start()
                result = run_perf_analyzer(server.grpc_url, model, c, data, point.with_suffix(".csv"),
                                           args.interval_ms)
                sampler.join()
                steps = hop_stats(before, read_model_stats(server.http_url))
                print(f"== {model} c={c}: {result.throughput:.1f} req/s, p50 {result.percentile_ms.get(50, float('nan')):.2f}"
                      f" ms, p99 {result.p99_ms:.2f} ms" + (f" (perf_analyzer failed: {result.error})" if result.error else ""))
                for name, hop in sorted(steps.items()):
                    print(f"   {name}: {hop.requests} requests in {hop.executions} executes (mean batch "
                          f"{hop.mean_batch_size:.1f}), {ms_per_execute(hop):.2f} ms per execute, queue "
                          f"{hop.ms_per_request['queue']:.2f} ms per request", flush=True)
                ok = ok and result.returncode == 0
    return ok


def ms_per_execute(hop) -> float:
    """Mean compute_infer ms of one execute (Triton's per-batch-size table)."""
    executions = sum(b.executions for b in hop.batches.values())
    if not executions:  # no dynamic batching: each request is an execute
        return hop.ms_per_request["compute_infer"]
    return sum(b.ms_per_execution * b.executions for b in hop.batches.values()) / executions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to sample")
    parser.add_argument("--rate", type=int, default=200, help="samples per second per process")
    parser.add_argument("--out-dir", type=Path, default=Path("deploy/reports/profile"))
    parser.add_argument("--server-pid", type=int, help="only this tritonserver's models (default: every stub)")
    parser.add_argument("--native", action="store_true", help="also C/C++ frames (the stub's IPC, torch)")
    parser.add_argument("--idle", action="store_true",
                        help="also sample waiting threads: where each thread's wall time goes (a wait on the GPU, "
                             "a lock, the GIL), not only where it runs")
    serve = parser.add_argument_group("--serve: start a server and load it with perf_analyzer")
    serve.add_argument("--serve", action="store_true")
    serve.add_argument("--models", nargs="+", choices=(ENSEMBLE, MONOLITHIC), default=[ENSEMBLE, MONOLITHIC])
    serve.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    serve.add_argument("--interval-ms", type=int, default=6000,
                       help="perf_analyzer's window (3 per point); sampling starts after the first")
    serve.add_argument("--users", type=int, default=128)
    serve.add_argument("--requests", type=int, default=2048)
    serve.add_argument("--median-events", type=float, default=300.0)
    add_serving_options(parser, SERVE_OPTIONS, store="embedded", pool_pages=32768)
    args = parser.parse_args(argv)
    if args.serve:
        return 0 if serve_and_profile(args) else 1
    return 0 if profile_stubs(args.out_dir, args.seconds, args.rate, args.native, args.server_pid, args.idle) else 1


if __name__ == "__main__":
    sys.exit(main())
