"""plan_sub_batches: similar requests share a call; a long miss does not pad a batch of hits."""
import pytest

from compute import plan_sub_batches
from compute.batch import CALL_COST


@pytest.mark.parametrize("shapes, expected", [
    ([], []),
    ([(40, 600)] * 3, [[0, 1, 2]]),  # alike: one call
    ([(10, 20)] * 30, [list(range(30))]),  # tiny: call overhead dominates, always batch
    ([(40, 600), (4200, 4200), (40, 640)], [[0, 2], [1]]),  # the long miss runs alone
])
def test_groups(shapes, expected):
    assert plan_sub_batches(shapes) == expected


def test_padding_is_priced_per_device():
    """Two long misses of similar size: on the GPU the padding is cheaper than a second launch-bound
    call; on the CPU a padded cell costs a real one's arithmetic, more than a call's fixed cost."""
    shapes = [(4200, 4200), (4100, 4100)]
    assert plan_sub_batches(shapes, CALL_COST["cuda"]) == [[1, 0]]
    assert plan_sub_batches(shapes, CALL_COST["cpu"]) == [[1], [0]]


def test_every_request_lands_in_exactly_one_group():
    shapes = [(q, k) for q in (8, 64, 300, 2000) for k in (32, 512, 4096)]
    groups = plan_sub_batches(shapes)
    assert sorted(i for g in groups for i in g) == list(range(len(shapes)))
