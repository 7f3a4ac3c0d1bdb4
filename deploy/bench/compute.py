"""Benchmark of the compute model alone (no Triton): what one paged forward costs, and that it
costs its own tokens, not the KV pool's size.

    .venv/bin/python -m deploy.bench.compute [--device cpu|cuda] [--model-config JSON]
                                             [--pool-pages 32768] [--repeats N]

Cases, each with 16 new tokens and 64 candidates per user unless said otherwise, in a pool of
``--pool-pages`` pages:
- B=1 with 256, 1,024 and 4,096 cached tokens (a device hit);
- B=3, B=8 and B=32 users with 1,024 cached tokens each, and B=8 with 2,048 and 4,096;
- a miss: B=1, 4,096 tokens all new;
- the pool sweep: B=1, 1,024 cached tokens, against pools of 256 to ``--pool-pages`` pages:
  median call time and the peak memory a call allocates (CUDA), which must not grow with the pool.

Each case runs the AOTI package and the eager module, and on CUDA the package replayed from
CUDA graphs (``compute.graphs``; the second warm-up call captures). Every case is replayed, with
no limit on its padded size, so the table shows where a replay stops paying
(``GRAPH_MAX_CELLS`` should sit there; the padded size is printed beside it). ``single_thr`` calls
the package loaded for graphs (``run_single_threaded``) directly, as served batches past the limit
are: served with graphs on, such batches took longer than with graphs off. The model folder is a scratch folder
(``/tmp/hstu-bench-compute-<config>`` by default) with ``max_history_events`` raised to 4,096, so
the served model is never touched. Prints a table and writes
``compute-<date>-<device>-<config>.json`` under ``--report-dir`` (default ``deploy/reports/``).

``--kernels`` (CUDA) also traces one direct call of the package per case with the PyTorch
profiler and prints how many kernels it launched, their summed GPU time against the call's wall
time, and the costliest kernels: whether a call is bound by launches (few microseconds of work
per kernel, the sum well under the wall time) or by the GPU's work.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from compute import HSTUConfig, PagedBatch, build, load_compiled, load_eager
from compute.graphs import CUDA_GRAPHS, GraphShape
from compute.runtime import Runner
from deploy.bench.report import write_dated_report

logger = logging.getLogger(__name__)

NEW_TOKENS = 16
CANDIDATES = 64
POOL_SWEEP = (256, 2048, 8192, 32768)
REPORTS = Path(__file__).resolve().parents[1] / "reports"


@dataclasses.dataclass(frozen=True)
class Case:
    """``users`` users, each with ``cached`` tokens in the pool and ``new`` new tokens."""

    name: str
    users: int
    cached: int
    new: int = NEW_TOKENS
    candidates: int = CANDIDATES


CASES = (
    Case("hit B=1 256", 1, 256),
    Case("hit B=1 1024", 1, 1024),
    Case("hit B=1 4096", 1, 4096),
    Case("hit B=3 1024", 3, 1024),
    Case("hit B=8 1024", 8, 1024),
    Case("hit B=8 2048", 8, 2048),
    Case("hit B=8 4096", 8, 4096),
    Case("hit B=32 1024", 32, 1024),
    Case("miss B=1 4096", 1, 0, new=4096),
)


def make_batch(config: HSTUConfig, case: Case, pool_pages: int, rng: np.random.Generator) -> PagedBatch:
    """A batch of ``case.users`` users with distinct random pages of a ``pool_pages`` pool."""
    pages_per_user = -(-(case.cached + case.new) // config.page_size)
    if pages_per_user * case.users > pool_pages:
        raise ValueError(f"pool_pages: {case.name} needs {pages_per_user * case.users} pages, the pool has {pool_pages}")
    pages = rng.permutation(pool_pages)[:pages_per_user * case.users].reshape(case.users, pages_per_user)
    requests = [(rng.integers(1, config.vocab_size, case.new, dtype=np.int64), case.cached, pages[b],
                 rng.integers(1, config.item_vocab, case.candidates, dtype=np.int64))
                for b in range(case.users)]
    return PagedBatch.from_requests(requests)


def new_pool(config: HSTUConfig, pages: int, device: str) -> torch.Tensor:
    return torch.zeros(config.num_layers, pages, 2, config.page_size, config.num_heads, config.head_dim,
                       dtype=config.torch_dtype, device=device)


def median_call_ms(run: Runner, pool: torch.Tensor, batch: PagedBatch, repeats: int) -> float:
    """Median wall time of ``run(pool, batch)`` over ``repeats`` calls, after two warm-ups."""
    cuda = pool.device.type == "cuda"
    for _ in range(2):
        run(pool, batch)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run(pool, batch)
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def call_peak_bytes(run: Runner, pool: torch.Tensor, batch: PagedBatch) -> int:
    """Bytes one call allocates at its peak above what was allocated before it (CUDA only)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    run(pool, batch)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def kernel_profile(run: Runner, pool: torch.Tensor, batch: PagedBatch, top: int = 5) -> dict:
    """One traced call after a warm-up: its kernel count, their summed GPU time, its wall time,
    and the ``top`` kernels by total time (name, calls, ms)."""
    from torch.profiler import ProfilerActivity, profile

    run(pool, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        started = time.perf_counter()
        run(pool, batch)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    kernels = [e for e in trace.events() if e.device_type == torch.autograd.DeviceType.CUDA]  # copies included
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
    costliest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:top]
    return {"kernels": len(kernels), "kernel_ms": sum(sum(times) for times in by_name.values()), "wall_ms": wall_ms,
            "top": [{"name": name[:80], "calls": len(times), "ms": sum(times)} for name, times in costliest]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model-config", type=Path, help="HSTUConfig JSON (default: the default config)")
    parser.add_argument("--pool-pages", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per case (median reported)")
    parser.add_argument("--model-dir", type=Path, help="scratch model folder (default: /tmp/hstu-bench-compute-<config>)")
    parser.add_argument("--report-dir", type=Path, default=REPORTS)
    parser.add_argument("--kernels", action="store_true",
                        help="CUDA: trace one direct call per case (kernel count, GPU time, costliest kernels)")
    options = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    base = HSTUConfig.load(options.model_config) if options.model_config else HSTUConfig()
    config = dataclasses.replace(base, max_history_events=max(base.max_history_events, 4096))
    config_name = options.model_config.stem if options.model_config else "default"
    model_dir = options.model_dir or Path(f"/tmp/hstu-bench-compute-{config_name}")
    model_dir.mkdir(parents=True, exist_ok=True)
    config.save(model_dir)
    build_started = time.perf_counter()
    build(model_dir, options.device)
    build_s = time.perf_counter() - build_started
    cuda = options.device == "cuda"
    runners = {"aoti": load_compiled(model_dir, options.device), "eager": load_eager(model_dir, options.device)}
    if cuda:
        # the package replayed from CUDA graphs at bucketed shapes, every case (no cell limit); and
        # the same loader with no batch replayed: a direct call of a package loaded
        # run_single_threaded, which served batches too big for a graph take when graphs are on
        runners["graphs"] = load_compiled(model_dir, options.device, cuda_graphs=CUDA_GRAPHS, graph_max_cells=1 << 62)
        runners["single_thr"] = load_compiled(model_dir, options.device, cuda_graphs=CUDA_GRAPHS, graph_max_cells=0)
    rng = np.random.default_rng(0)

    pool = new_pool(config, options.pool_pages, options.device)
    pool_bytes = pool.numel() * pool.element_size()
    print(f"config {config_name}, pool {options.pool_pages} pages ({pool_bytes / 2**30:.2f} GiB), "
          f"{options.device}, median of {options.repeats}")
    cases = []
    for case in CASES:
        batch = make_batch(config, case, options.pool_pages, rng)
        row = {"case": case.name, "users": case.users, "cached_tokens": case.cached, "new_tokens": case.new,
               "candidates": case.candidates}
        for name, run in runners.items():
            row[f"{name}_ms"] = median_call_ms(run, pool, batch, options.repeats)
        padded = ""
        if cuda:
            row["padded_cells"] = GraphShape.covering(batch, config.page_size).cells(config.num_layers, config.page_size)
            padded = f"   (padded for a graph: {row['padded_cells'] / 2**20:.1f}M cells)"
        cases.append(row)
        print(f"  {case.name:<16} " + "   ".join(f"{name} {row[f'{name}_ms']:8.2f} ms" for name in runners) + padded,
              flush=True)
        if cuda and options.kernels:
            row["kernel_profile"] = k = kernel_profile(runners["aoti"], pool, batch)
            print(f"    {k['kernels']} kernels, {k['kernel_ms']:.2f} ms of GPU time in a {k['wall_ms']:.2f} ms call; "
                  + "; ".join(f"{t['name'][:48]} x{t['calls']} {t['ms']:.3f} ms" for t in k["top"]), flush=True)
    del pool

    sweep = []
    sweep_case = CASES[1]
    for pages in [p for p in POOL_SWEEP if p < options.pool_pages] + [options.pool_pages]:
        pool = new_pool(config, pages, options.device)
        batch = make_batch(config, sweep_case, pages, rng)
        point = {"pool_pages": pages, "pool_bytes": pool.numel() * pool.element_size(),
                 "aoti_ms": median_call_ms(runners["aoti"], pool, batch, options.repeats)}
        if cuda:
            point["call_peak_bytes"] = call_peak_bytes(runners["aoti"], pool, batch)
            point["call_peak_over_pool"] = point["call_peak_bytes"] / point["pool_bytes"]
        sweep.append(point)
        print(f"  pool {pages:>6} pages: aoti {point['aoti_ms']:7.2f} ms"
              + (f", call peak {point['call_peak_bytes'] / 2**20:8.1f} MiB "
                 f"({100 * point['call_peak_over_pool']:.3f}% of the pool)" if cuda else ""), flush=True)
        del pool
    largest_over_smallest = sweep[-1]["aoti_ms"] / sweep[0]["aoti_ms"]
    print(f"  call time, pool {sweep[-1]['pool_pages']} / {sweep[0]['pool_pages']} pages: "
          f"{largest_over_smallest:.2f}x (goal <= 1.2x)")

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": options.device,
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_version": torch.__version__,
        "config_name": config_name,
        "config": dataclasses.asdict(config),
        "pool_pages": options.pool_pages,
        "repeats": options.repeats,
        "build_s": build_s,
        "cases": cases,
        "pool_sweep": sweep,
        "pool_sweep_largest_over_smallest": largest_over_smallest,
    }
    write_dated_report(options.report_dir, "compute", f"{options.device}-{config_name}", report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
