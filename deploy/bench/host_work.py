"""hstu_compute's host work per batch, without the compiled call: what its `execute` does in
Python around the forward, timed step by step on the demo's trace (no model run, no server).

    .venv/bin/python -m deploy.bench.host_work [--model-config JSON] [--batch-sizes 1 8 32]
        [--repeats 300] [--pinned]

Each request becomes the plan kv_lookup_alloc would send (`ComputePlan.pack`: a user's previous
history cached in whole pages, a first request a miss); consecutive requests form a batch. Per
batch it times, in order: reading the plans (`ComputePlan.unpack`), the sub-batch plan, building
the batch (`PagedBatch.from_requests`), the checks before a forward (`PagedBatch.check`), the
packed index buffer a GPU call copies in one go (`packed_indices`; `--pinned` page-locks it, as
on a GPU) and sealing the scores (`sealed_scores.seal_batch`). It runs the same Python the GPU
host runs, so a CPU figure says what a change saves, not what a GPU host's slower cores pay
(there, `deploy.bench.profile --serve` shows the share of each step in `execute`). Writes
``host-work-<date>-<config>.json`` under ``--report-dir``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

from compute import HSTUConfig, PagedBatch
from compute.batch import CALL_COST, plan_sub_batches
from deploy.bench.graph_shapes import demo_requests
from deploy.bench.report import write_dated_report
from deploy.runtime import sealed_scores
from deploy.runtime.compute_plan import ComputePlan

REPORTS = Path(__file__).resolve().parents[1] / "reports"


def plans_of(requests: list) -> list[torch.Tensor]:
    """The packed plan of each served request (no onboard, lease ids in order)."""
    return [ComputePlan(new_tokens=torch.as_tensor(new), cached_len=cached, onboard_len=0,
                        page_row=torch.as_tensor(row, dtype=torch.int64), candidates=torch.as_tensor(cands),
                        namespace_tag=1, lease_id=i).pack()
            for i, (new, cached, row, cands) in enumerate(requests)]


def time_steps(flat_plans: list[torch.Tensor], pool: torch.Tensor, config: HSTUConfig, pinned: bool,
               repeats: int) -> dict[str, float]:
    """Median microseconds of each host step over ``repeats`` runs on one batch of plans."""
    plans = [ComputePlan.unpack(f) for f in flat_plans]
    batch = PagedBatch.from_requests([(p.new_tokens, p.cached_len, p.page_row, p.candidates) for p in plans])
    counts = [p.candidates.numel() for p in plans]
    scores = torch.randn(sum(counts), config.num_tasks)
    steps: dict[str, Callable[[], object]] = {
        "unpack": lambda: [ComputePlan.unpack(f) for f in flat_plans],
        "plan_sub_batches": lambda: plan_sub_batches(
            [(p.new_tokens.numel() + p.candidates.numel(), p.cached_len + p.new_tokens.numel()) for p in plans],
            CALL_COST["cuda"]),
        "from_requests": lambda: PagedBatch.from_requests(
            [(p.new_tokens, p.cached_len, p.page_row, p.candidates) for p in plans]),
        "check": lambda: batch.check(pool, config.page_size, config.vocab_size, config.item_vocab),
        "packed_indices": lambda: batch.packed_indices(pinned=pinned),
        "seal_batch": lambda: sealed_scores.seal_batch(scores, counts),
    }
    error = batch.check(pool, config.page_size, config.vocab_size, config.item_vocab)
    if error is not None:
        raise RuntimeError(f"the trace's batch does not fit the pool: {error}")
    result = {}
    for name, step in steps.items():
        for _ in range(20):  # warm-up
            step()
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            step()
            samples.append(time.perf_counter() - started)
        result[name] = statistics.median(samples) * 1e6
    result["total"] = sum(result.values())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", type=Path, default=Path("deploy/configs/gpu_small_bf16.json"))
    parser.add_argument("--users", type=int, default=128)
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--median-events", type=float, default=600.0)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--pinned", action="store_true", help="page-lock the packed index buffer (as on a GPU)")
    parser.add_argument("--report-dir", type=Path, default=REPORTS)
    options = parser.parse_args(argv)

    torch.set_num_threads(1)  # as hstu_compute on a GPU host
    config = HSTUConfig.load(options.model_config)
    requests = demo_requests(config, options.users, options.requests, options.median_events)
    flat_plans = plans_of(requests)
    # the checks read the pool's shape only: one element viewed as a pool as wide as the widest page id
    pages = max(max(row, default=0) for _, _, row, _ in requests) + 1
    pool = torch.empty(1).expand(config.num_layers, pages, 2, config.page_size, config.num_heads, config.head_dim)
    print(f"{options.model_config.stem}: host work per batch in us (median of {options.repeats}), "
          f"the last batch of each size from {options.requests} requests of {options.users} users")
    rows = []
    for batch_size in options.batch_sizes:
        # a late batch: its users have histories cached, as in steady serving
        steps = time_steps(flat_plans[-batch_size:], pool, config, options.pinned, options.repeats)
        rows.append({"batch_size": batch_size, "us": steps, "us_per_request": steps["total"] / batch_size})
        print(f"  batch of {batch_size:>3}: " + ", ".join(f"{k} {v:.1f}" for k, v in steps.items())
              + f"  ({steps['total'] / batch_size:.1f} per request)")
    write_dated_report(options.report_dir, "host-work", options.model_config.stem,
                       {"config": options.model_config.stem, "pinned": options.pinned, "repeats": options.repeats,
                        "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
