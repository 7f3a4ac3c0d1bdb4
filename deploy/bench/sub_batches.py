"""How hstu_compute's sub-batch plan prices padding on this device (not a test): the compiled
forward's time per request for batches of the demo's trace, planned as served (`CALL_COST` of the
device), at other paddings, one call per user, and one padded call for the whole batch.

    .venv/bin/python -m deploy.bench.sub_batches [--device cpu|cuda] [--model-dir DIR]
        [--batch-sizes 3 8 14] [--batches 20] [--report-dir deploy/reports]

``--model-dir``: the model folder (the served model's by default; on a GPU host the folder
``deploy.serving_options.model_dir_for(config)`` names); its AOTI package for the device is built
first when missing or stale. Batches are
consecutive requests of the trace, so a late batch's users have their histories cached, as in
steady serving. Each plan's calls are timed back to back on one batch, the scores copied to the
host (so a GPU call is waited for); the median over ``--batches`` batches is printed per request.
Writes ``sub-batches-<date>-<device>.json`` under ``--report-dir``.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from compute import HSTUConfig, PagedBatch, load_compiled, plan_sub_batches
from compute.batch import CALL_COST, CallCost
from deploy.bench.graph_shapes import demo_requests
from deploy.bench.report import write_dated_report
from deploy.launcher import build_model
from deploy.runtime.settings import DEFAULT_MODEL_DIR

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def plans(device_type: str) -> dict[str, Callable[[list[tuple[int, int]]], list[list[int]]]]:
    """Each way to split a batch of ``(queries, keys)`` shapes into calls, by name."""
    shipped = CALL_COST[device_type]
    return {
        f"as served (slack {shipped.slack:g})": lambda shapes: plan_sub_batches(shapes, shipped),
        **{f"slack {slack:g}": (lambda shapes, slack=slack: plan_sub_batches(shapes, CallCost(shipped.call_cells, slack)))
           for slack in (1.0, 1.5) if slack != shipped.slack},
        "one call per user": lambda shapes: [[i] for i in range(len(shapes))],
        "one padded call": lambda shapes: [list(range(len(shapes)))],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--users", type=int, default=40)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--median-events", type=float, default=300.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[3, 8, 14])
    parser.add_argument("--batches", type=int, default=20, help="batches timed per size (the trace's last ones)")
    parser.add_argument("--report-dir", type=Path, default=REPORTS)
    options = parser.parse_args(argv)

    config = HSTUConfig.load(options.model_dir)
    build_model(options.model_dir, options.device)
    run = load_compiled(options.model_dir, options.device)
    requests = demo_requests(config, options.users, options.requests, options.median_events)
    pages = max(max(row, default=0) for _, _, row, _ in requests) + 1
    pool = torch.randn(config.num_layers, pages, 2, config.page_size, config.num_heads,
                       config.head_dim).to(dtype=config.torch_dtype, device=options.device)
    served = [(torch.as_tensor(new), cached, torch.as_tensor(row, dtype=torch.int64), torch.as_tensor(candidates))
              for new, cached, row, candidates in requests]

    def seconds(members: list) -> float:
        batch = PagedBatch.from_requests(members)
        started = time.perf_counter()
        run(pool, batch).cpu()
        return time.perf_counter() - started

    for warm_up in served[:4]:
        seconds([warm_up])
    print(f"{options.model_dir}: compiled forward per request in ms (median of {options.batches} batches), "
          f"{options.device}, {torch.get_num_threads()} intra-op threads")
    rows = []
    for batch_size in options.batch_sizes:
        starts = range(max(0, len(served) - options.batches * batch_size), len(served) - batch_size + 1, batch_size)
        ms = {}
        for name, plan in plans(options.device).items():
            per_request = []
            for start in starts:
                members = served[start:start + batch_size]
                shapes = [(new.numel() + candidates.numel(), cached + new.numel()) for new, cached, _, candidates in members]
                groups = plan(shapes)
                per_request.append(sum(seconds([members[i] for i in group]) for group in groups) / batch_size)
            ms[name] = 1e3 * statistics.median(per_request)
        rows.append({"batch_size": batch_size, "ms_per_request": ms})
        print(f"  batch of {batch_size:>3}: " + ", ".join(f"{name} {v:.2f}" for name, v in ms.items()))
    write_dated_report(options.report_dir, "sub-batches", options.device,
                       {"model_dir": str(options.model_dir), "device": options.device, "host": platform.node(),
                        "threads": torch.get_num_threads(), "torch": torch.__version__, "rows": rows,
                        "call_cost": {k: vars(v) for k, v in CALL_COST.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
