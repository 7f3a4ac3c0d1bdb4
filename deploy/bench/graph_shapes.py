"""How many CUDA graphs a trace needs (CPU only, no model run): the demo's trace, cut into
batches of a given size, each batch's bucketed shape (``compute.graphs.GraphShape``) counted.

    .venv/bin/python -m deploy.bench.graph_shapes [--model-config JSON] [--users 128]
        [--requests 1024] [--median-events 600] [--batch-sizes 1 8 16 32] [--max-cells N]

Each request's cached and new tokens are what the ensemble would see: a user's first request
is a miss, a later one has the whole pages of its previous history cached. Consecutive requests
form a batch (as at a concurrency of about that many). For each batch size it prints how many
batches could replay a graph (at most ``GRAPH_MAX_CELLS`` padded), how many distinct shapes they
fall in (``--max-cells`` tries another limit), and how many batches would replay (a shape is captured at its ``CAPTURE_AFTER``-th
batch, and replayed from the next one on; the capture limit is not applied). This is the
estimate behind the bucket minimums; served figures come from the demo with ``--cuda-graphs``.
Writes ``graph-shapes-<date>-<config>.json`` under ``--report-dir``.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np

from compute import HSTUConfig, PagedBatch, history_tokens
from compute.graphs import CAPTURE_AFTER, GRAPH_MAX_CELLS, GraphShape
from deploy import trace as trace_module
from deploy.bench.report import write_dated_report

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def served_requests(config: HSTUConfig, trace: list) -> list[tuple[np.ndarray, int, list[int], np.ndarray]]:
    """``(new_tokens, cached_len, page_row, candidates)`` of each request of ``trace``, in order:
    the whole pages of a user's previous history cached (none for a first request)."""
    seen: dict[int, int] = {}  # user -> tokens of its previous request
    out = []
    for request in trace:
        tokens = history_tokens(request.item_ids, request.action_ids, config).numpy()
        cached = seen.get(request.user_id, 0) // config.page_size * config.page_size
        seen[request.user_id] = tokens.size
        pages = list(range(1, 1 + -(-tokens.size // config.page_size)))  # ids only size the row
        out.append((tokens[cached:], cached, pages, np.asarray(request.candidate_ids, dtype=np.int64)))
    return out


def demo_requests(config: HSTUConfig, users: int, requests: int, median_events: float) -> list:
    """``served_requests`` of the demo's synthetic trace of ``requests`` requests by ``users`` users."""
    trace = trace_module.generate(trace_module.TraceConfig(
        num_users=users, num_requests=requests, initial_events_median=median_events,
        max_history_events=config.max_history_events, item_vocab=config.item_vocab, action_vocab=config.action_vocab))
    return served_requests(config, trace)


def count_shapes(config: HSTUConfig, requests: list, batch_size: int, max_cells: int) -> dict[str, int]:
    """Batches of ``batch_size`` consecutive requests: how many could replay, in how many shapes,
    and how many would replay once their shape is captured."""
    shapes: collections.Counter[GraphShape] = collections.Counter()
    batches = replayed = 0
    for start in range(0, len(requests), batch_size):
        batch = PagedBatch.from_requests(requests[start:start + batch_size])
        batches += 1
        shape = GraphShape.covering(batch, config.page_size)
        if shape.cells(config.num_layers, config.page_size) > max_cells:
            continue
        shapes[shape] += 1
        replayed += shapes[shape] >= CAPTURE_AFTER
    return {"batch_size": batch_size, "batches": batches, "graphable": sum(shapes.values()),
            "shapes": len(shapes), "captures": sum(n >= CAPTURE_AFTER for n in shapes.values()),
            "replayed": replayed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", type=Path, default=Path("deploy/configs/gpu_small_bf16.json"))
    parser.add_argument("--users", type=int, default=128)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--median-events", type=float, default=600.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    parser.add_argument("--max-cells", type=int, default=GRAPH_MAX_CELLS,
                        help="the largest padded batch replayed (default: GRAPH_MAX_CELLS, what serving uses)")
    parser.add_argument("--report-dir", type=Path, default=REPORTS)
    options = parser.parse_args(argv)

    config = HSTUConfig.load(options.model_config)
    requests = demo_requests(config, options.users, options.requests, options.median_events)
    print(f"{options.model_config.stem}: {options.requests} requests of {options.users} users, "
          f"graphs up to {options.max_cells / 2**20:.0f}M padded cells, captured at a shape's batch {CAPTURE_AFTER}")
    rows = []
    for batch_size in options.batch_sizes:
        row = count_shapes(config, requests, batch_size, options.max_cells)
        rows.append(row)
        print(f"  batches of {batch_size:>3}: {row['batches']:>5} batches, {row['graphable']:>5} launch-bound, "
              f"{row['shapes']:>4} shapes, {row['captures']:>4} captured, {row['replayed']:>5} replayed")
    write_dated_report(options.report_dir, "graph-shapes", options.model_config.stem,
                       {"config": options.model_config.stem, "users": options.users, "requests": options.requests,
                        "median_events": options.median_events, "max_cells": options.max_cells,
                        "capture_after": CAPTURE_AFTER, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
