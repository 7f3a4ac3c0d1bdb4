"""How the FlexKV store turns a task's whole pages into FlexKV's token mask and slot mapping, and
what its ``get_prefix`` asks FlexKV for (over a FAKE ``KVManager``). Runs everywhere (no FlexKV
needed); the store itself is tested on a GPU in test_store_flexkv.py."""
from __future__ import annotations

import numpy as np
import pytest

from kvlifecycle.store.flexkv import _token_mask_and_slots

S = 4  # page size


def test_consecutive_pages_become_one_masked_run_with_slots_in_token_order():
    seq_pages, pool_pages = np.array([3, 2]), np.array([7, 5])  # out of order on purpose

    mask, slots = _token_mask_and_slots(5 * S + 1, seq_pages, pool_pages, S, num_pool_pages=16)

    assert mask.tolist() == [False] * 2 * S + [True] * 2 * S + [False] * (S + 1)
    assert slots.tolist() == [5 * S + i for i in range(S)] + [7 * S + i for i in range(S)]


@pytest.mark.parametrize("seq_pages, why", [([0, 2], "a gap"), ([1, 1], "a page twice")])
def test_pages_that_are_not_one_run_are_refused(seq_pages, why):
    with pytest.raises(ValueError, match="consecutive"):
        _token_mask_and_slots(4 * S, np.array(seq_pages), np.array([0, 1]), S, num_pool_pages=16)


@pytest.mark.parametrize("seq_pages, pool_pages, field", [([4], [0], "seq_pages"), ([0], [16], "pool_pages")])
def test_pages_out_of_range_are_refused_naming_the_field(seq_pages, pool_pages, field):
    with pytest.raises(ValueError, match=field):
        _token_mask_and_slots(4 * S, np.array(seq_pages), np.array(pool_pages), S, num_pool_pages=16)


class FakeKVManager:
    """A FAKE of FlexKV's ``KVManager`` (FlexKV is not installed here): it holds the first
    ``held_pages`` pages of any sequence and records the gets it is asked for."""

    def __init__(self, held_pages: int) -> None:
        self.held_pages = held_pages
        self.gets: list[tuple[np.ndarray, np.ndarray]] = []  # (mask, slots)

    def get_match(self, tokens, namespace):
        mask = np.zeros(len(tokens), dtype=bool)
        mask[: self.held_pages * S] = True
        return 1, mask

    def cancel(self, task_ids):
        pass

    def get_async(self, tokens, slots, mask, namespace):
        self.gets.append((np.asarray(mask), np.asarray(slots)))
        return 2


def flexkv_server_over(manager: FakeKVManager, ready: bool = True):
    """The FlexKV store server's dispatch over ``manager``, built without FlexKV (``__init__``
    refuses to run where FlexKV is not importable)."""
    import collections

    from kvlifecycle.pool import PoolSpec
    from kvlifecycle.store.flexkv import FlexKVStoreServer, _FlexKVPool

    server = FlexKVStoreServer.__new__(FlexKVStoreServer)
    server._tasks, server._counters = {}, collections.Counter()
    pool = _FlexKVPool(PoolSpec(num_layers=1, num_pages=16, page_size=S, num_heads=1, head_dim=2, device="cuda"),
                       manager=manager)
    if ready:
        pool.ready.set()
    server._pools = {"pool-a": pool}
    return server


def get_prefix(server, first_page: int, num_pages: int, task: int = 7) -> dict:
    header = {"op": "get_prefix", "client": "c", "pool": "pool-a", "page_size": S, "ns": "ns", "task": task,
              "accept_by": 1e18, "start_by": 1e18}
    seq_pages = np.arange(first_page, num_pages)
    arrays = {"tokens": np.arange(num_pages * S, dtype=np.int64), "seq_pages": seq_pages,
              "pool_pages": seq_pages + 8}
    return server._dispatch(header, arrays)


def test_flexkv_get_prefix_copies_only_the_candidates_inside_the_held_prefix():
    manager = FakeKVManager(held_pages=3)
    server = flexkv_server_over(manager)
    assert get_prefix(server, first_page=1, num_pages=5) == {"pages": 3, "copying": True}
    [(mask, slots)] = manager.gets
    assert mask.tolist() == [False] * S + [True] * 2 * S + [False] * 2 * S  # pages 1-2 of 0-4
    assert slots.tolist() == [9 * S + i for i in range(S)] + [10 * S + i for i in range(S)]
    assert ("c", 7) in server._tasks


@pytest.mark.parametrize("held, ready", [(1, True), (0, True), (3, False)])
def test_flexkv_get_prefix_with_nothing_to_copy_starts_no_task(held, ready):
    manager = FakeKVManager(held_pages=held)
    server = flexkv_server_over(manager, ready=ready)
    assert get_prefix(server, first_page=1, num_pages=5) == {"pages": held if ready else 0, "copying": False}
    assert manager.gets == [] and server._tasks == {}
