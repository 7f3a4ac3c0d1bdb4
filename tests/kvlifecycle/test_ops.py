"""The custom ops over a batch of users, eager (as kv_lookup_alloc and kv_offload call them) and
traced by torch.export (as a graph that holds the lifecycle would)."""
import pytest
import torch

from kvlifecycle import ops
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.pool import PagePool, PoolSpec

from .kvl_fakes import FakeStore

SPEC = PoolSpec(num_layers=1, num_pages=16, page_size=4, num_heads=1, head_dim=2)


class Lifecycle(torch.nn.Module):
    """lookup -> allocate -> onboard_launch -> (compute elided) -> offload_launch of a batch, as a graph."""

    def __init__(self, handle: int) -> None:
        super().__init__()
        self.handle = handle

    def forward(self, user_ids, tokens, offsets):
        kv = torch.ops.kvlifecycle
        hits = kv.lookup(self.handle, user_ids, tokens, offsets)
        leases, page_rows = kv.allocate(self.handle, user_ids, tokens, offsets, hits, 30.0)
        leases = kv.onboard_launch(self.handle, leases)
        offloaded = kv.offload_launch(self.handle, leases[:, 0], tokens, offsets)
        return hits, leases, page_rows, offloaded


class Puts:
    """An offloader that commits in the process and keeps what it is handed to put (the ops' only
    use of one: launch). OffloadWorker, kv_offload's, is tested in test_control.py."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr, self.puts = mgr, []

    def launch(self, lease_ids, token_ids):
        committed = self.mgr.commit_many(lease_ids)
        for c, tokens in zip(committed, token_ids):
            if c.items:
                self.puts.append((c.namespace, tokens, c.items))
                self.mgr.offload_done([it.page_id for it in c.items], True)
        return [len(c.items) for c in committed]


def batch(*histories: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.join_tokens([torch.tensor(h, dtype=torch.int64) for h in histories])


@pytest.fixture
def setup():
    """A device cache without a host store: no onboard to settle between the ops of the graph."""
    mgr = KVCacheManager(SPEC, "ns", None, offload=True)  # pages pinned at commit for the offloader
    puts = Puts(mgr)
    handle = ops.register(mgr, puts)
    yield mgr, handle, puts
    ops.unregister(handle)
    mgr.check_invariants()


def test_host_candidates_are_claimed_by_lookup_and_copying_after_onboard_launch():
    pool = PagePool.create(SPEC)
    store = FakeStore(pool.tensor, 4)
    mgr = KVCacheManager(SPEC, "ns", store)
    handle = ops.register(mgr, Puts(mgr))
    try:
        kv = torch.ops.kvlifecycle
        other_tokens, other_offsets = batch(list(range(50, 62)))
        hits = kv.lookup(handle, torch.tensor([3]), other_tokens, other_offsets)
        assert hits.tolist() == [[0, 12]]  # 3 full pages: candidates the onboard asks the store about
        leases, _ = kv.allocate(handle, torch.tensor([3]), other_tokens, other_offsets, hits, 30.0)
        assert leases[0, 2].item() == 3  # reserved as onboard pages
        leases = kv.onboard_launch(handle, leases)
        assert leases[0, 2].item() == 3 and mgr.onboards_in_flight() == 1  # the owner's control thread settles it
        while mgr.onboards_in_flight():
            mgr.poll_onboards()
        assert mgr.onboard_result(leases[0, 0].item()).cached_len == 0  # the store held none of them
        assert kv.offload_launch(handle, leases[:, 0], other_tokens, other_offsets).tolist() == [3]
    finally:
        ops.unregister(handle)
        mgr.check_invariants()
        pool.close()


def test_a_batch_through_the_ops_is_the_managers_lifecycle(setup):
    mgr, handle, puts = setup
    run = Lifecycle(handle)
    users = torch.tensor([7, 8])
    hits, leases, rows, offloaded = run(users, *batch(list(range(10)), list(range(100, 105))))
    assert hits.tolist() == [[0, 0], [0, 0]]  # misses; the store holds nothing yet
    assert leases[:, 1].tolist() == [0, 0] and (rows >= 0).sum(1).tolist() == [3, 2]
    assert offloaded.tolist() == [2, 1]  # full pages committed and handed to the offloader
    assert [len(items) for _, _, items in puts.puts] == [2, 1]
    assert puts.puts[0][1].tolist() == list(range(10))  # a put is keyed by its own user's tokens

    hits, leases, rows, offloaded = run(users[:1], *batch(list(range(14))))  # user 7 grew
    assert hits.tolist() == [[8, 0]] and leases[0, 1].item() == 8 and offloaded.tolist() == [1]
    assert mgr.stats()["pages_offload_pending"] == 0 and mgr.stats()["leases_active"] == 0


def test_a_request_the_pool_cannot_hold_gets_lease_minus_one_and_changes_nothing(setup):
    mgr, handle, _ = setup
    before = mgr.stats()
    tokens, offsets = batch(list(range(SPEC.num_pages * 4 + 4)))  # one page more than the pool
    hits = torch.ops.kvlifecycle.lookup(handle, torch.tensor([1]), tokens, offsets)
    leases, rows = torch.ops.kvlifecycle.allocate(handle, torch.tensor([1]), tokens, offsets, hits, 30.0)
    assert leases.tolist() == [[-1, -1, -1]] and rows.shape == (1, 0)
    after = mgr.stats()
    assert after["pool_exhausted"] == before["pool_exhausted"] + 1 and after["pages_free"] == before["pages_free"]


def test_export_traces_and_runs(setup):
    mgr, handle, _ = setup
    b, t = torch.export.Dim("b", min=1, max=64), torch.export.Dim("t", min=8, max=4096)
    example = (torch.tensor([7, 8]), *batch(list(range(10)), list(range(100, 105))))
    ep = torch.export.export(Lifecycle(handle), example, dynamic_shapes=({0: b}, {0: t}, {0: b + 1}))
    targets = [str(node.target) for node in ep.graph.nodes if node.op == "call_function"]
    for name in ("lookup", "allocate", "onboard_launch", "offload_launch"):
        assert f"kvlifecycle.{name}.default" in targets
    assert mgr.stats()["allocations"] == 0  # tracing ran the fakes only
    _, leases, rows, _ = ep.module()(torch.tensor([9]), *batch(list(range(21))))
    assert (rows >= 0).sum().item() == 6 and leases[0, 1].item() == 0


def test_unknown_handle_is_a_clear_error():
    tokens, offsets = batch([1, 2, 3, 4])
    with pytest.raises(KeyError, match="no manager registered under handle 999999"):
        torch.ops.kvlifecycle.lookup(999999, torch.tensor([1]), tokens, offsets)
