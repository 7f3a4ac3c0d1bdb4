import json
import os
import subprocess
import sys

import pytest
import torch

from kvlifecycle.pool import SHM_PREFIX, PagePool, PoolSpec, slots_for_pages, sweep_orphaned_pools


def test_attach_sees_creator_bytes_and_close_unlinks(tiny_spec):
    owner = PagePool.create(tiny_spec)
    handle = json.loads(json.dumps(owner.handle()))  # JSON-safe
    other = PagePool.attach(handle)
    assert other.tensor.shape == (2, 8, 2, 4, 1, 2) == tiny_spec.shape

    other.tensor[1, 3, 1] = 5.0  # layer 1, page 3, V
    assert torch.all(owner.tensor[1, 3, 1] == 5.0)
    assert torch.all(owner.tensor[1, 3, 0] == 0.0)

    other.close()  # an attacher never frees
    assert os.path.exists(handle["path"])
    owner.close()
    assert not os.path.exists(handle["path"])
    with pytest.raises(FileNotFoundError, match="gone"):
        PagePool.attach(handle)
    owner.close()  # idempotent


def test_page_bytes(tiny_spec):
    assert tiny_spec.page_bytes == 2 * 2 * 4 * 1 * 2 * 4
    assert tiny_spec.total_bytes == tiny_spec.page_bytes * tiny_spec.num_pages


@pytest.mark.parametrize("field,value,match", [
    ("num_pages", 0, "num_pages"),
    ("page_size", 0, "page_size"),
    ("dtype", "int7", "dtype"),
    ("device", "mps", "device"),
    ("head_dim", True, "head_dim"),
])
def test_spec_rejects(field, value, match):
    kwargs = dict(num_layers=1, num_pages=4, page_size=2, num_heads=1, head_dim=1)
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        PoolSpec(**kwargs)


@pytest.mark.parametrize("page_ids,expected", [
    ([], []),
    ([0], [0, 1, 2, 3]),
    ([2, 0], [8, 9, 10, 11, 0, 1, 2, 3]),
])
def test_slots_for_pages(page_ids, expected):
    assert slots_for_pages(page_ids, 4).tolist() == expected


def test_sweep_removes_only_pools_whose_creator_is_gone(tmp_path):
    """A creator killed with SIGKILL leaves its pool in /dev/shm; the next pool created sweeps it."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(gone.stdout)  # exited and reaped: no process has this pid now (barring reuse)
    orphan = tmp_path / f"{SHM_PREFIX}{dead_pid}-0123456789ab"
    live = tmp_path / f"{SHM_PREFIX}{os.getpid()}-ba9876543210"
    other = tmp_path / "triton_python_backend_shm_region_1"
    for path in (orphan, live, other):
        path.write_bytes(b"x")

    assert sweep_orphaned_pools(str(tmp_path)) == [str(orphan)]
    assert not orphan.exists() and live.exists() and other.exists()
