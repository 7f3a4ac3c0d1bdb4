import pytest
import torch

from kvlifecycle import ops
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.offload_worker import Offloader
from kvlifecycle.pool import PagePool, PoolSpec

from .kvl_fakes import FakeStore

SPEC = PoolSpec(num_layers=1, num_pages=16, page_size=4, num_heads=1, head_dim=2)


class Lifecycle(torch.nn.Module):
    """lookup -> allocate -> onboard -> (compute elided) -> offload -> reap, as a graph."""

    def __init__(self, handle: int) -> None:
        super().__init__()
        self.handle = handle

    def forward(self, user_id, tokens):
        kv = torch.ops.kvlifecycle
        hit = kv.lookup(self.handle, user_id, tokens)
        meta, page_row = kv.allocate(self.handle, user_id, tokens, hit, 4, 30.0)
        task = kv.onboard_launch(self.handle, meta)
        meta = kv.onboard_wait(self.handle, meta, task, 1.0)
        launched = kv.offload_launch(self.handle, meta, tokens)
        reaped = kv.offload_reap(self.handle, 0.0)
        return hit, meta, page_row, launched, reaped


@pytest.fixture
def setup():
    pool = PagePool.create(SPEC)
    store = FakeStore(pool.tensor, 4)
    mgr = KVCacheManager(SPEC, "ns", store)
    handle = ops.register(mgr, Offloader(store, 4, mgr.offload_done))
    yield mgr, handle
    ops.unregister(handle)
    mgr.check_invariants()
    pool.close()


def test_eager(setup):
    mgr, handle = setup
    run = Lifecycle(handle)
    hit, meta, row, launched, reaped = run(torch.tensor([7]), torch.arange(10))
    assert hit.tolist() == [0, 0] and meta[1].item() == 0 and row.numel() == 3
    assert (launched.item(), reaped.item()) == (2, 1)
    hit, meta, row, launched, _ = run(torch.tensor([7]), torch.arange(14))
    assert hit.tolist() == [8, 0] and meta[1].item() == 8 and launched.item() == 1
    assert mgr.stats()["pages_offload_pending"] == 0


def test_export_traces_and_runs(setup):
    mgr, handle = setup
    n = torch.export.Dim("n", min=8, max=4096)
    ep = torch.export.export(Lifecycle(handle), (torch.tensor([7]), torch.arange(10)),
                             dynamic_shapes=({}, {0: n}))
    targets = [str(node.target) for node in ep.graph.nodes if node.op == "call_function"]
    for name in ("lookup", "allocate", "onboard_launch", "onboard_wait", "offload_launch", "offload_reap"):
        assert f"kvlifecycle.{name}.default" in targets
    assert mgr.stats()["allocations"] == 0  # tracing ran the fakes only
    _, meta, row, _, _ = ep.module()(torch.tensor([7]), torch.arange(21))
    assert row.numel() == 6 and meta[1].item() == 0


def test_unknown_handle_is_a_clear_error():
    with pytest.raises(KeyError, match="no manager registered under handle 999999"):
        torch.ops.kvlifecycle.lookup(999999, torch.tensor([1]), torch.arange(4))
