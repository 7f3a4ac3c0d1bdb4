"""The cache owner's per-request CPU cost outside Triton: kv_lookup_alloc's work on a batch (history
tokens, the custom ops lookup, allocate and onboard_launch, the plans packed) and kv_offload's
commit, on a synthetic trace, with no host store.

    python -m deploy.bench.owner [--batch 8] [--requests 6000] [--users 128] [--idle-ms 3] [--report-dir deploy/reports]

The owner is one process with one GIL, so this cost bounds the ensemble's throughput (the stub's
shared-memory I/O and Triton's own work come on top: `deploy/bench/profile.py` shows both). Prints
microseconds per request per step, and writes `owner-<date>-cpu.json`. `--idle-ms` sleeps that long
before each batch, as a step of a lightly loaded ensemble sleeps between requests: at c=1 each
step waits about 3 ms for the others, and a thread that wakes from such a sleep runs slower than
one in a hot loop (measured here: 149 us per request hot against 296 us after 3 ms idle).
"""
from __future__ import annotations

import argparse
import collections
import platform
import sys
import time
from pathlib import Path

import torch

from compute import HSTUConfig, history_tokens_many
from deploy import trace as trace_module
from deploy.bench.report import write_dated_report
from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.settings import DEFAULT_MODEL_DIR
from kvlifecycle import ops
from kvlifecycle.hashing import namespace_tag
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PoolSpec

STEPS = ("tokens", "lookup", "allocate", "onboard_launch", "pack", "commit")
WARM_BATCHES = 60  # the first batches fill the cache (misses): not timed


def measure(batch_size: int, num_requests: int, num_users: int, pool_pages: int,
            idle_s: float = 0.0) -> dict[str, float]:
    """Microseconds per request of each of STEPS, over the trace's batches after the warm ones;
    `idle_s` asleep before each batch."""
    torch.set_num_threads(1)  # as kv_lookup_alloc runs
    config = HSTUConfig.load(DEFAULT_MODEL_DIR)
    spec = PoolSpec(num_layers=config.num_layers, num_pages=pool_pages, page_size=config.page_size,
                    num_heads=config.num_heads, head_dim=config.head_dim, dtype=config.dtype)
    manager = KVCacheManager(spec, "bench")
    handle = ops.register(manager)
    kv = torch.ops.kvlifecycle
    trace = trace_module.generate(trace_module.TraceConfig(num_users=num_users, num_requests=num_requests,
                                                           initial_events_median=300))
    spent: collections.Counter[str] = collections.Counter()
    timed = 0
    for b, start in enumerate(range(0, len(trace) - batch_size, batch_size)):
        seen: set[int] = set()  # a user once per batch, as one client per user sends
        batch = [r for r in trace[start:start + batch_size] if not (r.user_id in seen or seen.add(r.user_id))]
        inputs = [tuple(torch.tensor(x) for x in (r.item_ids, r.action_ids, r.candidate_ids)) for r in batch]
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter()
        tokens = history_tokens_many([(items, actions) for items, actions, _ in inputs], config)
        user_ids = torch.tensor([r.user_id for r in batch])
        joined, offsets = ops.join_tokens(tokens)
        t1 = time.perf_counter()
        hits = kv.lookup(handle, user_ids, joined, offsets)
        t2 = time.perf_counter()
        leases, rows = kv.allocate(handle, user_ids, joined, offsets, hits, 30.0)
        t3 = time.perf_counter()
        launched = kv.onboard_launch(handle, leases)
        t4 = time.perf_counter()
        tag = namespace_tag(manager.namespace)  # once per batch, as kv_lookup_alloc does
        for (_, _, candidates), user_tokens, (lease_id, cached_len, _), row in zip(inputs, tokens, launched.tolist(),
                                                                                  rows):
            num_pages = -(-user_tokens.numel() // config.page_size)
            ComputePlan(new_tokens=user_tokens[cached_len:], cached_len=cached_len, onboard_len=0,
                        page_row=row[:num_pages], candidates=candidates, namespace_tag=tag,
                        lease_id=lease_id).pack()
        t5 = time.perf_counter()
        manager.commit_many(leases[:, 0].tolist())
        t6 = time.perf_counter()
        if b >= WARM_BATCHES:
            timed += len(batch)
            for step, seconds in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)):
                spent[step] += seconds
    ops.unregister(handle)
    return {step: 1e6 * spent[step] / timed for step in STEPS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32], help="requests per batch")
    p.add_argument("--requests", type=int, default=6000)
    p.add_argument("--users", type=int, default=128)
    p.add_argument("--pool-pages", type=int, default=32768)
    p.add_argument("--idle-ms", type=float, default=0.0, help="sleep before each batch (a lightly loaded step's idle time)")
    p.add_argument("--report-dir", type=Path, default=Path(__file__).resolve().parents[1] / "reports")
    a = p.parse_args(argv)
    results = {}
    for batch_size in a.batch:
        us = measure(batch_size, a.requests, a.users, a.pool_pages, a.idle_ms / 1e3)
        results[batch_size] = us
        print(f"batch {batch_size:3d}{f' after {a.idle_ms:g} ms idle' if a.idle_ms else ''}: " + ", ".join(f"{step} {v:.1f}" for step, v in us.items())
              + f"; total {sum(us.values()):.1f} us per request")
    write_dated_report(a.report_dir, "owner", "cpu", {"machine": platform.processor() or platform.machine(),
                                                      "command": sys.argv, "idle_ms": a.idle_ms,
                                                      "us_per_request": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
