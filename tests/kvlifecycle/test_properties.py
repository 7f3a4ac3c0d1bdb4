"""Random interleavings of the whole lifecycle on a 6-page pool (hypothesis, stateful).

Each page's KV is a signature of its chain key written by "compute" (or restored by an
onboard). After every step: the table's invariants hold, every committed page still holds its
key's signature (no committed page was overwritten or lost), and every live lease's pages
still hold what it wrote (no page owned twice). At the end, aborting and reaping everything
returns the pool to baseline."""

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvlifecycle.hashing import page_keys
from kvlifecycle.manager import KVCacheManager
from kvlifecycle.offload_worker import Offloader
from kvlifecycle.page_table import PoolExhausted
from kvlifecycle.pool import PagePool, PoolSpec

from .kvl_fakes import FakeStore

S = 2
SPEC = PoolSpec(num_layers=1, num_pages=6, page_size=S, num_heads=1, head_dim=1)
TTL = 5.0
tokens_st = st.lists(st.integers(1, 3), min_size=0, max_size=5)


def sig(key: bytes) -> float:
    return float(int.from_bytes(key[:3], "little") + 1)  # exact in float32, never 0


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pool = PagePool.create(SPEC)
        self.store = FakeStore(self.pool.tensor, S)
        self.mgr = KVCacheManager(SPEC, "ns", self.store, clock=lambda: self.now,
                                  lease_ttl_s=TTL, offload_ttl_s=2 * TTL)
        self.offloader = Offloader(self.store, S, self.mgr.offload_done)
        self.histories: dict[int, list[int]] = {}
        self.leases: dict[int, tuple[list[int], object, float]] = {}  # id -> tokens, alloc, written
        self.to_offload: list[tuple[list[int], list]] = []
        self.expected: dict[int, list[float]] = {}  # lease id -> value of each page of its row

    def page(self, page_id: int) -> float:
        return float(self.pool.tensor[0, page_id, 0, 0, 0, 0])

    @rule(user=st.integers(0, 2), suffix=tokens_st, rewrite_at=st.none() | st.integers(0, 8),
          store_fails=st.booleans(), fresh=st.booleans())
    def request(self, user, suffix, rewrite_at, store_fails, fresh):
        tokens = ([] if fresh else self.histories.get(user, [])) + suffix
        if rewrite_at is not None and rewrite_at < len(tokens):
            tokens[rewrite_at] = 4 + user  # a token no history had there before
        self.histories[user] = tokens
        keys = page_keys(tokens, "ns", S)
        hit = self.mgr.lookup(user, tokens)
        for i, page in enumerate(hit.device_pages):
            assert self.page(page) == sig(keys[i]), f"device page {page} of prefix page {i} is stale"
        before = self.mgr.stats()
        try:
            alloc = self.mgr.allocate(user, tokens, hit)
        except PoolExhausted:
            after = self.mgr.stats()
            assert after["pool_exhausted"] == before["pool_exhausted"] + 1
            # A lookup whose host candidates were never asked about is counted when it ends here.
            counted = {"pool_exhausted", "lookups_device_hit", "lookups_miss"}
            assert {k: v for k, v in after.items() if k not in counted} == {
                k: v for k, v in before.items() if k not in counted}
            return
        self.store.get_status = "FAILED" if store_fails else None
        alloc = self.mgr.onboard(alloc)
        self.store.get_status = None
        first_new = alloc.cached_len // S
        for i in range(first_new):
            assert self.page(alloc.page_row[i]) == sig(keys[i]), f"cached page {i} holds wrong KV"
        for i in range(first_new, len(keys)):  # compute writes the new full pages
            self.pool.tensor[:, alloc.page_row[i]] = sig(keys[i])
        partial = -float(alloc.lease_id)
        if alloc.partial_page is not None:
            self.pool.tensor[:, alloc.partial_page] = partial
        self.leases[alloc.lease_id] = (tokens, alloc, partial)
        self.expected[alloc.lease_id] = [sig(k) for k in keys] + ([partial] if alloc.partial_page is not None else [])

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), offload_now=st.booleans())
    def commit(self, data, offload_now):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        tokens, alloc, partial = self.leases.pop(lease_id)
        items = self.mgr.commit(lease_id)
        for it in items:
            assert self.page(it.page_id) == sig(it.key)
        if items:
            self.to_offload.append((tokens, items))
        if offload_now and items:
            self.offload_and_reap(ok=True)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def abort(self, data):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        del self.leases[lease_id]
        assert self.mgr.abort(lease_id) is True

    @rule(dt=st.floats(0.5, 12.0))
    def time_passes(self, dt):
        self.now += dt
        expired = set(self.mgr.expire_leases())
        assert expired == {lid for lid, (_, a, _) in self.leases.items() if a.expires_at <= self.now}
        for lid in expired:
            del self.leases[lid]

    @precondition(lambda self: self.to_offload)
    @rule(ok=st.booleans())
    def offload_and_reap(self, ok):
        tokens, items = self.to_offload.pop()
        self.store.put_status = None if ok else "FAILED"
        self.offloader.launch("ns", tokens, items)
        self.store.put_status = None
        self.offloader.reap()

    @invariant()
    def consistent(self):
        self.mgr.check_invariants()
        for page, key in self.mgr.leases.pages._page_key.items():
            assert self.page(page) == sig(key), f"committed page {page} was overwritten"
        for lid, (_, alloc, _) in self.leases.items():  # read pins and leased pages hold
            got = [self.page(p) for p in self.mgr.leases.get_lease(lid).page_row]
            assert got == self.expected[lid], f"lease {lid}: a page it reads or writes was reused"

    def teardown(self):
        for lease_id in list(self.leases):
            self.mgr.abort(lease_id)
        for tokens, items in self.to_offload:
            self.offloader.launch("ns", tokens, items)
        self.offloader.reap()
        self.now += 100 * TTL
        self.mgr.expire_leases()
        s = self.mgr.stats()
        self.mgr.check_invariants()
        assert (s["pages_leased"], s["pages_pinned"], s["leases_active"], s["pages_offload_pending"]) == (0, 0, 0, 0), s
        assert s["pages_free"] + s["pages_committed"] == SPEC.num_pages, s
        self.pool.close()


Lifecycle.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestLifecycle = Lifecycle.TestCase


@settings(max_examples=60, deadline=None)
@given(history=st.lists(st.integers(1, 50), min_size=1, max_size=24), k=st.integers(0, 23),
       ns=st.sampled_from(["a", "b"]))
def test_rewritten_history_or_namespace_recomputes_from_the_first_difference(history, k, ns):
    spec = PoolSpec(num_layers=1, num_pages=16, page_size=4, num_heads=1, head_dim=1)
    mgr = KVCacheManager(spec, "a")
    mgr.commit(mgr.allocate(1, history).lease_id)
    k = min(k, len(history) - 1)
    rewritten = list(history)
    rewritten[k] = 99
    expected = (k // 4) * 4
    assert mgr.lookup(1, rewritten).device_tokens == expected
    other = KVCacheManager(spec, ns)
    other.leases = mgr.leases  # same pages, another model's namespace
    assert other.lookup(1, history).device_tokens == (len(history) // 4 * 4 if ns == "a" else 0)
