"""Micro-benchmark of a host hit's onboard (not a test): how long a copy takes through each layer of
the serving path, next to a pinned copy of the same bytes, for 2 to 512 pages per onboard.

- `copy`: a plain `copy_` of the bytes from pinned host memory into the pool (the bus's share);
- `store`: `get_prefix_async` then a waiting `try_wait` against the store process (what the owner's
  housekeeping thread sends);
- `owner`: what a served host hit waits for: the owner's lookup, allocate and onboard start, the
  wake, and hstu_compute's `onboard_wait` answered through the control plane (a `KVCacheManager`
  and `ControlServer` in this process, as in kv_lookup_alloc);
- `reader`: the same host hit with `--host-hit-copy reader`: the owner's lookup, allocate and
  hand-over, then hstu_compute's `OnboardReader.start` and `finish` (one `locate`, its own copy from
  the store's shared slab, waited for here, and the version check; served, the copy's wait overlaps
  the launch of the forward that reads the pages).

`owner - copy` and `reader - copy` are the onboard's fixed cost, the owner's lookup and allocate
included; `queued` is the reader's host time before hstu_compute launches the forward (the copy runs
on); `own` is the reader's steps alone (`start` and `finish`: finding the pages in the store's
shared index, or a `locate` round trip, the copy, the version check), and `own - copy` the fixed
cost a host hit adds to hstu_compute (issue goal: under 0.3 ms on the GPU).

    .venv/bin/python -m deploy.bench.onboard [--device cuda] [--layers 3 --heads 4 --head-dim 128]
        [--dtype bfloat16] [--repeats 20]

Writes deploy/reports/onboard-<date>-<device>.json.
"""

from __future__ import annotations

import argparse
import logging
import platform
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deploy.bench.report import write_dated_report
from deploy.runtime.compute_plan import ComputePlan
from deploy.runtime.onboard_reader import OnboardReader
from kvlifecycle.control import ControlClient, ControlServer
from kvlifecycle.gil import hand_over_gil_promptly
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PagePool, PoolSpec, slots_for_pages
from kvlifecycle.rpc import default_endpoint
from kvlifecycle.store import Status, open_store
from kvlifecycle.store.processes import start_store_process
from kvlifecycle.store.protocol import keys_to_words

REPORTS = Path(__file__).resolve().parents[1] / "reports"
PAGES_PER_ONBOARD = (2, 8, 32, 128, 512)
NS = "bench-onboard"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--report-dir", type=Path, default=REPORTS)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    hand_over_gil_promptly()  # as kv_lookup_alloc: the housekeeping and control threads answer while others run

    n_max = max(PAGES_PER_ONBOARD)
    spec = PoolSpec(num_layers=a.layers, num_pages=4 * n_max, page_size=a.page_size, num_heads=a.heads,
                    head_dim=a.head_dim, dtype=a.dtype, device=a.device)
    pool = PagePool.create(spec)
    # Touch every page: a CPU pool's shared memory is faulted in at its first write, which the owner
    # path (fresh pages for each lease) would pay and the store path (the same pages) would not.
    pool.tensor.zero_()
    endpoint, control_endpoint = default_endpoint("store.sock"), default_endpoint("control.sock")
    # Room for every history of the run, so that each copy reads fresh, contiguous rows (GBs: the
    # store zeroes them when the first pool registers, which outlasted the default 10 s register
    # timeout on a loaded machine).
    proc = start_store_process(endpoint, dram_bytes=spec.page_bytes * n_max * (3 * a.repeats + 4),
                               ready_timeout_s=60)
    owner_store = open_store("embedded", endpoint=endpoint, page_size=spec.page_size, rpc_timeout_s=5.0,
                             register_timeout_s=120.0)
    putter = open_store("embedded", endpoint=endpoint, page_size=spec.page_size, rpc_timeout_s=5.0,
                        pool_handle=pool.handle())
    manager = KVCacheManager(spec, NS, store=owner_store)
    control = ControlServer(manager, control_endpoint)
    waiter = ControlClient(control_endpoint)
    # The reader path: an owner that hands onboards over, and hstu_compute's reader with its own client.
    handing = KVCacheManager(spec, NS, store=owner_store, onboard_by_reader=True)
    reader = OnboardReader(open_store("embedded", endpoint=endpoint, page_size=spec.page_size, rpc_timeout_s=5.0),
                           pin_s=2.0)
    rows = []
    try:
        assert owner_store.register_pool(pool.handle()), f"the store did not take the pool; log {proc.log_path}"
        histories = _Histories(putter, spec)
        for n in PAGES_PER_ONBOARD:
            copy_ms = _pinned_copy_ms(pool, n, a.repeats)
            store_ms = _store_ms(owner_store, histories, n, a.repeats)
            owner_ms = _owner_ms(manager, control, waiter, histories, n, a.repeats)
            reader_ms, queued_ms, own_ms = (_reader_ms(handing, reader, pool, histories, n, a.repeats)
                                            if owner_store.slab else (float("nan"),) * 3)
            rows.append({"pages": n, "bytes": n * spec.page_bytes, "copy_ms": copy_ms, "store_ms": store_ms,
                         "owner_ms": owner_ms, "fixed_ms": owner_ms - copy_ms, "reader_ms": reader_ms,
                         "reader_fixed_ms": reader_ms - copy_ms, "reader_queued_ms": queued_ms,
                         "reader_own_ms": own_ms, "reader_own_fixed_ms": own_ms - copy_ms})
            print(f"{n:4d} pages ({n * spec.page_bytes / 2**20:7.2f} MiB): pinned copy {copy_ms:6.3f} ms | store "
                  f"{store_ms:6.3f} ms | through the owner {owner_ms:6.3f} ms (fixed {owner_ms - copy_ms:6.3f} ms, "
                  f"{copy_ms / owner_ms:.2f}x the copy's speed) | by the reader {reader_ms:6.3f} ms (fixed "
                  f"{reader_ms - copy_ms:6.3f} ms; queued, before the forward's launch, {queued_ms:6.3f} ms; "
                  f"the reader's own steps {own_ms:6.3f} ms, fixed {own_ms - copy_ms:6.3f} ms)")
    finally:
        reader.close()
        waiter.close()
        control.close()
        putter.close()
        owner_store.close()
        proc.stop()
        pool.close()
    write_dated_report(a.report_dir, "onboard", a.device, {
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "device": a.device, "host": platform.node(),
        "gpu": torch.cuda.get_device_name() if a.device == "cuda" else None, "torch": torch.__version__,
        "spec": spec.to_dict(), "repeats": a.repeats, "results": rows,
    })
    return 0


