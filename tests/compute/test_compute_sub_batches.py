"""plan_sub_batches: similar requests share a call; a long miss does not pad a batch of hits."""
import pytest

from compute import plan_sub_batches


@pytest.mark.parametrize("shapes, expected", [
    ([], []),
    ([(40, 600)] * 3, [[0, 1, 2]]),  # alike: one call
    ([(10, 20)] * 30, [list(range(30))]),  # tiny: call overhead dominates, always batch
    ([(40, 600), (4200, 4200), (40, 640)], [[0, 2], [1]]),  # the long miss runs alone
    ([(4200, 4200), (4100, 4100)], [[1, 0]]),  # two long misses of similar size batch
])
def test_groups(shapes, expected):
    assert plan_sub_batches(shapes) == expected


def test_every_request_lands_in_exactly_one_group():
    shapes = [(q, k) for q in (8, 64, 300, 2000) for k in (32, 512, 4096)]
    groups = plan_sub_batches(shapes)
    assert sorted(i for g in groups for i in g) == list(range(len(shapes)))
