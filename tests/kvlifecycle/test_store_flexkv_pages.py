"""How the FlexKV store turns a task's whole pages into FlexKV's token mask and slot mapping.
Runs everywhere (no FlexKV needed); the store itself is tested on a GPU in test_store_flexkv.py."""
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