class _Histories:
    """Distinct histories of n full pages, each offloaded to the store from the pool's first pages."""

    def __init__(self, putter: Any, spec: PoolSpec) -> None:
        self.putter, self.spec, self.made = putter, spec, 0

    def stored(self, n: int) -> np.ndarray:
        self.made += 1
        tokens = np.arange(n * self.spec.page_size, dtype=np.int64) + 10_000_000 * self.made
        task = self.putter.put_async(tokens, slots_for_pages(list(range(n)), self.spec.page_size).numpy(), NS)
        assert self.putter.wait([task], timeout_s=30)[task] is Status.SUCCESS, "offloading a history failed"
        return tokens


def _median_ms(samples: list[float]) -> float:
    return float(np.median(samples[1:])) * 1e3  # the first call warms caches up


def _pinned_copy_ms(pool: PagePool, n: int, repeats: int) -> float:
    dst = pool.tensor[:, 2 * n:3 * n]
    host = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=dst.is_cuda)
    sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)
    samples = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        dst.copy_(host, non_blocking=True)
        sync()
        samples.append(time.perf_counter() - t0)
    return _median_ms(samples)


def _store_ms(store: Any, histories: _Histories, n: int, repeats: int) -> float:
    samples = []
    slots = slots_for_pages(list(range(2 * n, 3 * n)), histories.spec.page_size).numpy()
    for _ in range(repeats + 1):
        tokens = histories.stored(n)
        t0 = time.perf_counter()
        task, held = store.get_prefix_async(tokens, slots, NS, first_page=0)
        assert task is not None and held == n, f"the store holds {held} of {n} pages"
        status = store.try_wait([task], wait_s=30.0)[task]
        samples.append(time.perf_counter() - t0)
        assert status is Status.SUCCESS, status
    return _median_ms(samples)


def _owner_ms(manager: KVCacheManager, control: ControlServer, waiter: ControlClient, histories: _Histories,
              n: int, repeats: int) -> float:
    samples = []
    for user in range(repeats + 1):
        tokens = histories.stored(n)
        t0 = time.perf_counter()
        hit = manager.lookup(user, tokens)
        [lease] = manager.onboard_start_many([manager.allocate(user, tokens, hit)])
        control.wake()
        [outcome] = waiter.onboard_wait([lease.lease_id], timeout_s=30.0)
        samples.append(time.perf_counter() - t0)
        assert outcome.cached_len == tokens.size, f"onboarded {outcome.cached_len} of {tokens.size} tokens"
        manager.abort(lease.lease_id)
    return _median_ms(samples)


def _reader_ms(manager: KVCacheManager, reader: OnboardReader, pool: PagePool, histories: _Histories,
               n: int, repeats: int) -> tuple[float, float, float]:
    """Median ms of a host hit onboarded by the reader: to the copy's end and checked, to the copy
    queued (where hstu_compute launches the forward that reads the pages), and of the reader's own
    steps alone (`start` and `finish`, without the owner's)."""
    samples, queued_samples, own_samples = [], [], []
    S = pool.spec.page_size
    for user in range(repeats + 1):
        tokens = histories.stored(n)
        t0 = time.perf_counter()
        hit = manager.lookup(user, tokens)
        [lease] = manager.onboard_start_many([manager.allocate(user, tokens, hit)])
        [keys] = manager.reader_onboard_keys([lease.lease_id])
        plan = ComputePlan(new_tokens=torch.from_numpy(tokens[lease.device_tokens:]), cached_len=lease.cached_len,
                           onboard_len=lease.num_onboard_pages * S, page_row=torch.tensor(lease.page_row),
                           candidates=torch.ones(1, dtype=torch.int64), namespace_tag=0, lease_id=lease.lease_id,
                           onboard_keys=torch.from_numpy(keys_to_words(list(keys))))
        t_reader = time.perf_counter()
        queued = reader.start(pool, [plan])
        queued_samples.append(time.perf_counter() - t0)
        [copied] = reader.finish(queued)  # waits for the copy (served, the forward is launched first)
        samples.append(time.perf_counter() - t0)
        own_samples.append(time.perf_counter() - t_reader)
        assert copied == n, f"the reader copied {copied} of {n} pages"
        manager.abort(lease.lease_id)
    return _median_ms(samples), _median_ms(queued_samples), _median_ms(own_samples)


if __name__ == "__main__":
    raise SystemExit(main())
